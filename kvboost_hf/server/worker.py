"""The single thread that owns the model: a bounded queue in front of the engine's core (scheduler and runner).

Each job becomes a request of the engine's :class:`~kvboost_hf.scheduling.Scheduler` (the one ``generate_many``
runs; its module states the rules: batches per cache namespace, continuous batching, admission windows, prompts
prefilled alone). Per loop iteration the worker

1. asks the scheduler what runs now (:meth:`~kvboost_hf.scheduling.Scheduler.schedule`);
2. runs exclusive calls (``warm``);
3. has the core execute it under the engine's lock (:meth:`~kvboost_hf.engine_core.EngineCore.execute`): one
   decode step per batch and the prompts' chunks, the tokens taken by the scheduler.

A decode step therefore costs one forward per tenant (cache namespace), not one per user, and a new request gets
its first token after at most one decode step of the running batches instead of after their whole generation.
With a draft model (``engine.speculative``) every batch decodes speculatively inside the same loop (rows with a
grammar take one token per step): a request's tokens do not depend on the draft or on what else runs.

Invariants: only this thread touches the model; at most ``max_queue`` jobs wait for admission (``submit``
raises :class:`Overloaded` beyond); an exception while running a batch fails that batch's jobs and nothing else.
The worker's condition lock is never held during a store read or a forward.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.core.errors import CapacityError, KVBoostError
from kvboost_hf.engine import InferenceEngine, Prompt
from kvboost_hf.hf.chat_segments import DocumentBoundaries
from kvboost_hf.scheduling import Scheduler, SchedulerOutput, StepReport
from kvboost_hf.server.batching import Job, JobRun, ShuttingDown
from kvboost_hf.server.metrics import Metrics
from kvboost_hf.server.settings import ServerConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_AFTER_MAX_S = 600
BATCH_SECONDS_WEIGHT = 0.2  # weight of the newest batch in the moving average behind Retry-After


class Overloaded(KVBoostError, RuntimeError):
    """The admission queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"server overloaded: {depth} requests already waiting")
        self.retry_after_s = retry_after_s


