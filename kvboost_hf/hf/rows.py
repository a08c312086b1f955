"""The rows of a decode batch: what a row asks for (:class:`DecodeRequest`), its state (:class:`DecodeRow`: tokens,
text, log-probabilities, finish reason, its own processors and seeded generator), what the runner sampled for it in
one forward (:class:`RowOutput`, :class:`TokenLogprob`, :class:`DraftRound`), one token per row from a forward's
logits (:func:`sample`), and the batched transfer of sampled ids and log-probabilities to the host (:func:`sampled`).

The runner (:class:`~kvboost_hf.hf.decode.DecodeLoop`) and tree verification (:mod:`kvboost_hf.hf.verify`) read rows
and choose their tokens; the scheduler (:mod:`kvboost_hf.scheduling`) appends them and ends rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvboost_hf.core.errors import InputError
from kvboost_hf.hf.detokenize import IncrementalText
from kvboost_hf.hf.prefill import RowReuse
from kvboost_hf.hf.sampling import (
    SamplingConfig,
    build_processors,
    choose_tokens,
    greedy_tokens,
    reads_input_ids,
)
from kvboost_hf.hf.transfer import to_device

TokenTop = tuple[tuple[int, float], ...]


@dataclass(frozen=True, kw_only=True)
class DecodeRequest:
    """What one row asks for (keyword arguments only).

    Args:
        prompt_ids: the prompt's token ids (not empty).
        max_new_tokens: the token budget (>= 1).
        sampling: decoding settings; ``sampling.seed`` None = a seed drawn from torch's global generator.
        stop: strings that end the row; the text is cut exactly before the first one.
        top_logprobs: None = no log-probabilities; k >= 0 = the chosen token's and the top ``k``.
        constraint: a fresh logits processor for this row only (e.g. a grammar mask), applied after the
            penalties and before temperature.
        cancel: when set, the row ends with finish reason ``"cancelled"`` after its current token.
        keep_first_logits: keep the first step's raw logits (fp32, CPU) in :attr:`DecodeRow.first_logits`.
        segment_starts: token offsets in ``prompt_ids`` where its segments (documents, a question) start: the row's
            cache is built with them (each starts a chunk; stored documents hit by content key at any position).
            With reuse on, a row with segment starts is prefilled in a cache of its own prompt (the scheduler's
            :class:`PrefillWork` of it), then decodes with the other rows.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None
    constraint: LogitsProcessor | None = None
    cancel: threading.Event | None = None
    keep_first_logits: bool = False
    segment_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise InputError("prompt_ids is empty: a row needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if outside := [start for start in self.segment_starts if not 0 <= start <= len(self.prompt_ids)]:
            raise InputError(f"segment starts {outside} lie outside the prompt's {len(self.prompt_ids)} tokens")


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` (token id, log-probability) pairs, best first."""

    token: int
    logprob: float
    top: TokenTop


@dataclass(frozen=True)
class DraftRound:
    """One verify round of a row, as the runner saw it: ``proposed`` draft tokens, ``accepted`` of them taken, and
    whether a differing proposal ended it (``rejected``; not when the row's budget or an end token did)."""

    proposed: int
    accepted: int
    rejected: bool


@dataclass(frozen=True)
class RowOutput:
    """What the runner sampled for one row in one forward: ``tokens`` in order (one, or with a draft the accepted
    ones and the row's own next choice), their log-probabilities when the row asked for them (else empty), the
    ``time.perf_counter()`` at which they existed, and the verify round (None without one). The scheduler appends
    them and decides whether the row stops (:meth:`~kvboost_hf.scheduling.Scheduler.update_from_output`); tokens
    after the one that ends the row are dropped."""

    row: DecodeRow
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    at: float = 0.0
    draft: DraftRound | None = None


@dataclass(eq=False)
class DecodeRow:
    """Decoding state of one row: its tokens, text, log-probabilities and finish reason. The runner reads it and
    chooses the row's tokens (:meth:`choose`); the scheduler appends them (:meth:`append`) and ends the row
    (:meth:`finish`).

    ``text`` is what may be shown so far: cut before a stop string, and while running without a tail that could
    still become one (see :func:`~kvboost_hf.hf.detokenize.visible_text`); once finished, the whole decoded text
    unless a stop string cut it. It is decoded incrementally (:class:`~kvboost_hf.hf.detokenize.IncrementalText`:
    a few tokens per token, whatever the answer's length). ``reuse`` is what the prefill loaded for this row (for
    the row that computed a shared prefix for its group, ``reuse.cached_tokens`` excludes that prefix). Times are
    ``time.perf_counter()`` values. Speculative counters: ``draft_proposed`` draft tokens proposed for this row,
    ``draft_accepted`` of them equal to the row's own choice (and taken), ``draft_rejected`` verify rounds that
    ended on a differing proposal; ``draft_rounds`` holds, per verify round of this row, ``(draft tokens accepted,
    whether a differing proposal ended it)`` (see :func:`~kvboost_hf.hf.speculative.acceptance_by_depth`).

    Preemption (the scheduler's, to free K/V memory): the row leaves its batch unfinished, its chunks stored, and
    is prefilled again later from its :attr:`context_ids` (prompt and tokens so far), with the same generator and
    processors, so it goes on with the tokens it would have taken. ``preemptions`` counts them;
    ``resumed_cached_tokens`` the context tokens those prefills loaded from the store (``reuse`` stays the first
    prefill's).
    """

    request: DecodeRequest
    seed: int
    eos_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    reuse: RowReuse = field(default_factory=RowReuse)
    first_token_time: float | None = None
    last_token_time: float | None = None
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_rejected: int = 0
    draft_rounds: list[tuple[int, bool]] = field(default_factory=list)
    preemptions: int = 0
    resumed_cached_tokens: int = 0
    restarted: bool = False  # prefilled again past a long-RoPE model's original length (the scheduler's rule 2d)

    def __post_init__(self) -> None:
        request = self.request
        self.generator = torch.Generator().manual_seed(self.seed)
        constraints = [request.constraint] if request.constraint is not None else []
        self.processors: LogitsProcessorList = build_processors(
            request.sampling, len(request.prompt_ids), self.eos_token_ids, constraints
        )
        self.end_ids = request.sampling.end_token_ids(self.eos_token_ids)
        self.reads_ids = reads_input_ids(self.processors)
        self._ids: torch.Tensor | None = None  # [1, prompt + max_new_tokens] on the device: the context processors read
        self._ids_written = 0  # its leading columns that hold the row's prompt and tokens
        self.detokenized = IncrementalText(request.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What a prefill of this row computes or loads: its prompt, then the tokens it took before it was
        preempted (none before its first prefill)."""
        return (*self.request.prompt_ids, *self.tokens)

    @property
    def context_length(self) -> int:
        """``len(context_ids)``, without building them."""
        return len(self.request.prompt_ids) + len(self.tokens)

    @property
    def prefill_setting(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(context ids, segment starts)``: rows with equal settings are prefilled once (the ``n`` choices of a
        request) in one cache."""
        return self.context_ids, tuple(self.request.segment_starts)

    @property
    def speculates(self) -> bool:
        """Whether draft proposals are verified for this row (not with a stateful grammar constraint)."""
        return self.request.constraint is None

    @property
    def plain_greedy(self) -> bool:
        """Whether the row's choice is the argmax of its raw logits (greedy, no processor): chosen for all such
        rows at once on the device."""
        return self.request.sampling.greedy and not self.processors

    @property
    def tokens_left(self) -> int:
        """Tokens the row may still take (its budget less its tokens)."""
        return self.request.max_new_tokens - len(self.tokens)

    def processed(self, logits: torch.Tensor, taken: Sequence[int] = ()) -> torch.Tensor:
        """This row's raw logits ``[1, V]`` through its processors, after its tokens and ``taken``; its context goes
        to the device (without a wait) only for processors that read it (:attr:`reads_ids`)."""
        if not self.processors:
            return logits
        if self.reads_ids:
            input_ids = self._device_ids(logits.device, taken)
        else:
            input_ids = torch.empty((1, 0), dtype=torch.long, device=logits.device)
        return self.processors(input_ids, logits)

    def _device_ids(self, device: torch.device, taken: Sequence[int]) -> torch.Tensor:
        """``[1, L]`` on ``device``: the prompt, the tokens, then ``taken``, read from a buffer of the row's whole
        budget that only the tokens added since the last call (and ``taken``) travel to, without a wait: O(new
        tokens) host work per step, not O(context)."""
        prompt, context = self.request.prompt_ids, self.context_length
        end = context + len(taken)
        if self._ids is None or self._ids.device != device or self._ids.shape[1] < end:
            width = max(end, len(prompt) + self.request.max_new_tokens)
            self._ids = torch.empty((1, width), dtype=torch.long, device=device)
            self._ids_written = 0
        if self._ids_written < context:
            start = self._ids_written
            fresh = [*prompt[start:], *self.tokens[max(start - len(prompt), 0) :]]
            self._ids[:, start:context] = to_device([fresh], device)
            self._ids_written = context
        if taken:  # tokens chosen in this forward: past the written ones, overwritten by the row's own later
            self._ids[:, context:end] = to_device([list(taken)], device)
        return self._ids[:, :end]

    def draft_scores(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """Log-probabilities ``[V]`` of the next draft token from draft logits ``[1, V]`` after this row's tokens and
        ``drafted``: through the row's processors (the raw ones for a row that does not speculate: its processors
        keep state)."""
        if self.speculates:
            logits = self.processed(logits, drafted)
        return torch.log_softmax(logits[0].float(), dim=-1)

    def append(
        self, token: int, decode: Callable[[list[int]], str], logprob: TokenLogprob | None = None, at: float = 0.0
    ) -> None:
        """Append ``token`` (sampled at ``at``, a ``time.perf_counter()`` value; ``logprob`` when the row asked for
        log-probabilities) and update the text (``decode``: ids -> text; only recent tokens are decoded)."""
        self.first_token_time = self.first_token_time or at
        self.last_token_time = at
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        self.detokenized.update(self.tokens, decode)
        self.text = self.detokenized.visible(finished=False)

    @property
    def stop_string_found(self) -> bool:
        """Whether the text holds one of the row's stop strings."""
        return self.detokenized.stop_at is not None

    def finish(self, reason: str) -> None:
        """End the row with ``reason``; its text becomes final (cut before a stop string, else the whole text)."""
        self.finish_reason = reason
        self.text = self.detokenized.visible(finished=True)

    def record_round(self, draft: DraftRound, taken: int) -> None:
        """Count a verify round of which the row kept ``taken`` tokens (fewer than the runner's when it ended
        inside them: then no differing proposal ended the round)."""
        ended_inside = self.finished
        self.draft_proposed += draft.proposed
        accepted = min(draft.accepted, taken - 1)
        rejected = draft.rejected and not ended_inside
        self.draft_accepted += accepted
        self.draft_rejected += rejected
        self.draft_rounds.append((accepted, rejected))

    def cancel(self) -> None:
        """End the row now (shutdown); its text so far (a held-back tail stays unshown) is final."""
        if not self.finished:
            self.finish_reason = "cancelled"


def new_rows(requests: Sequence[DecodeRequest], eos_token_ids: set[int] | frozenset[int]) -> list[DecodeRow]:
    """One row per request, ending at ``eos_token_ids``; an unseeded request gets a seed from torch's global
    generator (so that ``torch.manual_seed`` before the call makes it repeatable)."""
    rows = []
    for request in requests:
        seed = request.sampling.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        rows.append(DecodeRow(request, seed, frozenset(eos_token_ids)))
    return rows


def sample(rows: Sequence[DecodeRow], logits: torch.Tensor) -> list[RowOutput]:
    """One token per row from the last positions' logits ``[B, V]`` (row ``i`` of the logits is ``rows[i]``'s):
    plain greedy rows take the argmax on the device, the others go through their processors and own choice
    (:meth:`DecodeRow.processed`, :func:`~kvboost_hf.hf.sampling.choose_tokens`: one wait for all of them); the ids
    and log-probabilities come to the host in one transfer (:class:`Sampled`)."""
    chosen = greedy_tokens(logits)
    if others := [i for i, row in enumerate(rows) if not row.plain_greedy]:
        scores = torch.cat([rows[i].processed(logits[i : i + 1]) for i in others])
        picks = choose_tokens(scores, [rows[i].request.sampling for i in others], [rows[i].generator for i in others])
        chosen = chosen.index_put((to_device(others, logits.device),), to_device(picks, logits.device))
    sampled = Sampled(rows, logits, chosen)
    return sampled.outputs(sampled.packed.tolist())


@dataclass(eq=False)
class Sampled:
    """The ``chosen`` ids ``[N]`` of ``rows`` (on the logits' device), and for each row that asked for
    log-probabilities its chosen token's and top ``k`` (at most ``V``) under the unscaled distribution of its
    logits ``[N, V]``: computed on the device into one flat float64 tensor (:attr:`packed`; ids < 2**53 are exact),
    so one transfer brings them to the host, whenever the caller reads it (then :meth:`outputs`)."""

    rows: Sequence[DecodeRow]
    logits: torch.Tensor
    chosen: torch.Tensor

    def __post_init__(self) -> None:
        rows, logits, chosen = self.rows, self.logits, self.chosen
        self.asks = [i for i, row in enumerate(rows) if row.request.top_logprobs is not None]
        self.top = min(max((rows[i].request.top_logprobs or 0 for i in self.asks), default=0), logits.shape[-1])
        parts = [chosen.double()]
        if self.asks:
            index = to_device(self.asks, logits.device)
            log_probs = torch.log_softmax((logits if len(self.asks) == len(rows) else logits[index]).float(), dim=-1)
            values, ids = log_probs.topk(self.top, dim=-1)
            parts += [log_probs.gather(1, chosen[index, None]).flatten(), values.flatten(), ids.flatten()]
        self.packed = torch.cat([part.double() for part in parts])

    def outputs(self, host: list[float]) -> list[RowOutput]:
        """Each row's :class:`RowOutput` from ``host``, :attr:`packed` read on the host (``packed.tolist()``, or a
        copy started earlier), timed now."""
        now = time.perf_counter()
        count, asks, top = len(self.rows), self.asks, self.top
        tokens = [int(token) for token in host[:count]]
        found: list[tuple[TokenLogprob, ...]] = [()] * count
        values_at, ids_at = count + len(asks), count + len(asks) * (1 + top)
        for slot, i in enumerate(asks):
            k = min(self.rows[i].request.top_logprobs or 0, top)
            pairs = tuple((int(host[ids_at + slot * top + j]), host[values_at + slot * top + j]) for j in range(k))
            found[i] = (TokenLogprob(tokens[i], host[count + slot], pairs),)
        return [
            RowOutput(row, (token,), logprob, now) for row, token, logprob in zip(self.rows, tokens, found, strict=True)
        ]
