"""The engine's factories, in one place: what every call of :class:`~kvboost_hf.engine.InferenceEngine` (and the
server's worker) is assembled from.

:class:`Factories` builds, for one model, store and set of settings: the chunk-reuse caches (:meth:`new_cache`), the
batch policy and key space the scheduler reads (:meth:`batch_policy`, :attr:`key_space`), the decode loops (the
scheduler's model runners, :meth:`decode_loop`) with their drafters, the schedulers themselves (:meth:`scheduler`)
and decode rows (:meth:`new_rows`). It owns the draft (a resident model, another engine, or the target's first
layers) and :class:`DecodeTotals`, the decode counters summed over every loop its schedulers ran.

Invariants: every loop of one factory shares one :class:`~kvboost_hf.hf.graphs.GraphedDecoder` and one
:class:`~kvboost_hf.hf.speculative.VerifyCosts`; a draft's cache never adjusts attention (it only proposes); with
``mode="baseline"`` no cache reads or writes the store.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvboost_hf.core.chunking import ChunkingConfig, check_segment_starts
from kvboost_hf.core.config import DEFAULT_PACK_FORWARDS, GenerationMode, RepairConfig
from kvboost_hf.core.errors import ConfigError
from kvboost_hf.core.keys import KeySpace, model_digest
from kvboost_hf.core.values import check_bounds
from kvboost_hf.engine_core import EngineCore
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, DecodeRow
from kvboost_hf.hf.forward_routes import forwards_pack
from kvboost_hf.hf.graphs import GraphedDecoder, graphed_columns, graphed_drafts, graphed_rows
from kvboost_hf.hf.layers import has_sliding_layers
from kvboost_hf.hf.models import (
    cache_restart_length,
    check_model_support,
    forward_read_bytes,
    kv_entry_shape,
    load_model_and_tokenizer,
    model_dtype,
)
from kvboost_hf.hf.prompts import PromptEncoder
from kvboost_hf.hf.rows import new_rows
from kvboost_hf.hf.speculative import DraftConfig, Drafter, DraftSource, VerifyCosts, resolve_draft
from kvboost_hf.hf.verify_graphs import GraphedVerifier
from kvboost_hf.kv_budget import KVBudget, resolve_budget_bytes
from kvboost_hf.runner import ModelRunner
from kvboost_hf.scheduling import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_TOKEN_BUDGET,
    PACKED_JOIN_PADDING_CELLS,
    BatchKey,
    BatchPolicy,
    MemoryCounters,
    Scheduler,
)
from kvboost_hf.store.chunk_store import ChunkStore

# Decode counters summed over an engine's calls (:meth:`DecodeTotals.stats`): tokens of all rows; target forwards (a
# batch's rows share them) and those that verified draft tokens; draft tokens (tree nodes) the target verified and
# those it kept; bytes the target's layer streamer copied during decode calls (0 when not streamed).
DECODE_TOTALS = (
    "generated_tokens",
    "target_forwards",
    "verify_forwards",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "streamed_bytes",
    "steps_ahead",
    "steps_ahead_dropped",
)


class DecodeTotals:
    """Decode counters summed over the loops counted (:data:`DECODE_TOTALS`). ``target_forwards`` sums each loop's
    forwards: a packed forward that carried several batches' work (:meth:`~kvboost_hf.runner.ModelRunner.run_steps`)
    counts once per batch. ``steps_ahead``: decode steps launched before the host read their tokens
    (:class:`~kvboost_hf.hf.graphs.GraphConfig`'s ``look_ahead``), ``steps_ahead_dropped`` those of them cut off
    unused (rows left or joined first; each also counts in ``target_forwards``)."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(DECODE_TOTALS, 0)

    def count(self, loop: DecodeLoop) -> dict[str, Any]:
        """Decode figures of a finished loop (its rows share its target forwards) as
        :class:`~kvboost_hf.results.GenerationResult` fields; also added to the totals. Call once per loop."""
        rows = loop.rows
        proposed = sum(row.draft_proposed for row in rows)
        accepted = sum(row.draft_accepted for row in rows)
        rejected = sum(row.draft_rejected for row in rows)
        longest = max((len(row.tokens) for row in rows), default=0)
        totals = self.totals
        totals["generated_tokens"] += sum(len(row.tokens) for row in rows)
        totals["target_forwards"] += loop.forwards
        totals["verify_forwards"] += loop.verify_forwards
        totals["draft_tokens_proposed"] += proposed
        totals["draft_tokens_accepted"] += accepted
        totals["streamed_bytes"] += loop.streamed_bytes or 0
        totals["steps_ahead"] += loop.steps_ahead
        totals["steps_ahead_dropped"] += loop.steps_ahead_dropped
        drafted = loop.draft is not None and proposed > 0
        verified = drafted and loop.verify_forwards > 0  # a resumed row's drafts may all predate this loop
        draft_reuse = loop.draft.cached_tokens if loop.draft is not None else []
        return {
            "target_forwards": loop.forwards,
            "tokens_per_target_forward": longest / loop.forwards if loop.forwards else 0.0,
            "verify_forwards": loop.verify_forwards,
            "draft_tokens_proposed": proposed,
            "draft_tokens_accepted": accepted,
            "draft_tokens_accepted_per_verify": accepted / loop.verify_forwards if verified else None,
            "draft_acceptance_rate": accepted / proposed if drafted else None,
            "draft_position_acceptance": accepted / max(accepted + rejected, 1) if drafted else None,
            "draft_cached_tokens": draft_reuse[0] if draft_reuse else None,
            "draft_forwards": loop.draft.forwards if loop.draft is not None else 0,
            "streamed_bytes": loop.streamed_bytes,
        }

    def stats(self) -> dict[str, int | float]:
        """The totals, with ``tokens_per_target_forward``, ``draft_tokens_accepted_per_verify`` and
        ``draft_acceptance_rate`` (0.0 before any draft proposal)."""
        totals = self.totals
        return {
            **totals,
            "tokens_per_target_forward": totals["generated_tokens"] / max(totals["target_forwards"], 1),
            "draft_tokens_accepted_per_verify": totals["draft_tokens_accepted"] / max(totals["verify_forwards"], 1),
            "draft_acceptance_rate": totals["draft_tokens_accepted"] / max(totals["draft_tokens_proposed"], 1),
        }


class Factories:
    """Caches, policies, decode loops, drafters and schedulers of one engine.

    Args:
        model, tokenizer: the target and its tokenizer.
        prompts: the engine's prompt encoder (padding and end tokens of the rows and loops).
        store, chunking, repair: the caches' store and settings (``repair``: the default of every cache).
        graphs: the decode graphs every loop shares.
        draft_model, draft, strict: the draft (see :class:`~kvboost_hf.engine.InferenceEngine`); a draft model
            given by path is loaded on the target's device and dtype and checked with ``strict``.

    ``speculative`` says whether loops decode with a drafter; ``verify_costs`` holds the target's timed verify
    forwards (adaptive tree budget), shared by every drafter; ``verify_graphs`` the verify graphs every speculative
    loop shares (on ``graphs``' compiled forward); ``totals`` the decode counters.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        prompts: PromptEncoder,
        store: ChunkStore,
        chunking: ChunkingConfig,
        repair: RepairConfig,
        graphs: GraphedDecoder,
        *,
        draft_model: DraftSource | None = None,
        draft: DraftConfig | None = None,
        strict: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.store = store
        self.chunking = chunking
        self.repair = repair
        self.graphs = graphs
        self.draft_model: PreTrainedModel | None = None
        draft_factories = getattr(draft_model, "factories", None)  # another engine: its store and chunk settings
        self._draft_factories = draft_factories if isinstance(draft_factories, Factories) else None
        if draft_model is not None:

            def load(path: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
                return load_model_and_tokenizer(path, device=model.device, dtype=model_dtype(model), strict=strict)

            self.draft_model = resolve_draft(draft_model, model, tokenizer, load)
            check_model_support(self.draft_model.config, strict=strict)
            model_digest(self.draft_model)
        self.draft_settings = draft if draft is not None else DraftConfig()
        self.verify_costs = VerifyCosts()
        self.verify_graphs = GraphedVerifier(graphs)
        self.totals = DecodeTotals()
        self.memory = MemoryCounters()

    @property
    def draft_settings(self) -> DraftConfig:
        """How the draft proposes; set, they are checked against the target and the draft as at construction."""
        return self._draft_settings

    @draft_settings.setter
    def draft_settings(self, settings: DraftConfig) -> None:
        """Check ``settings`` (ConfigError naming the problem) and take them; ``speculative`` follows them."""
        if not isinstance(settings, DraftConfig):
            raise ConfigError(f"draft settings must be a DraftConfig, got {type(settings).__name__}")
        settings.check(self.model, self.draft_model)
        speculative = self.draft_model is not None or settings.early_exit_layers is not None
        sliding = [m for m in (self.model, self.draft_model) if m is not None and has_sliding_layers(m)]
        if speculative and sliding:
            raise ConfigError(
                f"speculative decoding does not support sliding-window attention ({type(sliding[0]).__name__}): its "
                "tree masks cover every cached column, where a sliding layer sees only its window"
            )
        self._draft_settings, self.speculative = settings, speculative

    def new_cache(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        segment_starts: Sequence[int] = (),
        repair: RepairConfig | None = None,
        model: PreTrainedModel | None = None,
        *,
        adapter: bool = True,
    ) -> ChunkReuseCache:
        """A fresh drop-in cache bound to this store and these settings (for ``model``, default the target).
        ``adapter=False`` for forwards driven explicitly (the engine's own): no hooks are installed on the model."""
        return ChunkReuseCache(
            self.store,
            model if model is not None else self.model,
            self.chunking,
            repair or self.repair,
            mode=mode,
            cache_salt=cache_salt,
            segment_starts=check_segment_starts(segment_starts),
            adapter=adapter,
        )

    @property
    def key_space(self) -> KeySpace:
        """What names the target's chunks besides their tokens (its caches' :attr:`ChunkReuseCache.key_space`)."""
        return KeySpace.of_model(
            self.model,
            model_dtype(self.model),
            self.chunking,
            kv_cache_bits=self.store.kv_cache_bits,
            kv_group_size=self.store.kv_group_size,
        )

    def batch_policy(self, mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE) -> BatchPolicy:
        """Which requests may share a decode loop in ``mode`` (see :mod:`kvboost_hf.scheduling`)."""
        return BatchPolicy(self.store, self.key_space, mode)

    def new_rows(self, requests: Sequence[DecodeRequest]) -> list[DecodeRow]:
        """One decode row per request, ending at the model's end tokens; an unseeded request gets a seed from
        torch's global generator (so that ``torch.manual_seed`` before the call makes it repeatable)."""
        return new_rows(requests, self.prompts.eos_token_ids)

    def decode_loop(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        cache_salt: str | None = None,
        repair: RepairConfig | None = None,
    ) -> DecodeLoop:
        """An empty decode loop (the scheduler's model runner) on the target with fresh caches of these settings
        (no store with ``mode="baseline"``), speculative with the draft when there is one. Its caller runs it under
        the engine's lock."""
        mode = GenerationMode(mode)
        new_cache: Callable[[tuple[int, ...]], ChunkReuseCache] | None = None
        if mode is not GenerationMode.BASELINE:
            new_cache = functools.partial(self.new_cache, mode, cache_salt, repair=repair, adapter=False)
        return DecodeLoop(
            self.model,
            new_cache=new_cache,
            pad_token_id=self.prompts.pad_token_id,
            draft=self._drafter(mode, cache_salt, repair),
            graphs=self.graphs,
            verify_graphs=self.verify_graphs,
            look_ahead=self.graphs is not None and self.graphs.config.looks_ahead(self.model.device),
        )

    def _drafter(self, mode: GenerationMode, cache_salt: str | None, repair: RepairConfig | None) -> Drafter | None:
        """The drafter for one loop, or None without a draft. A draft model gets a chunk-reuse cache of its own (in
        its own engine's store when it is an engine) unless reuse is off; an early-exit draft (the target's first
        layers) a plain cache."""
        if not self.speculative:
            return None
        if self.draft_model is None:
            return Drafter(self.model, self.draft_settings, costs=self.verify_costs)
        draft_cache = None
        if mode is not GenerationMode.BASELINE:
            owner = self._draft_factories or self
            model = None if self._draft_factories is not None else self.draft_model
            if repair is not None or owner is self:  # the draft only proposes: no APE attention adjustment there
                repair = replace(repair or self.repair, context_temperature=1.0, context_scale=1.0)
            draft_cache = functools.partial(
                owner.new_cache, mode, cache_salt, repair=repair, model=model, adapter=False
            )
        return Drafter(self.draft_model, self.draft_settings, draft_cache, self.verify_costs)

    def core(
        self,
        mode: GenerationMode | str = GenerationMode.CHUNK_KV_REUSE,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        kv_budget_bytes: int | None = None,
        batch_window_ms: float = 0.0,
        repair: RepairConfig | None = None,
        tokenizer_lock: contextlib.AbstractContextManager | None = None,
        pack_forwards: bool = DEFAULT_PACK_FORWARDS,
    ) -> EngineCore:
        """An :class:`~kvboost_hf.engine_core.EngineCore`: a :class:`~kvboost_hf.scheduling.Scheduler` and a
        :class:`~kvboost_hf.runner.ModelRunner` of decode loops (:meth:`decode_loop`) in ``mode``, at most
        ``max_batch_size`` rows running and ``token_budget`` tokens computed per step (0: none), the running
        batches' K/V within :meth:`kv_budget` of ``kv_budget_bytes``, a new batch formed once its oldest request
        waited ``batch_window_ms``; each batch's decode figures are added to :attr:`totals`, the memory counters to
        :attr:`memory`. The rows' text is decoded (special tokens skipped) under ``tokenizer_lock``. ``pack_forwards``:
        the batches' decode steps and prompt chunks share one forward where they can (False: a forward each). Step
        it under the engine's lock."""
        mode = GenerationMode(mode)
        check_bounds("core", [("batch_window_ms", batch_window_ms, 0.0, False)])

        def new_loop(key: BatchKey) -> DecodeLoop:
            return self.decode_loop(mode, key.cache_salt, repair)

        scheduler = Scheduler(
            self.batch_policy(mode),
            decode=functools.partial(self.tokenizer.decode, skip_special_tokens=True),
            max_rows=max_batch_size,
            token_budget=token_budget,
            kv_budget=self.kv_budget(kv_budget_bytes),
            memory=self.memory,
            join_padding_limit=self.join_padding_limit(pack_forwards),
            batch_window_s=batch_window_ms / 1e3,
            tokenizer_lock=tokenizer_lock,
            restart_after=cache_restart_length(self.model),
        )
        return EngineCore(scheduler, ModelRunner(new_loop, on_close=self.totals.count, pack_forwards=pack_forwards))

    def join_padding_limit(self, pack_forwards: bool) -> int:
        """Cells (row x column) of left padding a group may add to a running batch by joining it, rather than start
        a batch of its own (the scheduler's ``join_padding_limit``): where the batches' steps share one packed
        forward (``pack_forwards``, and this engine's runners can pack theirs:
        :func:`~kvboost_hf.hf.forward_routes.forwards_pack`) a batch of its own costs no read of the weights:
        :data:`~kvboost_hf.scheduling.PACKED_JOIN_PADDING_CELLS`; else it costs one more forward per step, and the
        break-even is the model's forward read bytes over its K/V bytes per token."""
        if pack_forwards and forwards_pack(self.model, self.graphs, speculative=self.speculative):
            return PACKED_JOIN_PADDING_CELLS
        return self.forward_read_bytes // self.kv_bytes_per_token()

    @functools.cached_property
    def forward_read_bytes(self) -> int:
        """The target's :func:`~kvboost_hf.hf.models.forward_read_bytes`, read once (a walk over every tensor: it
        was ~0.5 ms of every ``engine.generate()``, which builds a scheduler per call)."""
        return forward_read_bytes(self.model)

    def kv_budget(self, budget_bytes: int | None = None) -> KVBudget | None:
        """The K/V budget of a scheduler for the setting ``budget_bytes``
        (:func:`~kvboost_hf.kv_budget.resolve_budget_bytes`: None derives it from the device's free memory on CUDA,
        none elsewhere; 0: none), counting :meth:`kv_bytes_per_token` per row and column, the width rounded up to a
        graph's capacity bucket and the rows to its row bucket when decode steps may be graphed, and with a draft
        the columns its trees hold beyond their depth
        (:meth:`~kvboost_hf.hf.speculative.DraftConfig.extra_tree_columns`; the draft tokens a graphed verify
        forward pads up to its bucket included); None when there is no budget."""
        resolved = resolve_budget_bytes(budget_bytes, self.model.device)
        if not resolved:
            return None
        config = self.graphs.config
        padded = functools.partial(graphed_drafts, config=config) if config.enabled else None
        tree = self.draft_settings.extra_tree_columns(padded) if self.speculative else 0
        if not config.enabled:
            return KVBudget(resolved, self.kv_bytes_per_token(), tree_columns=tree)
        return KVBudget(
            resolved,
            self.kv_bytes_per_token(),
            columns=functools.partial(graphed_columns, config=config),
            rows=functools.partial(graphed_rows, config=config),
            tree_columns=tree,
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes of K/V one row holds per column: layers x 2 (keys, values) x kv_heads x head_dim x the dtype's size
        of the target's cache, plus the draft's (a draft model's layers, or an early-exit draft's own cache of the
        target's first layers)."""
        layers, heads, head_dim = kv_entry_shape(self.model)
        per_layer = 2 * heads * head_dim * model_dtype(self.model).itemsize
        if self.draft_model is not None:
            draft_layers, draft_heads, draft_dim = kv_entry_shape(self.draft_model)
            draft = draft_layers * 2 * draft_heads * draft_dim * model_dtype(self.draft_model).itemsize
        else:
            draft = (self.draft_settings.early_exit_layers or 0) * per_layer
        return layers * per_layer + draft
