"""One batch of requests run by the model-owning worker, on the library's decode loop.

A server batch mixes requests with different sampling settings, stop strings, token budgets and clients that may
disconnect, and each one streams its own tokens. :class:`Batch` maps each job's ``n`` choices to rows of one
:class:`~kvboost_hf.hf.decode.DecodeLoop` (the loop ``engine.generate`` runs too: same seeds give the same tokens
from Python and over HTTP) and turns each row's progress into events for the job's sink: new visible text with its
log-probabilities (:class:`Delta`), a finished choice (:class:`Finished`), the finished job (:class:`Done`).

Invariants: a choice ``i`` of a job with ``seed`` s is sampled with seed ``s + i``; every token is reported at once;
the job's ``cached_tokens`` counts prompt tokens loaded from the store (not those this batch computed itself).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from transformers import LogitsProcessor

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, DecodeRow, TokenLogprob
from kvboost_hf.hf.sampling import SamplingConfig


# ---------------------------------------------------------------------------------------------------- job types
@dataclass(frozen=True, kw_only=True)
class JobParams:
    """Per-request settings: token budget, sampling (see :class:`~kvboost_hf.hf.sampling.SamplingConfig`), stop
    strings, logprobs (``top_logprobs`` None = none) and ``constraint``, a factory of a fresh per-row logits
    processor (e.g. a grammar mask) given the prompt length in tokens."""

    max_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None
    constraint: Callable[[int], LogitsProcessor] | None = None


@dataclass(frozen=True)
class TextLogprob:
    """Log-probability (natural log, under the model's unscaled distribution) of one generated token, as text.
    ``offset``: where the token starts in the choice's text, in characters (a token that ends inside a character
    points at that character's start)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    offset: int


@dataclass(frozen=True)
class Delta:
    """New visible text of choice ``index`` (may be empty when only held-back tokens arrived)."""

    index: int
    text: str
    logprobs: tuple[TextLogprob, ...] = ()


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
    must not block. ``arrival`` is a ``time.perf_counter()`` value (TTFT is measured from it).
    ``segment_starts``: token offsets where the prompt's documents start (its rows are prefilled in a cache built
    with them, then decode in their batch)."""

    prompt_ids: list[int]
    params: JobParams
    sink: Callable[[Event], None]
    n: int = 1
    cache_salt: str | None = None
    segment_starts: tuple[int, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    rows_left: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def fail(self, message: str, status: int = 500) -> None:
        self.rows_left = 0
        self.sink(Failed(message, status))


# ---------------------------------------------------------------------------------------------------- the batch
@dataclass(eq=False)
class _Choice:
    """Where one row of the loop reports: its job, its choice index, what was already sent."""

    job: Job
    index: int
    tokens: int = 0  # the row's tokens already counted
    shown: int = 0  # characters of the row's text already sent
    logprobs: int = 0  # log-probabilities already sent
    last_time: float = 0.0  # time.perf_counter() of the last token counted
    finished: bool = False


class Batch:
    """Jobs sharing one cache (same ``cache_salt``), run together until every row finishes.

    Args:
        engine: the engine whose model, tokenizer, store and chunking are used.
        jobs: admitted jobs; all have the same ``cache_salt``.
        mode: ``CHUNK_KV_REUSE`` / ``PREFIX_CACHE`` (reuse) or ``BASELINE`` (plain K/V, no store).
        tokenizer_lock: serialises tokenizer use with the HTTP threads.
        observe_token: ``(seconds_since_arrival_or_previous_token, is_first)`` callback for latency metrics.

    With a draft model the engine's loop decodes every row speculatively (same tokens as without, fewer target
    forwards), whatever else shares the batch.
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
        self.jobs: list[Job] = []
        self.choices: dict[int, _Choice] = {}
        rows = DecodeLoop.rows_for(self._requests_for(jobs), engine.eos_token_ids)
        self.loop = engine.decode_loop(
            rows, mode, self.jobs[0].cache_salt, on_token=self._report, tokenizer_lock=tokenizer_lock
        )
        self.started = time.perf_counter()
        self._counted = False

    def _requests_for(self, jobs: Sequence[Job]) -> list[DecodeRequest]:
        """One request per choice of ``jobs`` (added to this batch's jobs), each mapped to where it reports."""
        requests: list[DecodeRequest] = []
        for job in jobs:
            self.jobs.append(job)
            job.rows_left = job.n
            params = job.params
            for index in range(job.n):
                seed = params.sampling.seed + index if params.sampling.seed is not None else secrets.randbits(63)
                request = DecodeRequest(
                    prompt_ids=job.prompt_ids,
                    max_new_tokens=params.max_tokens,
                    sampling=replace(params.sampling, seed=seed),
                    stop=params.stop,
                    top_logprobs=params.top_logprobs,
                    constraint=params.constraint(len(job.prompt_ids)) if params.constraint is not None else None,
                    cancel=job.cancel,
                    segment_starts=job.segment_starts,
                )
                self.choices[id(request)] = _Choice(job, index)
                requests.append(request)
        return requests

    def join(self, jobs: Sequence[Job]) -> None:
        """Add ``jobs`` to the running batch (continuous batching): their prompts are prefilled now and their rows
        decode with the others from the next step (``computed_tokens`` grows by their computed prompt tokens)."""
        self.loop.join(DecodeLoop.rows_for(self._requests_for(jobs), self.engine.eos_token_ids))

    @property
    def rows(self) -> list[DecodeRow]:
        """The rows still running."""
        return self.loop.running

    @property
    def done(self) -> bool:
        return self.loop.done

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed (not loaded) for all rows."""
        return self.loop.computed_tokens

    @property
    def age_s(self) -> float:
        """Seconds since the batch was formed."""
        return time.perf_counter() - self.started

    def prefill(self) -> None:
        """Compute (or load) every row's prompt and report each row's first token."""
        self.loop.prefill()
        self._count_when_done()

    def step(self) -> None:
        """One decode step for every running row."""
        self.loop.step()
        self._count_when_done()

    def _count_when_done(self) -> None:
        """Add the finished loop's forwards and draft counters to the engine's totals (once)."""
        if self.loop.done and not self._counted:
            self._counted = True
            self.engine.count_decode(self.loop)

    def cancel_all(self) -> None:
        """Finish every running row now (shutdown)."""
        self.loop.cancel_all()
        self._count_when_done()

    def fail(self, message: str) -> None:
        """Report ``message`` to every job still running and drop the batch (its cache may be inconsistent)."""
        for job in dict.fromkeys(self.choices[id(row.request)].job for row in self.loop.running):
            job.fail(message)
        self.loop.running = []
        self.loop.close_without_saving()

    def _report(self, row: DecodeRow) -> None:
        """Send the row's newly visible text and log-probabilities; finish the choice (and the job) when done.
        Called by the loop after each token of the row, and once without a new token when it is cancelled."""
        choice = self.choices[id(row.request)]
        job = choice.job
        if choice.finished:
            return
        if len(row.tokens) > choice.tokens:
            first = choice.tokens == 0
            now = row.last_token_time or time.perf_counter()
            self.observe_token(now - (job.arrival if first else choice.last_time), first)
            job.completion_tokens += len(row.tokens) - choice.tokens
            choice.tokens, choice.last_time = len(row.tokens), now
            if first and choice.index == 0:
                job.cached_tokens = row.reuse.cached_tokens
        new_text = row.text[choice.shown :]
        new_logprobs = row.logprobs[choice.logprobs :]
        if new_text or new_logprobs:
            first_index = choice.logprobs
            logprobs = tuple(
                self._as_text(entry, row.tokens[: first_index + k]) for k, entry in enumerate(new_logprobs)
            )
            job.sink(Delta(choice.index, new_text, logprobs))
            choice.shown, choice.logprobs = len(row.text), len(row.logprobs)
        if row.finished:
            choice.finished = True
            job.sink(Finished(choice.index, row.finish_reason or "stop"))
            job.rows_left -= 1
            if job.rows_left == 0:
                job.sink(Done(len(job.prompt_ids), job.cached_tokens, job.completion_tokens))

    def _as_text(self, entry: TokenLogprob, before: list[int]) -> TextLogprob:
        """``entry`` as text; ``before``: the row's tokens before it (its offset is the length of their text)."""
        with self.tokenizer_lock:
            decode = self.engine.tokenizer.decode
            top = tuple((decode([t]), v) for t, v in entry.top)
            offset = len(decode(before).rstrip("\ufffd"))  # an incomplete character is not text yet
            return TextLogprob(decode([entry.token]), entry.logprob, top, offset)
