"""Stage 6-7: the prefiller, and forwards through a reuse cache driven explicitly.

:class:`ChunkPrefiller` fills a :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (the container: layers, tokens,
ledgers) for a prompt: it plans the prompt's reuse (:func:`~kvboost_hf.reuse.plan.plan_reuse`), stitches the hits
(:mod:`~kvboost_hf.reuse.stitch`), chooses repairs of approximate hits (:mod:`~kvboost_hf.reuse.repair`, the
CacheBlend probe in :mod:`~kvboost_hf.hf.probe`) and returns what is left to compute (:class:`PendingForward`), or
runs the repair forward itself. Every cache has one (``cache.prefiller``).

:func:`prepare_forward` turns one forward's keyword arguments into that remainder: the uncached tail, or one
sparse repair forward folded with the tail. :func:`forward` runs ``prepare_forward``, the model's ``forward`` and
the cache's ``record``, in that order: the decode loop, the draft, the engine's ``warm`` and shared prefixes call
it, so none of them depends on hooks. The adapter in :mod:`kvboost_hf.hf.hooks` calls the same two steps around a
forward that ``generate()`` makes.

A cache without a prefiller (a ``DynamicCache``) is used as is.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.config import GenerationMode, RepairConfig
from kvboost_hf.hf.blend import LayerFilter, install_layer_narrowing
from kvboost_hf.hf.layers import ChunkReuseLayer, grown_capacity
from kvboost_hf.hf.models import CACHE_ARGUMENT, kv_entry_shape, model_dtype
from kvboost_hf.hf.static_buffers import StaticStacks
from kvboost_hf.reuse.plan import ChunkLedger, ChunkSource, ReusePlan, plan_reuse
from kvboost_hf.reuse.repair import RepairSelection, candidates_per_layer, position_mask, select_repairs
from kvboost_hf.reuse.rope import KeyRotator, UnsupportedRopeError, exact_reuse_length
from kvboost_hf.reuse.stitch import place_hits, write_leading_runs

logger = logging.getLogger(__name__)


@dataclass
class RowReuse:
    """Reuse achieved for one batch row in the last prompt forward (tokens).

    ``cached_tokens`` were loaded and not recomputed; of them, ``approx_tokens`` came from content-key hits.
    ``recomputed_tokens`` is the repair work spent on loaded chunks.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_chunks: int = 0
    approx_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class PendingForward:
    """What is left to compute after :meth:`ChunkPrefiller.prefill`.

    Dense (``position_ids is None``): feed ``input_ids`` as an ordinary continuation of the cache (it holds
    ``cached_columns`` columns). Sparse: one forward over ``input_ids`` at ``position_ids`` with the 4D
    ``attention_mask``, passing the same cache, which scatters their K/V into place.
    """

    input_ids: torch.Tensor
    cached_columns: int
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for ``model(...)`` (add the cache under :data:`~kvboost_hf.hf.models.CACHE_ARGUMENT`)."""
        inputs = {"input_ids": self.input_ids}
        if self.position_ids is not None and self.attention_mask is not None:
            inputs.update(position_ids=self.position_ids, attention_mask=self.attention_mask)
        return inputs


_ROTATORS: weakref.WeakKeyDictionary[torch.nn.Module, KeyRotator | None] = weakref.WeakKeyDictionary()


def rotator_for(model: PreTrainedModel) -> KeyRotator | None:
    """A key rotator for ``model`` (one per model), or None (logged once) when non-prefix reuse cannot be exact."""
    if model in _ROTATORS:
        return _ROTATORS[model]
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"]
    rotator = None
    if getattr(config, "sliding_window", None) and "sliding_attention" in layer_types:
        logger.info("non-prefix reuse is off for sliding-window models (its repair mask has no window)")
    else:
        try:
            rotator = KeyRotator(model)
        except UnsupportedRopeError as exc:
            logger.warning("%s", exc)
    _ROTATORS[model] = rotator
    return rotator


_WARNED_PAST_EXACT_LENGTH: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def stop_reuse_past_exact_length(cache: Any, columns: int) -> None:
    """Turn ``cache``'s reuse and write-back off for good (logged once per model) before a forward that makes it
    hold ``columns`` columns, when the model's RoPE frequencies depend on the sequence length and ``columns``
    passes :func:`~kvboost_hf.reuse.rope.exact_reuse_length`: K/V computed then use other frequencies than the
    stored ones (computed in shorter sequences), so neither may be mixed with the other."""
    model = cache.model
    limit = exact_reuse_length(model)
    if limit is None or columns <= limit or not cache.reuse_enabled:
        return
    cache.reuse_enabled = False
    if model in _WARNED_PAST_EXACT_LENGTH:
        return
    _WARNED_PAST_EXACT_LENGTH.add(model)
    logger.warning(
        "ChunkReuseCache: %s's RoPE frequencies depend on the sequence length past %d tokens; reuse and "
        "write-back are off for a cache of %d columns",
        type(model).__name__,
        limit,
        columns,
    )


class PrefillTarget(Protocol):
    """What :class:`ChunkPrefiller` reads and writes of a cache (:class:`~kvboost_hf.hf.cache.ChunkReuseCache` is
    one): its settings, its per-row state (``tokens``, ``pads``, ``ledgers``), its layers, and the calls that start
    a layout, arm a sparse forward and record a finished one."""

    model: PreTrainedModel
    mode: GenerationMode
    store: ChunkSource
    namespace: str
    chunking: ChunkingConfig
    repair: RepairConfig
    tokens: torch.Tensor
    pads: list[int]
    ledgers: list[ChunkLedger]
    layers: list[ChunkReuseLayer]
    last_reuse: list[RowReuse]
    stitched_bytes: int
    reuse_enabled: bool
    layer_filter: LayerFilter | None
    stitch_capacity: Callable[[int], int | None] | None

    @property
    def num_columns(self) -> int: ...

    def static_stacks(self, rows: int, capacity: int) -> StaticStacks | None: ...

    def set_max_cache_len(self, max_cache_len: int | None, stacks: StaticStacks | None = None) -> None: ...

    def check_extends(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None: ...

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None: ...

    def arm_scatter(
        self, positions: torch.Tensor, tokens: torch.Tensor, layer_filter: LayerFilter | None = None
    ) -> None: ...

    def attention_kwargs(self) -> dict[str, Any]: ...

    def record(self, fed_ids: torch.Tensor | None) -> None: ...


class ChunkPrefiller:
    """Loads and repairs what the store holds for a prompt into a cache (a :class:`PrefillTarget`).

    It keeps only what depends on the model (its key rotator, K/V entry shape, device and dtype), so it holds no
    reference to the cache: the cache owns its prefiller, each call is handed the cache. It reads the cache's
    settings (store, namespace, chunking, repair) and each row's segment starts (its ledger's) and writes only
    through the container's state: stitched columns go into its layers, ``tokens`` and ledgers; a sparse forward is
    armed with :meth:`~kvboost_hf.hf.cache.ChunkReuseCache.arm_scatter` and completed by ``record()``. Reuse
    results go to ``cache.last_reuse``.
    """

    def __init__(self, model: PreTrainedModel, mode: GenerationMode) -> None:
        self.model = model
        self.rotator = rotator_for(model) if mode is GenerationMode.CHUNK_KV_REUSE else None
        self.entry_shape = kv_entry_shape(model)

    @torch.no_grad()
    def prefill(
        self,
        cache: PrefillTarget,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        keep: int = 1,
        defer: bool = False,
        report: bool = True,
        continues: bool = False,
    ) -> PendingForward:
        """Load and repair what the store holds for the prompt ``input_ids`` (the full sequence, extending what the
        cache holds); return what is left to compute.

        The last ``keep`` tokens are always left to compute (they give logits). Without ``defer`` the cache ends
        dense: any repair forward runs here, and the result is a plain suffix of ``input_ids`` to feed (what
        ``generate()`` feeds on its own when given this cache). With ``defer`` a repair forward is returned
        instead, folded with the tail (one forward fewer): the caller must run it next with this cache.
        ``attention_mask`` (2D, batch x columns) marks left padding; any other layout disables reuse for the call.
        ``report`` records the reuse in ``cache.last_reuse`` (off for forwards after a generation's prompt, e.g.
        the multi-token verify forwards of assisted decoding, which may also stitch stored chunks); with
        ``continues``, this forward carries on the prompt reported before (the next chunk of transformers' chunked
        prefill): its figures add to that report, the prompt's length updated.
        """
        cache.check_extends(input_ids)
        stop_reuse_past_exact_length(cache, input_ids.shape[1])
        if cache.num_columns == 0:
            cache.begin(input_ids, attention_mask)
        cached = cache.num_columns
        if not cache.reuse_enabled or cache.mode is GenerationMode.BASELINE or input_ids.shape[1] - cached <= keep:
            if report and continues:
                _report(cache, input_ids.shape[1], cached, [[] for _ in cache.pads], continues)
            return PendingForward(input_ids[:, cached:], cached)
        full = input_ids.to(cache.tokens.device)
        limit = full.shape[1] - keep
        plan = self._plan(cache, full, limit)
        if plan.sparse:
            pending = self._prepare_sparse(cache, full, plan)
            return pending if defer else self._compute_sparse_head(cache, pending, full, limit)
        target = plan.stitch_columns(cache.pads, cached, limit)
        if report:
            _report(cache, full.shape[1], target, [row.hits for row in plan.rows], continues)
        if target > cached:
            self._stitch(cache, plan, full, cached, target)
        return PendingForward(input_ids[:, target:], target)

    def _plan(self, cache: PrefillTarget, full: torch.Tensor, limit: int) -> ReusePlan:
        cached = cache.num_columns
        sparse_possible = cached == 0 and full.shape[0] == 1 and self.rotator is not None
        return plan_reuse(
            cache.store,
            cache.ledgers,
            [full[row, pad:].tolist() for row, pad in enumerate(cache.pads)],
            [max(cached - pad, 0) for pad in cache.pads],
            [limit - pad for pad in cache.pads],
            namespace=cache.namespace,
            chunking=cache.chunking,
            approximate=sparse_possible,
            entry_shape=self.entry_shape,
            device=self.device_and_dtype()[0],
        )

    def _stitch(self, cache: PrefillTarget, plan: ReusePlan, full: torch.Tensor, start: int, stop: int) -> None:
        """Append every row's leading exact hits for columns ``[start, stop)``, copied once from their tier into
        layer buffers sized for the whole prompt (:func:`~kvboost_hf.hf.cache.grown_capacity`): the prompt's
        remaining tokens and the decode steps then write in place."""
        device, dtype = self.device_and_dtype()
        layers, heads, head_dim = self.entry_shape
        rows = full.shape[0]
        capacity = cache.stitch_capacity(stop) if cache.stitch_capacity is not None else None
        stacks = cache.static_stacks(rows, capacity) if capacity is not None and start == 0 else None
        if stacks is not None:  # the static buffers the graphed prompt forward runs on: no second copy
            keys, values = stacks.keys, stacks.values
        else:
            shape = (layers, rows, heads, grown_capacity(full.shape[1]), head_dim)
            keys = torch.empty(shape, dtype=dtype, device=device)
            values = torch.empty(shape, dtype=dtype, device=device)
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=True):
            if start:
                layer_keys[:, :, :start].copy_(layer.keys)
                layer_values[:, :, :start].copy_(layer.values)
        hits = [row.hits for row in plan.rows]
        cache.stitched_bytes += write_leading_runs(keys, values, hits, cache.pads, start, stop)
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=True):
            layer.take_buffers(layer_keys, layer_values, stop)  # written: a static layer copies them in
        if stacks is not None:
            cache.set_max_cache_len(capacity, stacks)  # the layers hold the stacks' leading columns: no copy
        cache.tokens = full[:, :stop].clone()
        for ledger, pad in zip(cache.ledgers, cache.pads, strict=True):
            ledger.stored = max(ledger.stored, sum(1 for _, end in ledger.spans if end <= stop - pad))
            ledger.exact_tokens = max(ledger.exact_tokens, stop - pad)

    def _prepare_sparse(self, cache: PrefillTarget, full: torch.Tensor, plan: ReusePlan) -> PendingForward:
        """Stitch row 0's hits at their positions, choose repairs, and arm the forward over what is left."""
        assert self.rotator is not None  # sparse plans need one
        row = plan.rows[0]
        device, dtype = self.device_and_dtype()
        keys, values = place_hits(row, self.rotator, device, dtype)
        for layer, layer_keys, layer_values in zip(cache.layers, keys, values, strict=True):
            layer.adopt(layer_keys, layer_values)

        selection = select_repairs(row, cache.repair)
        cache.ledgers[0].approximate = frozenset(selection.approx.nonzero().squeeze(1).tolist())
        positions = (selection.compute | selection.candidates).nonzero().squeeze(1).to(device)
        layer_filter = None
        if candidates := int(selection.candidates.sum()):
            install_layer_narrowing(cache.model)
            layer_filter = LayerFilter(
                positions,
                selection.candidates[positions.cpu()],
                candidates_per_layer(cache.repair, candidates, selection.budget, len(cache.layers)),
                cache.repair.deviation,
                lambda computed: _settle(cache, selection.settled(computed)),
            )
        else:
            _settle(cache, selection)
        cache.arm_scatter(positions, full.clone(), layer_filter)
        return PendingForward(
            full[:, positions.cpu()].to(device),
            0,
            position_ids=positions[None],
            attention_mask=position_mask(positions, full.shape[1], dtype),
        )

    def _compute_sparse_head(
        self, cache: PrefillTarget, pending: PendingForward, full: torch.Tensor, limit: int
    ) -> PendingForward:
        """Run the armed sparse forward for its positions before ``limit``; leave the cache dense up to there."""
        assert pending.position_ids is not None and pending.attention_mask is not None
        head = pending.position_ids[0] < limit
        if cache.layer_filter is not None:
            cache.layer_filter.restrict(head)
        cache.arm_scatter(pending.position_ids[0, head], full[:, :limit].clone(), cache.layer_filter)
        if bool(head.any()):  # forward(), not __call__: works whether or not the adapter's hooks can run
            cache.model.forward(
                input_ids=pending.input_ids[:, head],
                position_ids=pending.position_ids[:, head],
                attention_mask=pending.attention_mask[:, :, head],
                use_cache=True,
                logits_to_keep=1,
                **{CACHE_ARGUMENT: cache},
                **cache.attention_kwargs(),
            )
        cache.record(None)
        return PendingForward(full[:, limit:].to(pending.input_ids.device), limit)

    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        """Where the model's parameters live and the dtype its K/V are computed in."""
        param = next(self.model.parameters())
        return param.device, model_dtype(self.model)


