"""The single thread that owns the model: a bounded queue, continuous batching, interleaved tenants.

Scheduling, per loop iteration:

1. admission: jobs are keyed by the engine's batch policy (:mod:`kvboost_hf.scheduling`: the ``cache_salt``; a job
   whose prompt has document segments, or whose reuse needs repair, is prefilled alone, then decodes with its
   batch). A pending job whose key matches a running batch joins it at once (continuous batching: its prompt is
   prefilled, then its rows decode in the same forward as the running rows). Other pending jobs of one key are
   admitted as a new :class:`~kvboost_hf.server.batching.Batch` once the oldest has waited ``batch_window_s`` (or
   they fill ``max_batch_size`` rows); the rows of all running batches stay within ``max_batch_size``;
2. exclusive calls (``warm``) run;
3. new batches run their prefill, joining jobs theirs, then every running batch makes one decode step.

A decode step therefore costs one forward per tenant (cache namespace), not one per user, and a new request gets
its first token after at most one decode step of the running batches instead of after their whole generation.
With a draft model (``engine.speculative``) every batch decodes speculatively inside the same loop (rows with a
grammar take one token per step): a request's tokens do not depend on the draft or on what else runs.

Invariants: only this thread touches the model; at most ``max_queue`` jobs wait for admission (``submit``
raises :class:`Overloaded` beyond); an exception while running a batch fails that batch's jobs and nothing else.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvboost_hf.core.errors import KVBoostError
from kvboost_hf.engine import InferenceEngine, Prompt
from kvboost_hf.hf.chat_segments import DocumentBoundaries
from kvboost_hf.scheduling import BatchKey
from kvboost_hf.server.batching import Batch, Job
from kvboost_hf.server.metrics import Metrics
from kvboost_hf.server.settings import REUSE_MODES, ServerConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_MAX_S = 600
BATCH_SECONDS_WEIGHT = 0.2  # weight of the newest batch in the moving average behind Retry-After


class Overloaded(KVBoostError, RuntimeError):
    """The admission queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"server overloaded: {depth} requests already waiting")
        self.retry_after_s = retry_after_s


class ShuttingDown(KVBoostError, RuntimeError):
    """The worker no longer accepts jobs."""


