"""One batch of requests run by the model-owning worker: a left-padded prefill, then a decode loop of our own.

Why not ``engine.generate_batch``: a server batch mixes requests with different sampling settings, stop strings,
token budgets and clients that may disconnect, and each one streams its own tokens. This module therefore drives
``engine.model`` forward by forward:

* prefill: prompts (any prefixes) are left-padded into one batch on a fresh
  :class:`~kvboost_hf.hf.cache.ChunkReuseCache` (the cache's hooks stitch stored chunks and compute only the
  uncached tail). When several rows share a chunk-aligned prefix whose chunks are not stored yet, that prefix is
  computed once (batch of one) and stored first, so the batch prefill loads it from the store for every row of
  that group instead of computing it once per row;
* decode: one forward per step for the rows still running; each row's logits go through its own transformers
  ``LogitsProcessorList`` (:mod:`kvboost_hf.hf.sampling`: penalties, bias, grammar, temperature, top-k/p, min-p),
  the row picks its token with its own seeded generator (temperature 0 = argmax, no division), checks its own
  end tokens, stop strings, budget and cancel event, and reports every token at once through its job's sink.
  Finished rows leave the batch.

Invariants: a row's positions and attention mask are exactly those ``generate()`` builds for a left-padded
batch, so with temperature 0 each row yields the tokens it yields alone; stored chunks (and each row's unfinished
last chunk, as ``engine.generate`` stores it) are saved before a row leaves the batch, so nothing computed is lost.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from kvboost_hf.core.chunking import chunk_spans
from kvboost_hf.core.config import GenerationMode
from kvboost_hf.core.keys import chain_prefix_keys
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.cache import ChunkReuseCache
from kvboost_hf.hf.sampling import SamplingParams, build_processors, choose_token

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- job types
@dataclass(frozen=True)
class JobParams:
    """Per-request settings: token budget, sampling (see :class:`~kvboost_hf.hf.sampling.SamplingParams`), stop
    strings, logprobs (``top_logprobs`` None = none) and ``constraint``, a factory of a fresh per-row logits
    processor (e.g. a grammar mask) given the prompt length in tokens."""

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None
    constraint: Callable[[int], LogitsProcessor] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability (natural log, under the model's unscaled distribution) of one generated token."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Delta:
    """New visible text of choice ``index`` (may be empty when only held-back tokens arrived)."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Choice ``index`` is complete; ``reason`` is "stop", "length" or "cancelled"."""

    index: int
    reason: str


@dataclass(frozen=True)
class Done:
    """Every choice of the job is complete. Token counts are per job (the prompt counted once)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The job could not be run (the worker survives; the HTTP layer answers ``status``)."""

    message: str
    status: int = 500


Event = Delta | Finished | Done | Failed


@dataclass(eq=False)
class Job:
    """One HTTP request: ``n`` choices for one tokenised prompt. ``sink`` is called from the worker thread and
    must not block. ``arrival`` is a ``time.perf_counter()`` value (TTFT is measured from it)."""

    prompt_ids: list[int]
    params: JobParams
    sink: Callable[[Event], None]
    n: int = 1
    cache_salt: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    rows_left: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def fail(self, message: str, status: int = 500) -> None:
        self.rows_left = 0
        self.sink(Failed(message, status))