def _report(cache: PrefillTarget, columns: int, target: int, hits: list[list[Any]], continues: bool) -> None:
    """``cache.last_reuse`` after a dense prompt forward over ``columns`` columns whose first ``target`` the cache
    holds once the ``hits`` (per row) are stitched in: each row's prompt tokens and the tokens not computed (held
    before, or loaded now). ``continues``: the forward carries on the prompt reported last (a later chunk of a
    chunked prefill), whose loaded tokens and hits it adds to; the columns its earlier chunks computed are not
    counted as cached."""
    cached = cache.num_columns
    earlier = cache.last_reuse if continues and len(cache.last_reuse) == len(cache.pads) else None
    reports = []
    for row, (pad, row_hits) in enumerate(zip(cache.pads, hits, strict=True)):
        loaded = max(0, target - pad) - max(0, cached - pad)
        before = earlier[row] if earlier is not None else RowReuse(cached_tokens=max(0, cached - pad))
        reports.append(
            replace(
                before,
                prompt_tokens=columns - pad,
                cached_tokens=before.cached_tokens + loaded,
                hit_chunks=before.hit_chunks + len(row_hits),
            )
        )
    cache.last_reuse = reports


def _settle(cache: PrefillTarget, selection: RepairSelection) -> None:
    """Record what the repair forward recomputed: the row's stale positions and its reuse figures. Under an
    APE-style context adjustment the queries after the last approximate column ran with the adjusted attention:
    the row is exact up to that column at most (and stays so: :meth:`ChunkReuseCache.record`)."""
    ledger = cache.ledgers[0]
    ledger.stale = frozenset(selection.stale)
    ledger.exact_tokens = selection.exact_tokens
    if cache.repair.adjusts_attention and ledger.approximate:
        ledger.exact_tokens = min(ledger.exact_tokens, max(ledger.approximate) + 1)
    cache.last_reuse = [
        RowReuse(
            prompt_tokens=int(selection.reused.numel()),
            cached_tokens=selection.cached_tokens,
            hit_chunks=selection.hit_chunks,
            approx_tokens=len(selection.stale),
            recomputed_tokens=selection.recomputed_tokens,
        )
    ]


