"""Server jobs on the library's scheduler: one request's rows and the events they stream.

A server batch mixes requests with different sampling settings, stop strings, token budgets and clients that may
disconnect, and each one streams its own tokens. :class:`JobRun` maps a job's ``n`` choices to the rows of one
:class:`~kvboost_hf.scheduling.RequestGroup` (the scheduler ``engine.generate`` runs too: same seeds give the same
tokens from Python and over HTTP) and turns each row's progress into events for the job's sink: new visible text
with its log-probabilities (:class:`Delta`), a finished choice (:class:`Finished`), the finished job (:class:`Done`),
or why it could not run (:class:`Failed`).

Invariants: a choice ``i`` of a job with ``seed`` s is sampled with seed ``s + i``; every token is reported at once;
the job's ``cached_tokens`` counts prompt tokens loaded from the store (not those this batch computed itself).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import xgrammar
from transformers import LogitsProcessor

from kvboost_hf.core.errors import KVBoostError
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.decode import DecodeRequest, DecodeRow, TokenLogprob
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.scheduling import RequestCancelled, RequestGroup

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------- job types
class ShuttingDown(KVBoostError, RuntimeError):
    """The worker no longer accepts jobs (or shut down before a job started)."""


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
    token_bytes: bytes  # the token's own bytes (a byte-level piece of a character included): OpenAI's ``bytes``
    top_bytes: tuple[bytes, ...]  # those of ``top``


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


# ---------------------------------------------------------------------------------------------------- a job's rows
@dataclass(eq=False)
class _Choice:
    """Where one row reports: its choice index and what was already sent."""

    index: int
    tokens: int = 0  # the row's tokens already counted
    shown: int = 0  # characters of the row's text already sent
    logprobs: int = 0  # log-probabilities already sent
    last_time: float = 0.0  # time.perf_counter() of the last token counted
    finished: bool = False


class JobRun:
    """One job as the scheduler's :class:`~kvboost_hf.scheduling.RequestGroup` (:attr:`group`): a row per choice,
    each row's progress turned into the job's events.

    Args:
        engine: the engine whose tokenizer and end tokens are used.
        job: the job.
        tokenizer_lock: serialises tokenizer use with the HTTP threads.
        observe_token: ``(seconds_since_arrival_or_previous_token, is_first)`` callback for latency metrics.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        job: Job,
        tokenizer_lock: threading.Lock,
        observe_token: Callable[[float, bool], None] = lambda seconds, first: None,
    ) -> None:
        self.engine = engine
        self.job = job
        self.tokenizer_lock = tokenizer_lock
        self.observe_token = observe_token
        requests = self._requests()
        self.choices = {id(request): _Choice(index) for index, request in enumerate(requests)}
        job.rows_left = job.n
        self.group = RequestGroup(
            engine.factories.new_rows(requests),
            job.cache_salt,
            on_token=self._report,
            on_fail=self._fail,
            cancel=job.cancel,
            arrival=job.arrival,
        )

    def _requests(self) -> list[DecodeRequest]:
        """One request per choice; choice ``i`` of a job with seed ``s`` is sampled with seed ``s + i``."""
        job, params = self.job, self.job.params
        requests = []
        for index in range(job.n):
            seed = params.sampling.seed + index if params.sampling.seed is not None else secrets.randbits(63)
            requests.append(
                DecodeRequest(
                    prompt_ids=job.prompt_ids,
                    max_new_tokens=params.max_tokens,
                    sampling=replace(params.sampling, seed=seed),
                    stop=params.stop,
                    top_logprobs=params.top_logprobs,
                    constraint=params.constraint(len(job.prompt_ids)) if params.constraint is not None else None,
                    cancel=job.cancel,
                    segment_starts=job.segment_starts,
                )
            )
        return requests

    def _fail(self, error: BaseException) -> None:
        if isinstance(error, RequestCancelled):
            self.job.fail(str(error), 499)
        elif isinstance(error, ShuttingDown):
            self.job.fail(str(error), 503)
        else:
            self.job.fail(f"generation failed: {type(error).__name__}: {error}")

    def _report(self, row: DecodeRow) -> None:
        """Send the row's newly visible text and log-probabilities; finish the choice (and the job) when done.
        Called after each token of the row, and once without a new token when it is cancelled."""
        choice = self.choices[id(row.request)]
        job = self.job
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
                self._as_text(entry, row.detokenized.offsets[first_index + k]) for k, entry in enumerate(new_logprobs)
            )
            job.sink(Delta(choice.index, new_text, logprobs))
            choice.shown, choice.logprobs = len(row.text), len(row.logprobs)
        if row.finished:
            choice.finished = True
            job.sink(Finished(choice.index, row.finish_reason or "stop"))
            job.rows_left -= 1
            if job.rows_left == 0:
                job.sink(Done(len(job.prompt_ids), job.cached_tokens, job.completion_tokens))

    def _as_text(self, entry: TokenLogprob, offset: int) -> TextLogprob:
        """``entry`` as text; ``offset``: the length of the row's text before it (an incomplete character is not
        text yet)."""
        with self.tokenizer_lock:
            decode = self.engine.tokenizer.decode
            top = tuple((decode([t]), v) for t, v in entry.top)
            raw = token_bytes(self.engine.tokenizer, decode)
            return TextLogprob(
                decode([entry.token]), entry.logprob, top, offset, raw(entry.token), tuple(raw(t) for t, _ in entry.top)
            )


_VOCAB_BYTES: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any, decode: Callable[[list[int]], str]) -> Callable[[int], bytes]:
    """``token id -> its bytes``: what the token adds to the UTF-8 text (a byte-level or byte-fallback piece of a
    character included, where ``decode([id])`` gives U+FFFD), read from xgrammar's decoded vocabulary of
    ``tokenizer`` (built once per tokenizer, ~0.3 s for 49k tokens; call under the tokenizer lock). An id outside
    it, or a tokenizer xgrammar cannot read, falls back to the UTF-8 of ``decode([id])``."""
    vocabulary = _VOCAB_BYTES.get(tokenizer)
    if vocabulary is None:
        try:
            vocabulary = list(xgrammar.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
        except Exception:  # any tokenizer xgrammar cannot read: the decoded text's bytes instead
            logger.warning("logprob bytes: xgrammar cannot read this tokenizer; bytes are the decoded text's")
            vocabulary = []
        _VOCAB_BYTES[tokenizer] = vocabulary

    def raw(token: int) -> bytes:
        return vocabulary[token] if 0 <= token < len(vocabulary) else decode([token]).encode()

    return raw