# ---------------------------------------------------------------------------------------------------- text helpers
def visible_text(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The part of ``text`` that may be shown, and whether a stop string ended it.

    With a stop string present the text is cut exactly before its first occurrence. Otherwise a tail that could
    still grow into a stop string, or an incomplete UTF-8 sequence (U+FFFD at the end), is held back.
    """
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if cuts:
        return text[: min(cuts)], True
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:size]):
                hold = size
                break
    end = len(text) - hold
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return text[:end], False


# ---------------------------------------------------------------------------------------------------- the batch
@dataclass(eq=False)
class _Row:
    """Decoding state of one choice of one job."""

    job: Job
    index: int
    generator: torch.Generator
    processors: LogitsProcessorList
    end_ids: set[int]
    tokens: list[int] = field(default_factory=list)
    shown: int = 0  # characters of the visible text already sent
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    last_token_time: float | None = None


class Batch:
    """Jobs sharing one cache (same ``cache_salt``), run together until every row finishes.

    Args:
        engine: the engine whose model, tokenizer, store and chunking are used.
        jobs: admitted jobs; all have the same ``cache_salt``.
        mode: ``CHUNK_KV_REUSE`` (reuse) or ``BASELINE`` (plain K/V, no store).
        tokenizer_lock: serialises tokenizer use with the HTTP threads.
        observe_token: ``(seconds_since_arrival_or_previous_token, is_first)`` callback for latency metrics.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        jobs: Sequence[Job],
        mode: GenerationMode,
        tokenizer_lock: threading.Lock,
        observe_token: Callable[[float, bool], None] = lambda seconds, first: None,
    ) -> None:
        self.engine = engine
        self.mode = mode
        self.tokenizer_lock = tokenizer_lock
        self.observe_token = observe_token
        self.jobs = list(jobs)
        self.rows: list[_Row] = []
        for job in self.jobs:
            job.rows_left = job.n
            sampling = job.params.sampling
            for index in range(job.n):
                seed = sampling.seed + index if sampling.seed is not None else secrets.randbits(63)
                constraint = job.params.constraint
                processors = build_processors(
                    sampling,
                    len(job.prompt_ids),
                    engine.eos_token_ids,
                    [constraint(len(job.prompt_ids))] if constraint is not None else [],
                )
                end_ids = sampling.end_token_ids(engine.eos_token_ids)
                self.rows.append(_Row(job, index, torch.Generator().manual_seed(seed), processors, end_ids))
        self.cache: ChunkReuseCache | DynamicCache | None = None
        self.mask = torch.empty(0)
        self.positions = torch.empty(0)
        self.computed_tokens = 0  # prompt tokens computed (not loaded), all rows
        self.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return not self.rows

    @property
    def age_s(self) -> float:
        """Seconds since the batch was formed."""
        return time.perf_counter() - self.started

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # ------------------------------------------------------------------ forwards
    def prefill(self) -> None:
        """Compute (or load) every row's prompt and pick each row's first token."""
        salt = self.jobs[0].cache_salt
        prompts = [row.job.prompt_ids for row in self.rows]
        reuse = self.mode is not GenerationMode.BASELINE
        shared_computed = self._store_shared_prefixes(prompts, salt) if reuse else [0] * len(prompts)
        self.cache = self.engine.new_cache(self.mode, salt) if reuse else DynamicCache()
        input_ids, self.mask = self.engine.left_pad(prompts)
        position_ids = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        logits = self._forward(input_ids, position_ids)
        self.positions = position_ids[:, -1]
        row_reuse = self.cache.last_reuse if isinstance(self.cache, ChunkReuseCache) else []
        for job in self.jobs:
            first = next(i for i, row in enumerate(self.rows) if row.job is job)
            cached = row_reuse[first].cached_tokens if first < len(row_reuse) else 0
            job.cached_tokens = max(0, cached - shared_computed[first])
        self.computed_tokens = sum(len(p) for p in prompts) - sum(j.cached_tokens * j.n for j in self.jobs)
        self._advance(logits)

    def step(self) -> None:
        """One decode step for every running row."""
        last = torch.tensor([[row.tokens[-1]] for row in self.rows], device=self.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        self.positions = self.positions + 1
        self._advance(self._forward(last, self.positions[:, None]))

    def cancel_all(self) -> None:
        """Finish every running row now (shutdown)."""
        for row in self.rows:
            self._finish(row, "cancelled")
        self.rows = []
        self.close()

    def fail(self, message: str) -> None:
        """Report ``message`` to every job still running and drop the batch (its cache may be inconsistent)."""
        for job in dict.fromkeys(row.job for row in self.rows):
            job.fail(message)
        self.rows = []
        self.cache = None

    def close(self) -> None:
        """Store what the cache computed (each row's unfinished last chunk included) and drop it."""
        if isinstance(self.cache, ChunkReuseCache):
            self.cache.save(tail=True)
        self.cache = None

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.engine.model(
                input_ids=input_ids,
                attention_mask=self.mask,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1, :].float()

    def _store_shared_prefixes(self, prompts: list[list[int]], salt: str | None) -> list[int]:
        """For each group of rows with the same first chunk, store the chunk-aligned prefix they share once.

        Returns, per row, the prompt tokens computed here for its group (then loaded by the batch prefill).
        """
        groups: dict[tuple[int, ...], list[int]] = {}
        for row, prompt in enumerate(prompts):
            spans = chunk_spans(prompt, self.engine.chunking)
            head = tuple(prompt[: spans[0][1]]) if spans else ()
            groups.setdefault(head, []).append(row)
        computed = [0] * len(prompts)
        for head, rows in groups.items():
            if head and len(rows) > 1:
                shared = self._store_shared_prefix([prompts[row] for row in rows], salt)
                for row in rows:
                    computed[row] = shared
        return computed

    def _store_shared_prefix(self, prompts: list[list[int]], salt: str | None) -> int:
        """Compute and store, once, the chunk-aligned prefix every row shares when it is not stored yet.

        Returns the prompt tokens computed here (they are then loaded, not computed, by the batch prefill).
        """
        if len(prompts) < 2:
            return 0
        first = prompts[0]
        shared = 0
        for _, end in chunk_spans(first, self.engine.chunking):
            if any(len(p) <= end or p[:end] != first[:end] for p in prompts[1:]):
                break
            shared = end
        if shared == 0:
            return 0
        cache = self.engine.new_cache(self.mode, salt)
        spans = chunk_spans(first[:shared], self.engine.chunking)
        keys = chain_prefix_keys(cache.namespace, first, spans)
        if all(self.engine.store.contains(key) for key in keys):
            return 0
        ids = torch.tensor([first[:shared]], device=self.device)
        with torch.inference_mode():
            self.engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.save(tail=False)
        loaded = cache.last_reuse[0].cached_tokens if cache.last_reuse else 0
        logger.debug("stored a shared prefix of %d tokens for %d rows", shared, len(prompts))
        return shared - loaded

    # ------------------------------------------------------------------ per-row bookkeeping
    def _advance(self, logits: torch.Tensor) -> None:
        """Give every row its next token, report it, and drop the rows that finished."""
        params = [row.job.params for row in self.rows]
        tokens = [self._choose(row, logits[i : i + 1]) for i, row in enumerate(self.rows)]
        log_probs = torch.log_softmax(logits, dim=-1) if any(p.top_logprobs is not None for p in params) else None
        now = time.perf_counter()
        keep: list[int] = []
        for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            row.tokens.append(token)
            row.job.completion_tokens += 1
            self.observe_token(now - (row.last_token_time or row.job.arrival), row.last_token_time is None)
            row.last_token_time = now
            if log_probs is not None and row.job.params.top_logprobs is not None:
                row.pending_logprobs.append(self._logprob(log_probs[i], token, row.job.params.top_logprobs))
            reason = self._emit(row)
            if reason is not None:
                self._finish(row, reason)
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            self._select(keep)

    def _choose(self, row: _Row, logits: torch.Tensor) -> int:
        """The row's next token: its logits ``[1, V]`` through its own processors, then its own choice."""
        if row.processors:
            input_ids = torch.tensor([row.job.prompt_ids + row.tokens], device=logits.device)
            logits = row.processors(input_ids, logits)
        return choose_token(logits, row.job.params.sampling, row.generator)

    def _emit(self, row: _Row) -> str | None:
        """Send the row's newly visible text; return its finish reason, or None while it runs."""
        params = row.job.params
        ended_by_eos = row.tokens[-1] in row.end_ids
        with self.tokenizer_lock:
            text = self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True)
        visible, stopped = visible_text(text, params.stop)
        reason = None
        if stopped or ended_by_eos:
            reason = "stop"
        elif len(row.tokens) >= params.max_tokens:
            reason = "length"
        elif row.job.cancel.is_set():
            reason = "cancelled"
        if reason is not None and not stopped:
            visible = text  # nothing more will come: show what was held back
        new_text = visible[row.shown :]
        if new_text or row.pending_logprobs:
            row.job.sink(Delta(row.index, new_text, tuple(row.pending_logprobs)))
            row.shown = len(visible)
            row.pending_logprobs = []
        return reason

    def _finish(self, row: _Row, reason: str) -> None:
        job = row.job
        job.sink(Finished(row.index, reason))
        job.rows_left -= 1
        if job.rows_left == 0:
            job.sink(Done(len(job.prompt_ids), job.cached_tokens, job.completion_tokens))

    def _select(self, keep: list[int]) -> None:
        if isinstance(self.cache, ChunkReuseCache):
            self.cache.save(tail=True)  # store the leaving rows' chunks (and unfinished last chunks) first
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.close()
            return
        assert self.cache is not None, "rows are selected only between prefill and close"
        index = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]

    def _logprob(self, log_probs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        values, indices = log_probs.topk(top) if top > 0 else (log_probs[:0], log_probs[:0].long())
        with self.tokenizer_lock:
            decode = self.engine.tokenizer.decode
            return TokenLogprob(
                decode([token]),
                float(log_probs[token]),
                tuple((decode([int(i)]), float(v)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)),
            )