def reuse_cache(cache: Any) -> Any | None:
    """``cache`` when it is a reuse cache (has a ``prefill`` and ``record``), else None."""
    return cache if hasattr(cache, "prefill") and hasattr(cache, "record") else None


def prepare_forward(
    cache: Any, kwargs: dict[str, Any], *, report: bool = True, continues: bool = False
) -> dict[str, Any]:
    """The forward's keyword arguments once ``cache`` loaded what it holds for them (``kwargs`` is updated), with
    the cache's :meth:`~kvboost_hf.hf.cache.ChunkReuseCache.attention_kwargs` (an APE-style context adjustment).

    A forward that asks for every position's logits, hidden states or attentions is computed whole (and still
    recorded and written back); a decode step (no more new tokens than ``logits_to_keep``) has nothing to look up.
    ``report`` records the loaded tokens in ``cache.last_reuse`` (a generation's prompt forward; ``continues``: a
    later chunk of it, added to its report).
    """
    kwargs = _load_for_forward(cache, kwargs, report, continues)
    kwargs.update(cache.attention_kwargs())
    return kwargs


def _load_for_forward(cache: Any, kwargs: dict[str, Any], report: bool, continues: bool) -> dict[str, Any]:
    """:func:`prepare_forward` without the attention arguments."""
    fed = kwargs.get("input_ids")
    if fed is not None:
        cache.ensure_room(fed.shape[1])
        stop_reuse_past_exact_length(cache, cache.num_columns + fed.shape[1])
    if fed is None or cache.expects_sparse_forward or not cache.reuse_enabled:
        return kwargs
    keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep < 1 or kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        keep = fed.shape[1]  # the caller wants outputs for every position: skipping tokens would drop them
    cached = cache.num_columns
    if cached and fed.shape[1] <= keep:
        return kwargs
    full = torch.cat([cache.tokens.to(fed.device), fed], dim=1) if cached else fed
    pending = cache.prefill(
        full, kwargs.get("attention_mask"), keep=keep, defer=True, report=report, continues=continues
    )
    if pending.position_ids is not None:
        kwargs.update(pending.model_inputs())
    elif (skip := pending.cached_columns - cached) > 0:
        kwargs["input_ids"] = fed[:, skip:]
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = kwargs["position_ids"][..., skip:]
        if (mask := kwargs.get("attention_mask")) is not None:
            kwargs["attention_mask"] = _skip_mask_queries(mask, fed.shape[1], skip)
    return kwargs