class Worker:
    """Runs every model call of the server on one thread.

    Args:
        engine: the engine (its model is used from this worker only).
        settings: the server's settings; the worker reads ``reuse_mode`` (a :class:`GenerationMode` value),
            ``batch_window_ms``, ``max_batch_size`` (rows running at once, over all batches), ``token_budget``
            (tokens per scheduler step), ``pack_forwards``, ``kv_budget_bytes`` (the K/V memory budget) and
            ``max_queue`` (jobs waiting before ``submit`` refuses). Jobs are batched by the engine's batch policy
            (:meth:`~kvboost_hf.factories.Factories.batch_policy`, the rules of ``generate_many``: a job with
            document segments, or whose reuse needs repair, is prefilled alone, then joins).
        metrics: where batch sizes, latencies and token origins are recorded.
    """

    def __init__(
        self, engine: InferenceEngine, settings: ServerConfig | None = None, *, metrics: Metrics | None = None
    ) -> None:
        settings = settings or ServerConfig()
        self.engine = engine
        self.mode = GenerationMode(settings.reuse_mode)
        self.max_batch_size = settings.max_batch_size
        self.max_queue = settings.max_queue
        self.metrics = metrics or Metrics()
        self.tokenizer_lock = threading.Lock()
        self._cond = threading.Condition()
        self.core = engine.core(
            self.mode,
            max_batch_size=settings.max_batch_size,
            token_budget=settings.token_budget,
            kv_budget_bytes=settings.kv_budget_bytes,
            batch_window_ms=settings.batch_window_ms,
            tokenizer_lock=self.tokenizer_lock,
            pack_forwards=settings.pack_forwards,
        )
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._closing = False
        self._abort = False
        self._woken = False  # something arrived (a job, a call, shutdown) since the worker last looked
        self._batch_seconds = 1.0  # moving average of a batch's wall time, from prefill to its last row
        self._thread = threading.Thread(target=self._run, name="kvboost-model-worker", daemon=True)

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler (its queue, running batches and counters)."""
        return self.core.scheduler

    # ------------------------------------------------------------------ public API (any thread)
    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for admission."""
        return len(self.scheduler.pending)

    @property
    def running_rows(self) -> int:
        """Rows (choices) in running batches."""
        return self.scheduler.running_rows

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
            raise CapacityError(f"a job needs 1 to max_batch_size={self.max_batch_size} rows, got n={job.n}")
        run = JobRun(self.engine, job, self.tokenizer_lock, self.metrics.observe_token)
        with self._cond:
            if self._closing:
                raise ShuttingDown("server is shutting down")
            if self.queue_depth >= self.max_queue:
                raise Overloaded(self.queue_depth, self.retry_after_s())
            self.scheduler.add(run.group)
            self._woken = True
            self._cond.notify()

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely moved on: the waiting jobs, ``max_batch_size`` rows at a time, each
        round taking as long as a batch recently took (at least 1 s)."""
        rounds = 1 + self.queue_depth / self.max_batch_size
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(rounds * self._batch_seconds)))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the worker thread between decode steps (model work outside generation, e.g. warm)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise ShuttingDown("server is shutting down")
            self._calls.append((fn, future))
            self._woken = True
            self._cond.notify()
        return future

    def shutdown(self, grace_s: float = ServerConfig.shutdown_grace_s) -> None:
        """Refuse new jobs, let queued and running ones finish for up to ``grace_s`` seconds, cancel the rest."""
        with self._cond:
            self._closing = True
            self._woken = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(grace_s)
        with self._cond:
            self._abort = True
            self._woken = True
            for batch in self.scheduler.running:  # their rows end at their next token
                for group in batch.groups:
                    if group.cancel is not None:
                        group.cancel.set()
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
            output, calls = work
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # reported to the caller, the worker goes on
                        future.set_exception(exc)
            with self.engine.lock:  # other threads calling the engine wait for this step
                report = self._execute(output)
            self._record(report)
        logger.info("model worker stopped")

    def _execute(self, output: SchedulerOutput) -> StepReport:
        """Run one step. A failure outside the runner's per-batch handling (a bug) fails the requests in flight,
        logged, and the worker goes on serving: it used to end the thread, after which no request ever finished."""
        try:
            return self.core.execute(output)
        except Exception as exc:
            logger.exception("a model step failed outside its batches; the requests in flight fail with it")
            self.metrics.errors.labels("worker", "500").inc()
            try:
                self.core.abort(exc)
            except Exception:
                logger.exception("ending the requests in flight failed too; they are dropped")
                self.scheduler.running.clear()
            return StepReport()

    def _record(self, report: StepReport) -> None:
        """Metrics of one step: batch sizes, prompt tokens computed and loaded, failures, batch wall times."""
        for result in report.results:
            admitted = result.work.admitted
            if result.work.new:
                self.metrics.batch_size.observe(sum(len(group.rows) for group in admitted))
            if result.error is None:  # counted when each prefill completes (a chunked one over several steps)
                loaded = sum(row.reuse.cached_tokens for work in result.prefilled for row in work.rows)
                self.metrics.prompt_tokens.labels("computed").inc(result.computed_tokens)
                self.metrics.prompt_tokens.labels("loaded").inc(loaded)
            if result.error is not None:
                self.metrics.errors.labels("worker", "500").inc()
        for batch in report.ended:
            self._batch_seconds += BATCH_SECONDS_WEIGHT * (batch.age_s - self._batch_seconds)

    def _next_work(self) -> tuple[SchedulerOutput, list[tuple[Callable[[], Any], concurrent.futures.Future]]] | None:
        """Wait for something to do; None once closing and idle. The scheduler plans outside the condition lock (a
        plan may read the store), so ``submit`` never waits for it; ``_woken`` keeps a submit made meanwhile from
        being slept through."""
        while True:
            with self._cond:
                if self._abort:
                    self._cancel_everything()
                calls, self._calls = self._calls, []
                self._woken = False
                self.scheduler.skip_windows = self._closing  # closing: admit what waits without its window
            output = self.scheduler.schedule()
            if output.work or calls:
                return output, calls
            with self._cond:
                if self._closing and not self.scheduler.pending:  # nothing runs (no work was planned): done
                    return None
                if self._woken or self._calls:
                    continue
                deadline = self.scheduler.next_deadline()
                self._cond.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))

    def _cancel_everything(self) -> None:
        self.core.abort(ShuttingDown("server shut down before the request started"))
        for _, future in self._calls:
            future.cancel()
        self._calls = []