class Worker:
    """Runs every model call of the server on one thread.

    Args:
        engine: the engine (its model is used from this worker only).
        settings: the server's settings; the worker reads ``reuse_mode`` (:data:`REUSE_MODES`: ``prefix`` for exact
            prefix hits, ``chunk`` also for repaired non-prefix hits, ``off`` for plain K/V), ``batch_window_ms``,
            ``max_batch_size`` (rows running at once, over all batches) and ``max_queue`` (jobs waiting before
            ``submit`` refuses). Jobs are batched by the engine's :meth:`~InferenceEngine.batch_policy` (the rules
            of ``generate_many``: a job with document segments, or whose reuse needs repair, is prefilled alone,
            then joins).
        metrics: where batch sizes, latencies and token origins are recorded.
    """

    def __init__(
        self, engine: InferenceEngine, settings: ServerConfig | None = None, *, metrics: Metrics | None = None
    ) -> None:
        settings = settings or ServerConfig()
        self.engine = engine
        self.mode = REUSE_MODES[settings.reuse_mode]
        self.batch_window_s = settings.batch_window_ms / 1e3
        self.max_batch_size = settings.max_batch_size
        self.max_queue = settings.max_queue
        self.metrics = metrics or Metrics()
        self.tokenizer_lock = threading.Lock()
        self._cond = threading.Condition()
        self.policy = engine.batch_policy(self.mode)
        self._pending: list[tuple[BatchKey, Job]] = []
        self._keys: dict[Batch, BatchKey] = {}
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._active: list[Batch] = []
        self._closing = False
        self._abort = False
        self._batch_seconds = 1.0  # moving average of a batch's wall time, from prefill to its last row
        self._thread = threading.Thread(target=self._run, name="kvboost-model-worker", daemon=True)

    # ------------------------------------------------------------------ public API (any thread)
    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for admission."""
        return len(self._pending)

    @property
    def running_rows(self) -> int:
        """Rows (choices) in running batches."""
        return sum(len(batch.rows) for batch in self._active)

    def encode(self, prompt: Prompt, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a rendered prompt (raises ValueError on an empty or malformed prompt)."""
        with self.tokenizer_lock:
            return self.engine.encode(prompt, add_generation_prompt=add_generation_prompt)

    def encode_segments(
        self,
        prompt: Prompt,
        *,
        add_generation_prompt: bool = True,
        document_boundaries: DocumentBoundaries = DocumentBoundaries.NONE,
    ) -> tuple[list[int], list[int]]:
        """Token ids and segment starts of a rendered prompt (:meth:`InferenceEngine.encode_segments`)."""
        with self.tokenizer_lock:
            return self.engine.encode_segments(
                prompt, add_generation_prompt=add_generation_prompt, document_boundaries=document_boundaries
            )

    def submit(self, job: Job) -> None:
        """Queue ``job``; its events reach ``job.sink`` from the worker thread.

        Raises Overloaded (queue full), ShuttingDown, or ValueError when ``job.n`` exceeds ``max_batch_size``.
        """
        if not 1 <= job.n <= self.max_batch_size:
            raise ValueError(f"a job needs 1 to max_batch_size={self.max_batch_size} rows, got n={job.n}")
        key = self.policy.key(job.cache_salt)
        with self._cond:
            if self._closing:
                raise ShuttingDown("server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise Overloaded(len(self._pending), self.retry_after_s())
            self._pending.append((key, job))
            self._cond.notify()

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely moved on: the waiting jobs, ``max_batch_size`` rows at a time, each
        round taking as long as a batch recently took (at least 1 s)."""
        rounds = 1 + len(self._pending) / self.max_batch_size
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(rounds * self._batch_seconds)))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the worker thread between decode steps (model work outside generation, e.g. warm)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise ShuttingDown("server is shutting down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Refuse new jobs, let queued and running ones finish for up to ``grace_s`` seconds, cancel the rest."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(grace_s)
        with self._cond:
            self._abort = True
            for batch in self._active:  # their rows end at their next token
                for job in batch.jobs:
                    job.cancel.set()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(30.0)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        logger.info("model worker started (mode=%s, max_batch_size=%d)", self.mode.value, self.max_batch_size)
        while True:
            work = self._next_work()
            if work is None:
                break
            admitted, calls = work
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # reported to the caller, the worker goes on
                        future.set_exception(exc)
            for batch, joining in admitted:
                if joining is None:
                    self._guarded(batch, batch.prefill)
                    self._count_prompt(batch.computed_tokens, batch.jobs)
                else:
                    before = batch.computed_tokens
                    self._guarded(batch, functools.partial(batch.join, joining))
                    self._count_prompt(batch.computed_tokens - before, joining)
            for batch in self._active:
                if not batch.done:
                    self._guarded(batch, batch.step)
                if batch.done:
                    self._batch_seconds += BATCH_SECONDS_WEIGHT * (batch.age_s - self._batch_seconds)
            with self._cond:
                self._active = [batch for batch in self._active if not batch.done]
                self._keys = {batch: key for batch, key in self._keys.items() if not batch.done}
        logger.info("model worker stopped")

    def _count_prompt(self, computed: int, jobs: Sequence[Job]) -> None:
        self.metrics.prompt_tokens.labels("computed").inc(computed)
        self.metrics.prompt_tokens.labels("loaded").inc(sum(job.cached_tokens * job.n for job in jobs))

    def _guarded(self, batch: Batch, action: Callable[[], None]) -> None:
        try:
            with self.engine.lock:  # other threads calling the engine wait for this step
                action()
        except Exception as exc:
            logger.exception("batch of %d rows failed", len(batch.rows))
            self.metrics.errors.labels("worker", "500").inc()
            batch.fail(f"generation failed: {type(exc).__name__}: {exc}")

    def _next_work(
        self,
    ) -> tuple[list[tuple[Batch, list[Job] | None]], list[tuple[Callable[[], Any], concurrent.futures.Future]]] | None:
        """Wait for something to do; None once closing and idle."""
        with self._cond:
            while True:
                if self._abort:
                    self._cancel_everything()
                calls, self._calls = self._calls, []
                admitted = self._admit(time.perf_counter())
                if admitted or calls or self._active:
                    self._active += [batch for batch, joining in admitted if joining is None]
                    return admitted, calls
                if self._closing and not self._pending:
                    return None
                deadlines = [job.arrival + self.batch_window_s for _, job in self._pending]
                timeout = max(0.0, min(deadlines) - time.perf_counter()) if deadlines else None
                self._cond.wait(timeout)

    def _admit(self, now: float) -> list[tuple[Batch, list[Job] | None]]:
        """Pending jobs that are ready and fit, as ``(batch, None)`` for a new batch and ``(batch, jobs)`` for jobs
        joining a running batch of the same key (at once: no batch window). Called with the lock held."""
        self._pending = [(key, job) for key, job in self._pending if not self._dropped_if_cancelled(job)]
        groups: dict[BatchKey, list[Job]] = {}
        for key, job in self._pending:
            groups.setdefault(key, []).append(job)
        free = self.max_batch_size - self.running_rows
        formed: list[tuple[BatchKey, Batch | None, list[Job]]] = []
        taken: set[int] = set()
        for key, members in groups.items():  # insertion order = oldest job first
            running = self._joinable(key)
            rows = sum(job.n for job in members)
            window_over = now >= members[0].arrival + self.batch_window_s
            ready = running is not None or rows >= self.max_batch_size or window_over
            if not (ready or self._closing):
                continue
            chosen: list[Job] = []
            for job in members:
                if job.n > free:
                    break
                chosen.append(job)
                free -= job.n
            if chosen:
                formed.append((key, running, chosen))
                taken.update(id(job) for job in chosen)
        self._pending = [(key, job) for key, job in self._pending if id(job) not in taken]
        return [
            (batch, jobs) if batch is not None else (self._new_batch(key, jobs), None) for key, batch, jobs in formed
        ]

    def _joinable(self, key: BatchKey) -> Batch | None:
        """A running batch that new jobs of ``key`` may join (decoding, same namespace)."""
        for batch in self._active:
            if not batch.done and self._keys.get(batch) == key:
                return batch
        return None

    def _new_batch(self, key: BatchKey, jobs: Sequence[Job]) -> Batch:
        self.metrics.batch_size.observe(sum(job.n for job in jobs))
        batch = Batch(self.engine, jobs, self.mode, self.tokenizer_lock, self.metrics.observe_token)
        self._keys[batch] = key
        return batch

    @staticmethod
    def _dropped_if_cancelled(job: Job) -> bool:
        if job.cancel.is_set():
            job.fail("cancelled before it started", 499)
            return True
        return False

    def _cancel_everything(self) -> None:
        for _, job in self._pending:
            job.fail("server shut down before the request started", 503)
        self._pending = []
        for batch in self._active:
            batch.cancel_all()
        self._active = []
        self._keys = {}
        for _, future in self._calls:
            future.cancel()
        self._calls = []