def _skip_mask_queries(mask: Any, queries: int, skip: int) -> Any:
    """A prepared 4D mask (``[B, 1, queries, kv]``, or a dict of them per layer type, as ``generate()`` builds for a
    compileable cache) without its first ``skip`` query rows: the tokens the cache loaded instead. A 2D padding
    mask covers every column and is returned as is."""
    if isinstance(mask, dict):
        return {kind: _skip_mask_queries(each, queries, skip) for kind, each in mask.items()}
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-2] == queries:
        return mask[:, :, skip:]
    return mask


def forward_inputs(cache: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments of one forward through ``cache`` once it loaded what it holds for them (the cache and
    ``use_cache`` included): a dense suffix to feed, or an armed sparse repair forward
    (``cache.expects_sparse_forward``). Run them with :func:`run_forward`."""
    kwargs = {**kwargs, CACHE_ARGUMENT: cache, "use_cache": True}
    reusing = reuse_cache(cache)
    return prepare_forward(reusing, kwargs) if reusing is not None else kwargs


def run_forward(model: torch.nn.Module, inputs: dict[str, Any], *, logits: bool = True) -> Any:
    """Call ``model.forward`` on :func:`forward_inputs`' result (possibly with queries appended to a dense one) and
    record the fed tokens in the reuse cache. Returns the output. ``logits=False`` (a chunk of a prompt whose logits
    nobody reads) runs the base model only (``model.base_model``): the K/V are the same, and the output head, a
    vocabulary-sized matrix read once per forward (113 MB of the embedded model's 540 MB in fp32), is skipped."""
    with torch.inference_mode():
        if logits:
            output = model.forward(**inputs)
        else:
            base_inputs = {name: value for name, value in inputs.items() if name != "logits_to_keep"}
            output = getattr(model, "base_model", model).forward(**base_inputs)
    reusing = reuse_cache(inputs[CACHE_ARGUMENT])
    if reusing is not None:
        reusing.record(inputs.get("input_ids"))
    return output


def forward(model: torch.nn.Module, cache: Any, **kwargs: Any) -> Any:
    """One forward of ``model`` through ``cache``, the reuse steps called explicitly: the
    model's ``forward`` is called directly, so the adapter's hooks (if installed) do not run. Returns the output."""
    return run_forward(model, forward_inputs(cache, **kwargs))
