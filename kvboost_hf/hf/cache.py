"""Stage 6: :class:`ChunkReuseCache`, a drop-in ``transformers.Cache`` that stitches stored chunk K/V.

Use it like any cache::

    cache = ChunkReuseCache(store, model)
    model.generate(input_ids, cache=cache, max_new_tokens=64)  # past_key_values=cache before transformers 5.24

The cache is the container (per-layer K/V, the token ids of every column, one ledger per row); the work is done
in explicit calls, which :mod:`kvboost_hf.hf.hooks` only makes from ``generate()``:

* :meth:`ChunkReuseCache.prefill` (:class:`~kvboost_hf.hf.prefill.ChunkPrefiller`) plans, stitches and repairs the
  prompt's stored K/V into the cache and returns the inputs still to compute;
* :meth:`ChunkReuseCache.record` notes each finished forward;
* :meth:`ChunkReuseCache.save` writes completed chunks back (:mod:`~kvboost_hf.reuse.write_back`), the
  unfinished last chunk included. During ``generate()``, :class:`~kvboost_hf.hf.generation.ChunkWriteBack`
  calls it every step after the first token, and once more with the tail when generation ends.

Invariants:

* ``self.tokens`` holds one token id per cached column (left padding included) and, while reuse is enabled,
  every layer holds exactly ``self.num_columns`` columns of K/V; with reuse disabled for a call (a mask that is
  not left padding, ``inputs_embeds``) the cache records nothing and behaves like a ``DynamicCache``;
* layers follow the model's ``layer_types``: a sliding-window layer (:class:`ChunkReuseSlidingLayer`) also holds
  every column (so write-back, stitching, joins, crops and batch ops see whole chunks), but hands attention and
  the mask builder exactly the columns a ``DynamicSlidingWindowLayer`` would (the last ``sliding_window - 1``
  past columns plus the new ones), so outputs equal a ``DynamicCache``'s bit for bit;
* a row's ledger says how far its K/V are exact (only exact chunks are stored under prefix keys) and holds the
  row's own segment starts, so the rows of one cache may come from caches built for different segments;
* a prompt that does not extend the tokens already cached raises instead of attending to stale K/V;
* the layers may hold ``padding_rows`` rows below the real ones (:meth:`ChunkReuseCache.pad_batch`, a decode graph's
  batch bucket): copies of the last real row with no tokens, pad or ledger of their own, never written back and
  dropped before any row operation (join, selection, repeat); a column selection keeps them, as copies of the last
  real row's columns (a graphed verify's buffers then keep their shape and address).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from transformers import Cache, PreTrainedModel

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.chunking import ChunkingConfig, check_segment_starts
from kvboost_hf.core.config import GenerationMode, RepairConfig
from kvboost_hf.core.errors import ConfigError, InputError, StateError
from kvboost_hf.core.keys import KeySpace, model_digest
from kvboost_hf.hf.attention import ATTN_IMPLEMENTATION
from kvboost_hf.hf.blend import LayerFilter, scatter_into
from kvboost_hf.hf.context_attention import ADJUSTMENT_KWARG, ContextAdjustment
from kvboost_hf.hf.hooks import install_hooks
from kvboost_hf.hf.layers import (
    CacheCapacityError,
    ChunkReuseLayer,
    ChunkReuseSlidingLayer,
    cache_layers,
    grown_capacity,
)
from kvboost_hf.hf.models import check_model_support, is_loaded_model, model_dtype
from kvboost_hf.hf.prefill import ChunkPrefiller, PendingForward, RowReuse
from kvboost_hf.hf.static_buffers import StaticBufferPool, StaticStacks
from kvboost_hf.hf.transfer import to_device
from kvboost_hf.reuse.plan import ChunkLedger
from kvboost_hf.reuse.rope import KeyRotator
from kvboost_hf.reuse.write_back import write_chunks, write_tail
from kvboost_hf.store.chunk_store import ChunkStore

logger = logging.getLogger(__name__)


class ChunkReuseCache(Cache):
    """A ``transformers.Cache`` that loads chunk hits from a :class:`ChunkStore` and writes new chunks back.

    Args:
        store: where chunk K/V live; its ``kv_cache_bits``/``kv_group_size`` name the namespace too.
        model: the model this cache serves (its identity and dtype name the store namespace).
        chunking: a :class:`ChunkingConfig`, an int for fixed chunks of that many tokens, or None for its defaults.
        repair: how approximate (content-key) hits are repaired (:class:`RepairConfig`).
        mode: a :class:`GenerationMode`. ``"prefix_cache"`` takes exact prefix hits only: output as plain
            ``generate()``'s. ``"chunk_kv_reuse"`` also takes approximate hits (chunks stored by content key:
            segments, content-defined chunks, ``engine.warm``; found after the first prefix miss, at a new position,
            then repaired per ``repair``) and stores this cache's segments by content key. None (the default):
            ``"chunk_kv_reuse"`` when the cache is given ``segment_starts``, content-defined ``chunking`` or a
            ``repair`` config (each asks for non-prefix reuse), else ``"prefix_cache"``: a plain drop-in cache is
            exact even on a store where other requests stored text by content key.
        cache_salt: tenant isolation; caches with different salts never see each other's chunks.
        segment_starts: token offsets where a new segment (document, question) starts in the prompt of the rows of
            this cache's first forward: each starts a chunk, and those rows' chunks are also stored by content key
            so they hit at any position. Each row keeps its segment starts in its ledger, so rows joined from another
            cache (:meth:`join`) keep theirs and are written back under their own keys.
        write_back: store the chunks computed through this cache.
        adapter: install the hooks that let ``model.generate(cache=cache)`` and ``model(...)`` drive
            this cache (:mod:`kvboost_hf.hf.hooks`; once per model). Not needed when forwards are driven explicitly
            (:func:`kvboost_hf.hf.prefill.forward`, as the decode loop does).
        max_cache_len: static mode (tokens, padding included): every layer holds ``[B, H_kv, max_cache_len, D]``
            buffers at a fixed address and its length in a device tensor, so a decode step has the same shapes at
            every length and the cache is ``is_compileable``: ``model.generate`` then compiles its decode forward
            as it does with ``StaticCache`` (on CUDA, or wherever a ``CompileConfig`` allows), and
            ``torch.compile(model.forward, fullgraph=True)`` traces a decode step once (:mod:`kvboost_hf.hf.layers`).
            More tokens than that raise :class:`~kvboost_hf.hf.layers.CacheCapacityError`. None (the default):
            buffers grow as needed.
    """

    layers: list[ChunkReuseLayer]  # built by cache_layers()

    def __init__(
        self,
        store: ChunkStore,
        model: PreTrainedModel,
        chunking: ChunkingConfig | int | None = None,
        repair: RepairConfig | None = None,
        *,
        mode: GenerationMode | str | None = None,
        cache_salt: str | None = None,
        segment_starts: list[int] | tuple[int, ...] = (),
        write_back: bool = True,
        adapter: bool = True,
        max_cache_len: int | None = None,
    ) -> None:
        _check_arguments(store, model, repair)
        check_model_support(model.config, strict=False)
        super().__init__(layers=cache_layers(model, max_cache_len))
        self.max_cache_len = max_cache_len
        self.store = store
        self.model = model
        self.chunking = ChunkingConfig.of(chunking)
        self.segment_starts = check_segment_starts(segment_starts)
        self.mode = GenerationMode(
            mode if mode is not None else default_mode(self.chunking, repair, self.segment_starts)
        )
        self.repair = repair or RepairConfig()
        implementation = model.config._attn_implementation
        if self.repair.adjusts_attention and implementation != ATTN_IMPLEMENTATION:
            raise ConfigError(
                "RepairConfig(context_temperature=..., context_scale=...) needs the model's attention to be "
                f"attn_implementation={ATTN_IMPLEMENTATION!r} (it is {implementation!r}): load it with that "
                f"argument or call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
            )
        self.key_space = KeySpace.of_model(
            model,
            model_dtype(model),
            self.chunking,
            kv_cache_bits=store.kv_cache_bits,
            kv_group_size=store.kv_group_size,
        )
        self.namespace = self.key_space.namespace(cache_salt)
        self.write_back = write_back and self.mode is not GenerationMode.BASELINE
        self._token_buffer = torch.empty(0, 0, dtype=torch.long)  # host; its first _token_columns are the tokens
        self._token_columns = 0
        self._owns_token_buffer = False
        self.pads: list[int] = []
        self.ledgers: list[ChunkLedger] = []
        self.padding_rows = 0  # layer rows below the real ones (pad_batch)
        self.last_reuse: list[RowReuse] = []
        self.reuse_enabled = True
        self.forwards = 0  # forwards recorded since the cache was created
        self.stitched_bytes = 0  # bytes of stored K/V copied into the layers (each reused byte once)
        self.prompt_forward_next = True  # the next forward through the hooks starts a generation (set by generate())
        self.prompt_in_progress = False  # generate() has not sampled its first token yet (chunked prefill's forwards)
        self._scatter: torch.Tensor | None = None  # positions the pending sparse forward writes
        self._pending_tokens: torch.Tensor | None = None  # the row's tokens once that forward ran
        self.layer_filter: LayerFilter | None = None  # CacheBlend: the positions of _scatter each layer computes
        self._adjustment: tuple[tuple, ContextAdjustment] | None = None  # (layout, its adjustment): attention_kwargs
        self.prefiller = ChunkPrefiller(model, self.mode)
        self.static_buffers: StaticBufferPool | None = None
        """Where static mode takes its buffers (:meth:`static_stacks`); None: fresh ones per layer."""
        self.stitch_capacity: Callable[[int], int | None] | None = None
        """Set by a runner that may graph the prompt forward: given the columns the stitched K/V will fill, the
        static capacity that forward will run at (None: it runs eagerly), so stored chunks are copied straight
        into the static buffers (one copy instead of two)."""
        if adapter:
            install_hooks(model)

    # ------------------------------------------------------------------ state
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns layer ``layer_idx`` holds (a device tensor inside a compiled static-mode forward); eagerly, every
        layer's host length first catches up with its static updates (:meth:`ChunkReuseLayer.settle`)."""
        if self.max_cache_len is not None and not torch.compiler.is_compiling():
            for layer in self.layers:
                layer.settle()
        return super().get_seq_length(layer_idx)

    def set_max_cache_len(self, max_cache_len: int | None, stacks: StaticStacks | None = None) -> None:
        """Switch every layer to static mode with ``max_cache_len`` columns (None: back to growing buffers),
        keeping what the cache holds (see ``ChunkReuseLayer.set_max_cache_len``; one copy of the K/V when
        becoming static, none where the layers already hold ``stacks``' leading columns). The static buffers are
        layer ``i``'s views ``[i]`` of ``stacks`` (:meth:`static_stacks`' form), or of :attr:`static_buffers`'
        stacks for this shape, else fresh per layer. Raises :class:`~kvboost_hf.hf.layers.CacheCapacityError` when
        it holds more columns."""
        switching = max_cache_len is not None and self.max_cache_len != max_cache_len
        if stacks is None and max_cache_len is not None and switching:
            stacks = self.static_stacks(self._layer_rows(), max_cache_len)
        for index, layer in enumerate(self.layers):
            if stacks is None:
                layer.set_max_cache_len(max_cache_len)
                continue
            views = (stacks.keys[index], stacks.values[index], stacks.lengths[index])
            for view in views:
                torch._dynamo.mark_static_address(view)  # the mark is per tensor object
            layer.set_max_cache_len(max_cache_len, views[:2], device_length=views[2], clear=False)
        if stacks is not None and switching:
            self._clear_unheld_columns(stacks)
        self.max_cache_len = max_cache_len

    def _clear_unheld_columns(self, stacks: StaticStacks) -> None:
        """Zero ``stacks``' columns past those the layers hold (a reused stack's earlier contents): one op for the
        keys and one for the values when every layer holds as many columns, as a reuse cache's do; layer by layer
        otherwise."""
        lengths = {layer.get_seq_length() for layer in self.layers}
        if len(lengths) != 1:
            for layer in self.layers:
                layer.clear_unheld_columns()
            return
        (held,) = lengths
        stacks.keys[..., held:, :].zero_()
        stacks.values[..., held:, :].zero_()

    def static_stacks(self, rows: int, capacity: int) -> StaticStacks | None:
        """Stacked static buffers for every layer from :attr:`static_buffers` (the same ones from one request to
        the next, so a graphed forward replays at the addresses it was recorded with: its K/V and its device
        lengths alike), in the layers' K/V shape, dtype and device (the model's before the first forward); None
        without a pool or when the layers' K/V differ in those."""
        if self.static_buffers is None or rows < 1:
            return None
        layers, heads, dim = self.prefiller.entry_shape
        device, dtype = self.prefiller.device_and_dtype()
        kinds = {(layer.keys.shape[1], layer.keys.shape[3], layer.keys.dtype, layer.keys.device)
                 for layer in self.layers if layer.is_initialized}  # fmt: skip
        if len(kinds) > 1 or len(self.layers) != layers:
            return None
        if kinds:
            ((heads, dim, dtype, device),) = kinds
        shape = (layers, rows, heads, capacity, dim)
        return StaticStacks(
            self.static_buffers.take(shape, dtype, device, slot=0),
            self.static_buffers.take(shape, dtype, device, slot=1),
            self.static_buffers.take((layers,), torch.long, device, slot=2, kept_with=shape),
        )

    def pad_batch(self, rows: int) -> None:
        """Make every layer hold ``rows`` rows: the real rows, then copies of the last one (a decode graph's batch
        bucket; their results are the caller's to discard). The padding rows have no tokens, pad or ledger (the
        bookkeeping and write-back see the real rows only) and any row operation drops them first. One copy of the
        K/V when the row count changes, none otherwise."""
        real = self._layer_rows() - self.padding_rows
        if rows < real:
            raise InputError(f"cannot pad a batch of {real} rows to {rows}")
        if rows != real + self.padding_rows:
            self._select_layer_rows([*range(real), *[real - 1] * (rows - real)])
            self.padding_rows = rows - real

    def _drop_padding(self) -> None:
        """The layers back to the real rows (a no-op without padding rows)."""
        if self.padding_rows:
            self._select_layer_rows(list(range(self._layer_rows() - self.padding_rows)))
            self.padding_rows = 0

    def _layer_rows(self) -> int:
        """Rows the layers hold (padding included; 0 before the first forward)."""
        return next((layer.keys.shape[0] for layer in self.layers if layer.is_initialized), 0)

    def _select_layer_rows(self, rows: list[int]) -> None:
        layer = next(layer for layer in self.layers if layer.is_initialized)
        super().batch_select_indices(to_device(rows, layer.keys.device))

    def sync_device_lengths(self) -> None:
        """Every layer's device length back to its host length (see ``ChunkReuseLayer.sync_device_length``)."""
        for layer in self.layers:
            layer.sync_device_length()

    def ensure_room(self, new_tokens: int) -> None:
        """Raise :class:`~kvboost_hf.hf.layers.CacheCapacityError` before a forward of ``new_tokens`` that a
        static-mode cache cannot hold (a compiled forward writes without checking; this check is eager)."""
        held = self.get_seq_length()
        if self.max_cache_len is not None and held + new_tokens > self.max_cache_len:
            raise CacheCapacityError(
                f"the cache holds {held} tokens and cannot take {new_tokens} more: its max_cache_len is "
                f"{self.max_cache_len}; build the ChunkReuseCache with a larger max_cache_len"
            )

    @property
    def tokens(self) -> torch.Tensor:
        """Token ids ``[B, columns]`` recorded (left padding included), a view of a buffer with spare columns."""
        return self._token_buffer[:, : self._token_columns]

    @tokens.setter
    def tokens(self, tokens: torch.Tensor) -> None:
        self._token_buffer, self._token_columns = tokens, tokens.shape[1]
        self._owns_token_buffer = False  # never written in place: the next append copies it into a buffer of ours

    def _append_tokens(self, fed_ids: torch.Tensor) -> None:
        """Append ``fed_ids`` ``[B, n]`` to :attr:`tokens` in amortised O(n) host work (the buffer grows by a
        fraction of itself, as the layers' K/V buffers do). Only a buffer allocated here is written in place (an
        ordinary tensor, also when allocated in inference mode)."""
        end = self._token_columns + fed_ids.shape[1]
        buffer = self._token_buffer
        if not self._owns_token_buffer or end > buffer.shape[1] or buffer.shape[0] != fed_ids.shape[0]:
            with torch.inference_mode(False):
                grown = torch.empty(fed_ids.shape[0], grown_capacity(end, buffer.shape[1]), dtype=torch.long)
            grown[:, : self._token_columns] = self.tokens
            self._token_buffer, self._owns_token_buffer = grown, True
        self._token_buffer[:, self._token_columns : end] = fed_ids.to(self._token_buffer.device)
        self._token_columns = end

    @property
    def num_columns(self) -> int:
        """Columns (token positions, padding included) recorded; equals every layer's length while reuse is on."""
        return self._token_columns

    def attention_kwargs(self) -> dict[str, ContextAdjustment]:
        """Extra keyword arguments of a forward through this cache: the APE-style context adjustment
        (:mod:`kvboost_hf.hf.context_attention`) over each row's approximate columns, for the queries after the
        last of them, when the repair config sets one and a row loaded approximate hits; else none. Built once
        per layout (rows' padding and approximate positions), not per decode step."""
        if not self.repair.adjusts_attention or not any(ledger.approximate for ledger in self.ledgers):
            return {}
        layout = (tuple(self.pads), tuple(ledger.approximate for ledger in self.ledgers))
        if self._adjustment is None or self._adjustment[0] != layout:
            self._adjustment = layout, self._context_adjustment()
        return {ADJUSTMENT_KWARG: self._adjustment[1]}

    def _context_adjustment(self) -> ContextAdjustment:
        device = self.prefiller.device_and_dtype()[0]
        starts = [max(ledger.approximate, default=-1) + 1 for ledger in self.ledgers]  # no columns: no effect
        columns = torch.zeros(len(self.ledgers), max(map(sum, zip(self.pads, starts, strict=True))), dtype=torch.bool)
        for row, (pad, ledger) in enumerate(zip(self.pads, self.ledgers, strict=True)):
            columns[row, [pad + position for position in ledger.approximate]] = True
        return ContextAdjustment(
            columns.to(device),
            to_device(starts, device),
            self.repair.context_temperature,
            self.repair.context_scale,
        )

    @property
    def expects_sparse_forward(self) -> bool:
        """True between a deferred sparse :meth:`prefill` and the forward that computes it."""
        return self._scatter is not None

    def row_tokens(self, row: int) -> list[int]:
        """The real (unpadded) token ids of ``row`` whose K/V are cached."""
        return self.tokens[row, self.pads[row] :].tolist()

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise unless ``model`` is the model this cache was built for, or one with the same digest (config and
        weights, :func:`~kvboost_hf.core.keys.model_digest`): another model would read, and write back under this
        cache's namespace, K/V that it did not compute. A model whose dtype changed since the cache was built
        (``model.to(torch.bfloat16)``) is refused too: its K/V would be stored under the old dtype's namespace."""
        dtype = str(model_dtype(model))
        if dtype != self.key_space.dtype:
            raise InputError(
                f"this ChunkReuseCache was built for K/V in {self.key_space.dtype}, and the model running it computes "
                f"{dtype}: build a new ChunkReuseCache(store, model) after changing the model's dtype"
            )
        if model is self.model or model_digest(model) == self.key_space.digest:
            return
        raise InputError(
            f"this ChunkReuseCache was built for another model ({type(self.model).__name__}, digest "
            f"{self.key_space.digest[:12]}) than the one running it ({type(model).__name__}, digest "
            f"{model_digest(model)[:12]}): build the cache with ChunkReuseCache(store, model) for the model you call"
        )

    def check_extends(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Raise unless ``input_ids`` (a full sequence handed to ``generate``) extends the cached tokens.

        An ``attention_mask`` longer than ``input_ids`` says only the new tokens were given (transformers' rule): they
        extend the cache by construction when the mask covers exactly the cached columns plus them; otherwise the
        cached tokens and the positions disagree, and reuse is turned off (the cache then acts as a DynamicCache).
        """
        n = self.num_columns
        if n == 0:
            return
        if attention_mask is not None and attention_mask.shape[-1] > input_ids.shape[1]:
            if attention_mask.shape[-1] != n + input_ids.shape[1]:
                logger.warning(
                    "ChunkReuseCache: the attention mask covers %d columns but the cache holds %d plus %d new tokens; "
                    "reuse is off for this cache",
                    attention_mask.shape[-1],
                    n,
                    input_ids.shape[1],
                )
                self.reuse_enabled = False
            return
        if input_ids.shape[0] != self.tokens.shape[0] or input_ids.shape[1] <= n:
            raise InputError(
                f"ChunkReuseCache holds {n} tokens for a batch of {self.tokens.shape[0]}; the new input "
                f"{tuple(input_ids.shape)} does not extend them. Use a fresh ChunkReuseCache per conversation."
            )
        if not torch.equal(input_ids[:, :n].to(self.tokens.device), self.tokens):
            raise InputError(
                "ChunkReuseCache holds K/V for a different token sequence: the new prompt does not extend the "
                "cached conversation. Use a fresh ChunkReuseCache (or the same one only to continue a conversation)."
            )

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | dict | None) -> None:
        """First forward of this cache: learn the batch layout (left padding) from ``attention_mask`` (2D, or the
        prepared 4D mask of a compiled ``generate()``: :func:`prompt_padding_mask`)."""
        batch = input_ids.shape[0]
        self.tokens = torch.empty(batch, 0, dtype=torch.long, device="cpu")
        self.ledgers = [ChunkLedger(segment_starts=self.segment_starts) for _ in range(batch)]
        self.pads = [0] * batch
        given = attention_mask
        attention_mask = prompt_padding_mask(attention_mask, input_ids.shape[1])
        if attention_mask is None:
            return
        if attention_mask.dim() != 2:
            logger.warning("ChunkReuseCache: custom %dD attention mask; reuse disabled", attention_mask.dim())
            self.reuse_enabled = False
            return
        pads = left_pads(attention_mask)
        if pads is None:
            logger.warning("ChunkReuseCache: attention mask is not left padding; reuse disabled for this call")
            self.reuse_enabled = False
            pads = [int(p) for p in (attention_mask.to("cpu", torch.long).cumsum(-1) == 0).sum(-1)]
        elif not self._masks_only_padding(given, pads, 0):
            logger.warning("ChunkReuseCache: the 4D attention mask hides tokens inside a row; reuse disabled")
            self.reuse_enabled = False
        self.pads = pads

    def check_forward(
        self, fed: torch.Tensor, attention_mask: torch.Tensor | dict | None, position_ids: torch.Tensor | None
    ) -> None:
        """Turn reuse and write-back off for good (with a warning) when a forward of the ``fed`` token ids through
        the hooks computes K/V that a plain prefill would not: under autocast (another precision than the model's,
        whose namespace the chunks are keyed in), at positions other than each row's next ones, or under a mask
        that hides more than left padding (:meth:`check_layout`, :func:`hides_only_padding`)."""
        if not self.reuse_enabled:
            return
        batch, queries = fed.shape
        if self.num_columns:
            self.check_layout(attention_mask, self.num_columns + queries)
        reason = None
        if torch.is_autocast_enabled(fed.device.type):
            reason = "the forward runs under autocast"
        elif position_ids is not None and not _next_positions(
            position_ids, self._row_pads(attention_mask, batch, queries), self.num_columns
        ):
            reason = "its position_ids are not each row's next positions"
        if reason is not None and self.reuse_enabled:
            logger.warning("ChunkReuseCache: %s; reuse and write-back are off for this cache", reason)
            self.reuse_enabled = False

    def _row_pads(self, attention_mask: torch.Tensor | dict | None, batch: int, queries: int) -> list[int] | None:
        """Each of ``batch`` rows' left padding for a forward of ``queries`` tokens: the cache's once it holds
        columns, else read off ``attention_mask`` (None when it is not left padding: reuse is then off anyway)."""
        if self.num_columns:
            return self.pads
        layout = prompt_padding_mask(attention_mask, queries)
        if layout is None:
            return [0] * batch
        return left_pads(layout) if layout.dim() == 2 else None

    def check_layout(self, attention_mask: torch.Tensor | dict | None, columns: int) -> None:
        """Turn reuse off for good (with a warning) unless ``attention_mask`` of a forward continuing this cache
        (2D over all ``columns``, the prepared 4D mask of a compileable cache, or None: nothing masked) keeps each
        row's left padding and masks nothing else. K/V computed under a masked token inside a row differ from a
        full prefill's: they are then neither stored nor mixed with stored ones (the cache acts as a DynamicCache).
        """
        layout = column_layout(attention_mask, columns)
        pads = [0] * len(self.pads) if layout is None else left_pads(layout)
        if pads != self.pads or not self._masks_only_padding(attention_mask, self.pads, None, columns):
            logger.warning(
                "ChunkReuseCache: the attention mask masks tokens inside a row or changes its left padding; reuse "
                "and write-back are off for this cache"
            )
            self.reuse_enabled = False

    def _masks_only_padding(
        self, mask: torch.Tensor | dict | None, pads: list[int], offset: int | None, columns: int | None = None
    ) -> bool:
        """Whether every 4D tensor of a forward's ``mask`` (a dict's per layer type too; 2D masks and None pass) is
        causal and hides each row's left padding and nothing else, or only what this model's sliding window hides:
        :func:`hides_only_padding`. Its queries are the columns from ``offset`` (None: ``columns`` minus its
        query count)."""
        masks = mask.values() if isinstance(mask, dict) else [mask]
        windows = sorted({layer.sliding_window for layer in self.layers if isinstance(layer, ChunkReuseSlidingLayer)})
        for each in masks:
            if not isinstance(each, torch.Tensor) or each.dim() != 4:
                continue
            start = offset if offset is not None else (columns or 0) - each.shape[-2]
            if not hides_only_padding(each, pads, start, windows):
                return False
        return True

    def prefill(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        keep: int = 1,
        defer: bool = False,
        report: bool = True,
        continues: bool = False,
    ) -> PendingForward:
        """Load and repair what the store holds for the prompt ``input_ids``: :meth:`ChunkPrefiller.prefill
        <kvboost_hf.hf.prefill.ChunkPrefiller.prefill>` with this cache."""
        return self.prefiller.prefill(
            self, input_ids, attention_mask, keep=keep, defer=defer, report=report, continues=continues
        )

    def arm_scatter(
        self, positions: torch.Tensor, tokens: torch.Tensor, layer_filter: LayerFilter | None = None
    ) -> None:
        """The next forward writes its K/V at ``positions`` (sorted columns) instead of appending; once it is
        recorded the cache holds ``tokens`` (batch x columns) and every layer is cut to that many columns. With a
        ``layer_filter`` (over the same positions) each layer writes only the positions it still computes."""
        self._scatter, self._pending_tokens, self.layer_filter = positions, tokens, layer_filter

    # ------------------------------------------------------------------ forwards
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (ordinary forwards), or scatter into the armed positions (the sparse forward of a prefill)."""
        if self._scatter is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        positions = self._scatter
        if self.layer_filter is not None:
            positions = self.layer_filter.positions
            self.layer_filter.observe(layer_idx, layer, key_states, value_states)
        scatter_into(layer, positions, key_states, value_states)
        return layer.keys, layer.values

    def record(self, fed_ids: torch.Tensor | None) -> None:
        """Note a finished forward that fed ``fed_ids`` (None for ``inputs_embeds``) through this cache."""
        if self._pending_tokens is not None:  # the sparse forward filled its positions
            self._adopt_pending()
            return
        if fed_ids is None:
            self.reuse_enabled = False  # token ids unknown from here on: nothing to look up or store
        if not self.reuse_enabled or fed_ids is None:
            return
        self.forwards += 1
        self.prompt_forward_next = False
        columns_before = self.num_columns
        self._append_tokens(fed_ids)
        adjusted = self.repair.adjusts_attention  # new queries after approximate columns attend adjusted
        for ledger, pad in zip(self.ledgers, self.pads, strict=True):
            if adjusted and ledger.approximate:
                continue
            if ledger.exact_tokens >= max(columns_before - pad, 0):  # every earlier real token was exact
                ledger.exact_tokens = max(self.num_columns - pad, 0)
        self._check_consistent()

    def _adopt_pending(self) -> None:
        """The sparse forward (or its absence) is done: the cache holds the pending tokens' columns."""
        assert self._pending_tokens is not None
        self.forwards += 1
        self.prompt_forward_next = False
        self.tokens, self._pending_tokens, self._scatter = self._pending_tokens, None, None
        if self.layer_filter is not None:
            self.layer_filter.finish()
            self.layer_filter = None
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, : self.num_columns], layer.values[:, :, : self.num_columns]
        self._check_consistent()

    def check_intact(self) -> None:
        """Before a forward through the hooks: raise :class:`StateError` when a layer holds another number of columns
        than the tokens recorded, as an exception part-way through an earlier forward (out of memory, an
        interrupt) leaves it: the layers that ran kept their new columns. Such a cache cannot be continued."""
        if not self.reuse_enabled or self._pending_tokens is not None:
            return  # reuse off: the cache records nothing and acts as a DynamicCache
        lengths = {layer.get_seq_length() for layer in self.layers}
        if lengths != {self.num_columns}:
            self.reuse_enabled = False
            raise StateError(
                f"ChunkReuseCache layers hold {sorted(lengths)} columns where {self.num_columns} tokens were recorded: "
                "an earlier forward through this cache failed part-way. Use a fresh ChunkReuseCache."
            )

    def _check_consistent(self) -> None:
        if self.get_seq_length() != self.num_columns:
            self.reuse_enabled = False
            raise StateError(
                f"ChunkReuseCache is inconsistent: layers hold {self.get_seq_length()} positions but "
                f"{self.num_columns} tokens were fed; was the cache shared between two forwards?"
            )

    # ------------------------------------------------------------------ write-back
    def save(self, tail: bool = True) -> None:
        """Write back every chunk computed so far that is not stored yet (a no-op when all are stored).

        With ``tail``, also store each row's last, unfinished chunk (exact K/V only) under its prefix key and note
        its length in the store, so the next turn of a conversation recomputes only its new tokens. Call it with
        the tail once a generation is over (``generate()`` does, through the hooks), not per step.
        """
        if not (self.write_back and self.reuse_enabled and self.num_columns):
            return
        for row, ledger in enumerate(self.ledgers):
            if not tail and self._no_chunk_completed(row, ledger):
                continue  # a decode step's save: O(1) per row until a chunk can have completed
            tokens = self.row_tokens(row)
            ledger.extend(tokens, self.namespace, self.chunking)
            row_slice = self._row_slicer(row)
            write_chunks(self.store, ledger, tokens, row_slice, self.namespace, self._content_rotator(ledger))
            if tail:
                write_tail(self.store, ledger, tokens, row_slice, self.namespace)

    def _no_chunk_completed(self, row: int, ledger: ChunkLedger) -> bool:
        """Whether ``row`` holds no chunk that a save would store: every chunk of its ledger stored, fewer tokens
        past its last chunk than the shortest chunk, and no segment start after it (which would cut one)."""
        past_last_chunk = self.num_columns - self.pads[row] - ledger.end
        cut_ahead = bool(ledger.segment_starts) and ledger.segment_starts[-1] > ledger.end
        return ledger.stored == len(ledger.spans) and past_last_chunk < self.chunking.shortest_chunk and not cut_ahead

    def _content_rotator(self, ledger: ChunkLedger) -> KeyRotator | None:
        """The rotator that also stores a row's chunks by content key (rotated to position 0): for a row with segment
        starts, or with content-defined chunking; None otherwise, or when non-prefix reuse is off (no rotator)."""
        return self.prefiller.rotator if ledger.by_content(self.chunking) else None

    def _row_slicer(self, row: int):
        pad = self.pads[row]

        def row_slice(start: int, end: int) -> ChunkKV:
            return ChunkKV(
                torch.stack([layer.keys[row, :, pad + start : pad + end] for layer in self.layers]),
                torch.stack([layer.values[row, :, pad + start : pad + end] for layer in self.layers]),
            )

        return row_slice

    # ------------------------------------------------------------------ generation strategies
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (assisted decoding), like ``DynamicCache.crop``: a positive
        value is refused and 0 is a no-op. The layers' length is the truth, recorded or not."""
        if tokens_to_remove > 0:
            raise InputError(f"crop() takes a negative number of tokens to remove, got {tokens_to_remove}")
        super().crop(tokens_to_remove)
        length = self.get_seq_length()
        if self.num_columns > length:
            self.tokens = self.tokens[:, :length]
            for ledger, pad in zip(self.ledgers, self.pads, strict=True):
                ledger.truncate(max(length - pad, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._drop_padding()
        super().reorder_cache(beam_idx)
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._drop_padding()
        super().batch_repeat_interleave(repeats)
        self._select_rows([row for row in range(self.tokens.shape[0]) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the real rows ``indices`` (the padding rows go: a graphed step pads again)."""
        super().batch_select_indices(indices)
        self.padding_rows = 0
        self._select_rows(torch.as_tensor(indices).tolist())

    def join(self, other: ChunkReuseCache) -> None:
        """Append ``other``'s rows below this cache's rows (continuous batching); ``other`` is then spent.

        The narrower cache is left-padded with zero K/V columns, which the caller's attention mask must mask
        (:func:`join_layers`); each row's ledger (its segment starts included) and its real tokens are unchanged, so
        write-back goes on per row, under the keys the row's own cache would use.
        Both caches must be dense (no sparse forward pending) and share one namespace.
        """
        if other.namespace != self.namespace:
            raise InputError("cannot join caches of different namespaces (model, dtype, chunking or cache_salt)")
        if self.expects_sparse_forward or other.expects_sparse_forward:
            raise StateError("cannot join a cache while a sparse prefill forward is pending")
        self._drop_padding()
        other._drop_padding()
        width = max(self.num_columns, other.num_columns)
        if self.reuse_enabled and other.reuse_enabled:
            left, right = width - self.num_columns, width - other.num_columns
            self.tokens = torch.cat([prepend_zeros(self.tokens, left), prepend_zeros(other.tokens, right)], dim=0)
            self.pads = [pad + left for pad in self.pads] + [pad + right for pad in other.pads]
            self.ledgers = self.ledgers + other.ledgers
            self.last_reuse = self.last_reuse + other.last_reuse
        else:
            self.reuse_enabled = False
        join_layers(self, other)
        self.prompt_forward_next = False

    def keep_row_columns(self, columns: Sequence[Sequence[int]], width: int | None = None) -> None:
        """Keep, for each row ``i``, only its columns ``columns[i]`` (ascending: its left padding and real tokens,
        e.g. without a speculative verify's rejected tokens), rows right-aligned in ``width`` columns (default: the
        longest list). Freed columns become left padding (zero K/V; the caller's attention mask must exclude them);
        each row's ledger forgets chunks past its remaining tokens. Padding rows (:meth:`pad_batch`) stay, each
        keeping the last real row's columns."""
        if self.expects_sparse_forward:
            raise StateError("cannot select columns while a sparse prefill forward is pending")
        width = max(len(kept) for kept in columns) if width is None else width
        keep_layer_columns(self, [*columns, *[columns[-1]] * self.padding_rows], width)
        if not self.reuse_enabled or self.num_columns == 0:
            return
        self.tokens = select_columns(self.tokens, columns, dim=1, width=width)
        self.pads = [
            width - len(kept) + sum(1 for column in kept if column < pad)
            for pad, kept in zip(self.pads, columns, strict=True)
        ]
        for ledger, pad in zip(self.ledgers, self.pads, strict=True):
            ledger.truncate(self.num_columns - pad)
        self._check_consistent()

    def _select_rows(self, rows: list[int]) -> None:
        """Keep the per-row bookkeeping (tokens, pads, ledgers) of ``rows``: none is kept up once reuse is off (a
        join with a cache whose reuse was off left this one's rows behind its layers')."""
        if not self.reuse_enabled or self.tokens.shape[0] == 0:
            return
        self.tokens = self.tokens[rows]
        self.pads = [self.pads[r] for r in rows]
        self.ledgers = [self.ledgers[r].copy() for r in rows]


def prompt_padding_mask(mask: torch.Tensor | dict | None, prompt_length: int) -> torch.Tensor | None:
    """The 2D padding mask (batch x columns, 1 = attended) of a first forward's ``mask``, when that is the prepared
    4D mask ``generate()`` builds for a compileable cache (``[B, 1, prompt_length, kv]``, bool or additive float,
    or a dict of them per layer type, None where transformers leaves the mask to SDPA's causal flag): column ``j``
    is padding exactly when query ``j`` may not attend to itself. Any other mask is returned as is."""
    if isinstance(mask, dict):
        prepared = [each for each in mask.values() if isinstance(each, torch.Tensor)]
        if not prepared:
            return None  # plain causal everywhere: no padding
        mask = prepared[0]
    if mask is None or mask.dim() != 4 or mask.shape[-2] != prompt_length or mask.shape[-1] < prompt_length:
        return mask
    diagonal = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, prompt_length]: query j on column j
    attended = diagonal if diagonal.dtype == torch.bool else diagonal == 0
    return attended.long()


def _check_arguments(store: object, model: object, repair: object) -> None:
    """Refuse, naming it, a ``ChunkReuseCache`` argument of the wrong kind (they raised AttributeError inside)."""
    if not is_loaded_model(model):
        raise ConfigError(f"ChunkReuseCache(store, model, ...): model must be a transformers model, got {model!r}")
    if not isinstance(store, ChunkStore):
        raise ConfigError(f"ChunkReuseCache(store, model, ...): store must be a ChunkStore, got {store!r}")
    if repair is not None and not isinstance(repair, RepairConfig):
        raise ConfigError(f"repair must be a RepairConfig (e.g. RepairConfig({repair!r})), got {repair!r}")


def default_mode(
    chunking: ChunkingConfig, repair: RepairConfig | None, segment_starts: Sequence[int]
) -> GenerationMode:
    """The mode of a cache given none: non-prefix reuse when its settings ask for it (segment starts,
    content-defined chunks or a repair config), else exact prefix reuse."""
    asks = bool(segment_starts) or chunking.method == "content" or repair is not None
    return GenerationMode.CHUNK_KV_REUSE if asks else GenerationMode.PREFIX_CACHE


def column_layout(mask: torch.Tensor | dict | None, columns: int) -> torch.Tensor | None:
    """Which of the first ``columns`` columns each row attends (batch x columns, 1 = attended) per a forward's
    ``mask``: a 2D mask as given (its length checked by the caller's comparison); of a prepared 4D mask (or a dict
    of them per layer type: the full-attention one) the last query's row; None where nothing is masked."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next((m for m in mask.values() if isinstance(m, torch.Tensor)), None))
    if mask is None or mask.dim() != 4:
        return mask
    last = mask[:, 0, -1, :columns]
    return (last if last.dtype == torch.bool else last == 0).long()


def _next_positions(position_ids: torch.Tensor, pads: list[int] | None, offset: int) -> bool:
    """Whether ``position_ids`` (``[B or 1, Q]``) of queries at columns ``offset ..`` give each real token (at or
    after its row's left padding) its position in the row: its column minus the padding. Other layouts (M-RoPE's
    3D ids) and unknown padding count as not."""
    if pads is None or position_ids.dim() != 2 or position_ids.shape[0] not in (1, len(pads)):
        return pads is None  # no left padding known: reuse is already off
    queries = position_ids.shape[1]
    columns = torch.arange(offset, offset + queries, device=position_ids.device)
    expected = columns[None, :] - torch.tensor(pads, device=position_ids.device)[:, None]  # [B, Q]
    real = expected >= 0
    return bool(((position_ids == expected) | ~real).all())


MASK_CHECK_QUERIES = 1024  # queries compared per step by hides_only_padding (bounds its temporary memory)


def hides_only_padding(mask: torch.Tensor, pads: list[int], offset: int, windows: Sequence[int] = ()) -> bool:
    """Whether a 4D ``mask`` (``[B, heads or 1, Q, K]``, bool or additive float) over queries at columns
    ``offset .. offset + Q - 1`` lets each real query (at or after its row's ``pads``) attend exactly the columns
    from its row's first real one up to itself, or only the last ``w`` of them for one ``w`` of ``windows`` (a
    sliding-window layer's mask). Padding queries are not compared (masks differ in what they give them). K/V
    computed under any other mask (packed sequences, a custom mask) differ from a full prefill's."""
    batch, _, queries, width = mask.shape
    if batch != len(pads):
        return False
    attended = mask if mask.dtype == torch.bool else mask == 0
    columns = torch.arange(width, device=mask.device)
    first = torch.tensor(pads, device=mask.device)[:, None, None]  # [B, 1, 1]
    for start in range(0, queries, MASK_CHECK_QUERIES):
        query = torch.arange(start, min(start + MASK_CHECK_QUERIES, queries), device=mask.device) + offset
        lag = query[:, None] - columns[None, :]  # [q, K]: how far each column is behind each query
        causal = (lag >= 0)[None] & (columns >= first)  # [B, q, K]
        real = (query[None, :] >= first[:, :, 0])[:, None, :, None]  # [B, 1, q, 1]
        block = attended[:, :, start : start + MASK_CHECK_QUERIES]
        shapes = [causal] + [causal & (lag < window)[None] for window in windows]
        if not any(bool(((block == shape[:, None]) | ~real).all()) for shape in shapes):
            return False
    return True


def left_pads(layout: torch.Tensor) -> list[int] | None:
    """Each row's leading masked columns in a 2D ``layout`` (1 = attended), or None when a row masks a column after
    its first attended one (not left padding)."""
    mask = layout.to("cpu", torch.long)
    if mask.dim() != 2:
        return None
    pads = (mask.cumsum(-1) == 0).sum(-1).tolist()
    return pads if all(bool(mask[row, pad:].all()) for row, pad in enumerate(pads)) else None


def prepend_zeros(tensor: torch.Tensor, columns: int, dim: int = 1) -> torch.Tensor:
    """``tensor`` with ``columns`` zero columns prepended along ``dim``."""
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def join_layers(cache: Cache, other: Cache) -> None:
    """Append ``other``'s rows to ``cache``'s, layer by layer; the shorter side gets zero K/V columns on the left.

    Invariant: every layer holds all its ``[batch, heads, columns, dim]`` columns (a ``DynamicLayer``, or a
    :class:`ChunkReuseSlidingLayer`, which keeps them all); afterwards every layer of ``cache`` holds ``max`` of the
    two lengths, and the padded columns carry no information: the attention mask must exclude them (they are the new
    left padding of the narrower rows). Left padding keeps each row's real tokens in adjacent columns, so a sliding
    window (counted in columns) still covers the same tokens. A ``DynamicSlidingWindowLayer`` (which drops columns)
    is refused: its rows' columns could not be aligned.
    """
    width = max(cache.get_seq_length(), other.get_seq_length())
    for mine, theirs in zip(cache.layers, other.layers, strict=True):
        for layer in (mine, theirs):
            if getattr(layer, "is_sliding", False) and not isinstance(layer, ChunkReuseSlidingLayer):
                raise InputError(
                    f"cannot join a {type(layer).__name__}: it keeps only its window of columns; use a "
                    "ChunkReuseCache, or a DynamicCache built without the model config (full-length layers)"
                )
        growing = isinstance(mine, ChunkReuseLayer) and mine.max_cache_len is None
        capacity = grown_capacity(width + 1) if growing else width
        keys = stacked_right_aligned([mine.keys, theirs.keys], width, capacity)
        values = stacked_right_aligned([mine.values, theirs.values], width, capacity)
        if growing:
            mine.take_buffers(keys, values, width)  # the next decode step writes in place
        else:
            mine.keys, mine.values = keys, values


def stacked_right_aligned(tensors: Sequence[torch.Tensor], width: int, capacity: int) -> torch.Tensor:
    """``tensors`` (``[rows, heads, columns, dim]``, at most ``width`` columns each) stacked along the rows into one
    new ``[sum rows, heads, capacity, dim]`` tensor, each right-aligned in the first ``width`` columns with zeros
    to its left; columns past ``width`` are left unwritten (room to grow). One write per cell of the first
    ``width`` columns (a join's only copy of the K/V)."""
    first = tensors[0]
    stacked = first.new_empty(sum(t.shape[0] for t in tensors), first.shape[1], capacity, first.shape[-1])
    row = 0
    for tensor in tensors:
        rows, columns = tensor.shape[0], tensor.shape[-2]
        stacked[row : row + rows, :, : width - columns].zero_()
        stacked[row : row + rows, :, width - columns : width].copy_(tensor)
        row += rows
    return stacked


def select_columns(
    tensor: torch.Tensor, columns: Sequence[Sequence[int]], dim: int, width: int | None = None
) -> torch.Tensor:
    """Row ``i`` of ``tensor`` (batch first) reduced to its entries ``columns[i]`` along ``dim``, right-aligned in
    ``width`` (default: the longest list) entries: row ``i`` starts with ``width - len(columns[i])`` zeros."""
    rows = tensor.shape[0]
    if len(columns) != rows:
        raise InputError(f"columns must give one list per row of {rows}, got {len(columns)}")
    width = max((len(kept) for kept in columns), default=0) if width is None else width
    size = tensor.shape[dim]
    for kept in columns:
        if len(kept) > width or any(not 0 <= column < size for column in kept):
            raise InputError(f"cannot keep columns {list(kept)} of {size} in a width of {width}")
    index = torch.zeros(rows, width, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    for row, kept in enumerate(columns):
        index[row, width - len(kept) :] = torch.tensor(list(kept), dtype=torch.long)
        valid[row, width - len(kept) :] = True
    view = [rows] + [1] * (tensor.dim() - 1)
    view[dim] = width
    index, valid = index.to(tensor.device).reshape(view), valid.to(tensor.device).reshape(view)
    kept_values = tensor.gather(dim, index.expand(*tensor.shape[:dim], width, *tensor.shape[dim + 1 :]))
    return kept_values.masked_fill(~valid, 0)


def keep_layer_columns(cache: Cache, columns: Sequence[Sequence[int]], width: int) -> None:
    """:func:`select_columns` on every layer's keys and values (``[batch, heads, columns, dim]``) of ``cache``.

    Invariant: every layer holds all its columns (a ``DynamicLayer``, or a :class:`ChunkReuseSlidingLayer`, whose
    window follows the column count); afterwards all hold ``width`` columns. A layer that keeps only its window
    (``DynamicSlidingWindowLayer``) is refused: its rows' columns cannot be realigned.
    """
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) and not isinstance(layer, ChunkReuseSlidingLayer):
            raise InputError(f"cannot select per-row columns of a {type(layer).__name__}: it keeps only its window")
        if layer.is_initialized and layer.keys.numel():
            layer.keys = select_columns(layer.keys, columns, 2, width)
            layer.values = select_columns(layer.values, columns, 2, width)


def join_caches(cache: Cache, other: Cache) -> None:
    """Append ``other``'s rows below ``cache``'s (see :meth:`ChunkReuseCache.join` and :func:`join_layers`)."""
    if isinstance(cache, ChunkReuseCache) and isinstance(other, ChunkReuseCache):
        cache.join(other)
    else:
        join_layers(cache, other)


def keep_cache_columns(cache: Cache, columns: Sequence[Sequence[int]], width: int | None = None) -> None:
    """Keep, for each row, only its ``columns`` (rows right-aligned; see :meth:`ChunkReuseCache.keep_row_columns`
    and :func:`keep_layer_columns`)."""
    if isinstance(cache, ChunkReuseCache):
        cache.keep_row_columns(columns, width)
    else:
        keep_layer_columns(cache, columns, max(len(kept) for kept in columns) if width is None else width)
