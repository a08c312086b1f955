"""Stage 8: the model runner of the decode loop; :mod:`kvboost_hf.scheduling` decides what it runs.

One :class:`DecodeLoop` runs a batch of rows (prompts of any lengths and prefixes, each with its own settings) on
one model and one cache. It makes no scheduling decision: the scheduler hands it

* :class:`PrefillWork`: rows to prefill together in one fresh cache (built with the work's segment starts). Their
  prompts are left-padded into one forward (a :class:`~kvboost_hf.hf.cache.ChunkReuseCache` stitches stored chunks,
  called explicitly through :func:`~kvboost_hf.hf.prefill.forward`, and computes only the rest); the work's shared
  prefixes are computed once (batch of one) and stored first, so the batch prefill loads them for every row; a
  work whose rows are one prompt (the ``n`` choices of a request) is prefilled once and repeated. Each row gets its
  first token, then the rows are appended below the running ones (continuous batching).
* :meth:`DecodeLoop.step`: one forward for the rows still running. Each row's logits go through its own
  transformers ``LogitsProcessorList`` (:func:`~kvboost_hf.hf.sampling.build_processors`: bias, penalties,
  min_tokens, a grammar constraint, temperature, top-k/p, min-p), then the row picks its token with its own seeded
  generator (:func:`~kvboost_hf.hf.sampling.choose_token`; temperature 0 = argmax, taken for every plain greedy
  row at once on the device); log-probabilities are computed on the device, and the step's ids and
  log-probabilities reach the host in one transfer.

* speculative decode (with a :class:`~kvboost_hf.hf.speculative.Drafter`): the draft proposes ``g`` tokens per
  row, one target forward verifies all rows' proposals, and each row takes its own choices position by position
  while they equal the proposals (then one more), and no further than its budget or an end token. Rows accept
  different counts; each row's rejected columns are dropped and the rows right-aligned, so the layout stays
  left-padded. A row with a grammar constraint (whose state advances with every token it sees) takes one token
  per step. The prompt forward verifies the first tree too (the draft prefills the prompts and drafts before it),
  unless it is a sparse repair forward.

Both return the sampled tokens per row (:class:`RowOutput`) and decide nothing about them: the scheduler appends
them to the rows, decides which rows stop (end tokens, budget, stop strings on the incrementally decoded text,
cancellation) and calls :meth:`DecodeLoop.retire_finished`, which drops the ended rows from the batch.

Invariants: a row's positions and attention mask are exactly those ``generate()`` builds for a left-padded batch
(a dropped column is left padding), so with temperature 0 each row yields the tokens it yields alone, and a row
with a given seed draws the same tokens whatever else shares its batch, with or without a draft (the draft only
saves target forwards: every position's choice is made from the same logits with the same draws);
log-probabilities are under the model's unscaled distribution (natural log); completed chunks are written back
from the second decode step on (never inside the time to first token), and each row's chunks (its unfinished last
chunk included) are stored before it leaves the batch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache, DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from kvboost_hf.core.chunking import chunk_spans
from kvboost_hf.core.errors import InputError
from kvboost_hf.core.keys import chain_prefix_keys
from kvboost_hf.hf.cache import (
    ChunkReuseCache,
    join_caches,
    keep_cache_columns,
    prepend_zeros,
    select_columns,
)
from kvboost_hf.hf.detokenize import IncrementalText
from kvboost_hf.hf.graphs import GraphedDecoder, capacity_bucket
from kvboost_hf.hf.models import model_dtype
from kvboost_hf.hf.prefill import RowReuse, forward, forward_inputs, run_forward
from kvboost_hf.hf.sampling import SamplingConfig, build_processors, choose_token, greedy_tokens
from kvboost_hf.hf.speculative import Drafter, DraftTree, tree_attention_mask
from kvboost_hf.offload.streamer import layer_streamer

logger = logging.getLogger(__name__)

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

    @property
    def prefill_setting(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(prompt ids, segment starts)``: rows with equal settings are prefilled once (the ``n`` choices of a
        request) in one cache."""
        return tuple(self.prompt_ids), tuple(self.segment_starts)


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

    def __post_init__(self) -> None:
        request = self.request
        self.generator = torch.Generator().manual_seed(self.seed)
        constraints = [request.constraint] if request.constraint is not None else []
        self.processors: LogitsProcessorList = build_processors(
            request.sampling, len(request.prompt_ids), self.eos_token_ids, constraints
        )
        self.end_ids = request.sampling.end_token_ids(self.eos_token_ids)
        self.detokenized = IncrementalText(request.stop)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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

    def choose(self, logits: torch.Tensor, taken: Sequence[int] = ()) -> int:
        """The next token from this row's raw logits ``[1, V]`` after its tokens and ``taken`` (tokens chosen in
        this forward, not appended yet): its processors, then its own choice."""
        if self.processors:
            input_ids = torch.tensor([[*self.request.prompt_ids, *self.tokens, *taken]], device=logits.device)
            logits = self.processors(input_ids, logits)
        return choose_token(logits, self.request.sampling, self.generator)

    def draft_scores(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor:
        """Log-probabilities ``[V]`` of the next draft token from draft logits ``[1, V]`` after this row's tokens and
        ``drafted``: through the row's processors (the raw ones for a row that does not speculate: its processors
        keep state)."""
        if self.processors and self.speculates:
            input_ids = torch.tensor([[*self.request.prompt_ids, *self.tokens, *drafted]], device=logits.device)
            logits = self.processors(input_ids, logits)
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


@dataclass(frozen=True)
class SharedPrefix:
    """A chunk-aligned prefix (``tokens``) that several rows of one :class:`PrefillWork` start with: computed and
    stored once before their prefill (unless stored already), then loaded for each of them. Its computed tokens are
    counted for the work's row ``row`` (an index into :attr:`PrefillWork.rows`)."""

    tokens: tuple[int, ...]
    row: int


@dataclass(frozen=True)
class PrefillWork:
    """Rows that one prompt forward prefills in one fresh cache (built with ``segment_starts``): the scheduler's
    decision, the loop only runs it.

    ``repeat``: every row has one prompt (the ``n`` choices of a request): it is prefilled once and its K/V
    repeated, so a repair of non-prefix hits, which a cache makes for one row at a time, applies to every row.
    ``shared_prefixes``: prefixes to compute and store first (rows with different prompts only).

    Invariants (checked): at least one row; with ``repeat`` every row has the same prompt and there are no shared
    prefixes; each shared prefix is a prefix of its row's prompt.
    """

    rows: tuple[DecodeRow, ...]
    segment_starts: tuple[int, ...] = ()
    repeat: bool = False
    shared_prefixes: tuple[SharedPrefix, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows:
            raise InputError("a prefill work needs at least one row")
        if self.repeat and (self.shared_prefixes or len({row.request.prefill_setting[0] for row in self.rows}) > 1):
            raise InputError("repeat needs rows of one prompt and no shared prefixes")
        for prefix in self.shared_prefixes:
            if tuple(self.rows[prefix.row].request.prompt_ids[: len(prefix.tokens)]) != prefix.tokens:
                raise InputError(f"shared prefix of {len(prefix.tokens)} tokens is not row {prefix.row}'s prefix")


@dataclass
class _Batch:
    """What the loop holds for its running rows: their caches, 2D attention mask ``[B, C]`` and last positions
    ``[B]`` (row ``i`` of each is ``running[i]``)."""

    running: list[DecodeRow] = field(default_factory=list)
    cache: ChunkReuseCache | DynamicCache | None = None
    draft_cache: Cache | None = None
    mask: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0))


@dataclass
class _Prompt:
    """A prompt forward of one :class:`PrefillWork`: its prompts (one for a repeated prompt), left-padded
    (``input_ids``, ``position_ids`` ``[P, W]``), its cache's segment starts, the tokens its shared prefixes computed
    per row index; once chunked, the forward's inputs with stored chunks loaded (``inputs``), how many of their
    columns are computed, and the rows' state while other calls run (``state``)."""

    work: PrefillWork
    prompts: list[list[int]]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: tuple[int, ...]
    shared_computed: dict[int, int]
    inputs: dict[str, Any] = field(default_factory=dict)
    computed: int = 0
    state: _Batch = field(default_factory=_Batch)


class DecodeLoop:
    """Rows decoded together on one model and one cache, forward by forward (the scheduler's model runner).

    Args:
        model: the causal LM.
        new_cache: builds a fresh chunk-reuse cache (each call the same settings) for rows whose prompts have the
            given segment starts (``()``: none), or None for plain K/V.
        pad_token_id: the id used for left padding.
        draft: speculative decoding with this drafter (fresh, unused: the loop runs its prefills), or None.
        graphs: runs plain decode steps (no draft, a reuse cache with no context adjustment) as CUDA graphs where
            they fit (:class:`~kvboost_hf.hf.graphs.GraphedDecoder`, shared by the loops of one model so each shape
            is captured once): the cache turns static at a capacity bucket holding every row's remaining tokens
            (one K/V copy) and grows again when rows join. None: every step eager.

    ``rows`` holds every row added (in order), ``running`` those still decoding. ``forwards`` counts target model
    forwards (prefills and shared prefixes included; the draft's are ``draft.forwards``), ``verify_forwards`` those
    of them that verified draft tokens (one per speculative step, and a prompt forward that verified the first
    tree); ``streamed_bytes`` the bytes the target's layer streamer copied during this loop's prefills and steps (an
    early-exit draft's forwards on the target included; None when the target is not streamed);
    ``computed_tokens`` the prompt tokens computed (not loaded) for all rows. Call :meth:`add` with each
    :class:`PrefillWork`, and :meth:`step` while rows run: each returns the tokens it sampled per row
    (:class:`RowOutput`) and appends nothing; the caller appends them and ends rows, then calls
    :meth:`retire_finished` before the next call.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        new_cache: Callable[[tuple[int, ...]], ChunkReuseCache] | None,
        pad_token_id: int,
        draft: Drafter | None = None,
        graphs: GraphedDecoder | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.rows: list[DecodeRow] = []
        self.running: list[DecodeRow] = []
        self.new_cache = new_cache
        self.pad_token_id = pad_token_id
        self.draft = draft
        self.cache: ChunkReuseCache | DynamicCache | None = None
        self.mask = torch.empty(0)
        self.positions = torch.empty(0)
        self.forwards = 0
        self.verify_forwards = 0
        self.streamed_bytes: int | None = None if layer_streamer(model) is None else 0
        self.computed_tokens = 0
        self._prompts: list[_Prompt] = []  # chunked prompt forwards under way

    @staticmethod
    def rows_for(requests: Sequence[DecodeRequest], eos_token_ids: set[int] | frozenset[int]) -> list[DecodeRow]:
        """One row per request; an unseeded request gets a seed from torch's global generator (so that
        ``torch.manual_seed`` before the call makes it repeatable)."""
        rows = []
        for request in requests:
            seed = request.sampling.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)))
            rows.append(DecodeRow(request, seed, frozenset(eos_token_ids)))
        return rows

    @property
    def done(self) -> bool:
        """No row running and no prompt forward under way."""
        return not self.running and not self._prompts

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------------ forwards
    @contextlib.contextmanager
    def _counting_streamed_bytes(self) -> Iterator[None]:
        """Add to :attr:`streamed_bytes` what the target's layer streamer copies inside the block."""
        streamer = layer_streamer(self.model)
        if streamer is None:
            yield
            return
        before = streamer.stats(settle=False).bytes_streamed
        try:
            yield
        finally:
            copied = streamer.stats(settle=False).bytes_streamed - before
            self.streamed_bytes = (self.streamed_bytes or 0) + copied

    def add(self, work: PrefillWork, columns: int = 0) -> list[RowOutput]:
        """Prefill ``work``'s rows and return each one's first token (or tokens, when the prompt forward verified a
        draft tree); append the rows below the running rows: their K/V (the draft's too), attention masks and
        positions, the narrower side left-padded with masked columns, so the next :meth:`step` decodes old and new
        rows in one forward.

        ``columns`` > 0 (the scheduler's chunk of a token budget): a prompt forward wider than that (the
        left-padded prompts, before stored chunks are loaded) is computed in chunks of at most ``columns`` columns
        of what the store did not hold, one per call with the same ``work``; calls before the last return ``[]``
        and leave the running rows as they were (the work's rows are not running meanwhile). A chunked prompt
        forward verifies no draft tree (the draft prefills after the first tokens); a sparse repair forward is
        computed in one call. 0: the whole prompt forward in this call."""
        earlier = self._detach()
        with self._counting_streamed_bytes():
            outputs = self._prefill(work, columns)
        self._attach(earlier)
        return outputs

    def _detach(self) -> _Batch:
        """Take the running rows' state out of the loop (it is then empty)."""
        draft_cache = self.draft.cache if self.draft is not None else None
        earlier = _Batch(self.running, self.cache, draft_cache, self.mask, self.positions)
        self.running, self.cache, self.mask, self.positions = [], None, torch.empty(0), torch.empty(0)
        if self.draft is not None:
            self.draft.cache = None
        return earlier

    def _attach(self, earlier: _Batch) -> None:
        """Put ``earlier`` (from :meth:`_detach`) back, above the rows prefilled since."""
        if not earlier.running:
            return
        if not self.running:
            self.running, self.cache, self.mask, self.positions = (
                earlier.running, earlier.cache, earlier.mask, earlier.positions
            )  # fmt: skip
            if self.draft is not None:
                self.draft.cache = earlier.draft_cache
            return
        assert earlier.cache is not None, "running rows have a cache"
        if isinstance(earlier.cache, ChunkReuseCache):
            earlier.cache.set_max_cache_len(None)  # the joined rows may be wider than its capacity
        join_caches(earlier.cache, self._cache())
        if self.draft is not None:
            assert earlier.draft_cache is not None and self.draft.cache is not None, "running rows have a draft"
            join_caches(earlier.draft_cache, self.draft.cache)
            self.draft.cache = earlier.draft_cache
        width = max(earlier.mask.shape[1], self.mask.shape[1])
        self.mask = torch.cat([prepend_zeros(mask, width - mask.shape[1]) for mask in (earlier.mask, self.mask)])
        self.positions = torch.cat([earlier.positions, self.positions])
        self.cache, self.running = earlier.cache, earlier.running + self.running

    def _segment_starts(self, work: PrefillWork) -> tuple[int, ...]:
        """The segment starts the work's cache is built with (with reuse on every row must have them: a cache is
        built with one prompt's segment starts, which shape its chunks and keys)."""
        if self.new_cache is None:
            return ()
        if differing := [row for row in work.rows if tuple(row.request.segment_starts) != work.segment_starts]:
            raise InputError(
                f"{len(differing)} rows have segment starts other than the work's {work.segment_starts}: rows with "
                "different segment starts cannot be prefilled in one cache"
            )
        return work.segment_starts

    def _prefill(self, work: PrefillWork, columns: int) -> list[RowOutput]:
        """Begin or continue ``work``'s prompt forward in the (detached) loop; its rows' first tokens once it is
        complete, else ``[]`` (the work's state is then set aside until the next call)."""
        prompt = next((prompt for prompt in self._prompts if prompt.work is work), None)
        if prompt is None:
            prompt = self._begin_prefill(work)
            if not columns or prompt.input_ids.shape[1] <= columns:
                logits, trees = self._prompt_forward(list(work.rows), prompt.input_ids, prompt.position_ids,
                                                     prompt.starts)  # fmt: skip
                return self._first_tokens(prompt, logits, trees)
            prompt.inputs = forward_inputs(self.cache, input_ids=prompt.input_ids, attention_mask=self.mask,
                                           position_ids=prompt.position_ids, logits_to_keep=1)  # fmt: skip
        else:
            self._prompts.remove(prompt)
            self._attach(prompt.state)
        last = self._prompt_chunk(prompt, columns)
        if last is None:
            prompt.state = self._detach()
            self._prompts.append(prompt)
            return []
        return self._first_tokens(prompt, last, None)

    def _begin_prefill(self, work: PrefillWork) -> _Prompt:
        """Store the work's shared prefixes, then make its rows the loop's, in a fresh cache, with their left-padded
        prompts' mask; returns the prompt forward to run."""
        self.rows += work.rows
        rows = list(work.rows)
        prompts = [list(rows[0].request.prompt_ids)] if work.repeat else [list(r.request.prompt_ids) for r in rows]
        starts = self._segment_starts(work)
        shared_computed: dict[int, int] = {}
        if self.new_cache is not None:
            for prefix in work.shared_prefixes:
                if computed := self._store_prefix(list(prefix.tokens)):
                    shared_computed[prefix.row] = shared_computed.get(prefix.row, 0) + computed
        self.running = rows
        self.cache = self.new_cache(starts) if self.new_cache is not None else DynamicCache()
        input_ids, self.mask = left_pad(prompts, self.pad_token_id, self.device)
        position_ids = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        return _Prompt(work, prompts, input_ids, position_ids, starts, shared_computed)

    def _prompt_chunk(self, prompt: _Prompt, columns: int) -> torch.Tensor | None:
        """Compute the next ``columns`` columns of ``prompt``'s prepared forward (all of a sparse repair forward);
        the last prompt positions' logits ``[P, 1, V]`` once every column is computed, else None."""
        inputs = prompt.inputs
        width = inputs["input_ids"].shape[1]
        sparse = isinstance(self.cache, ChunkReuseCache) and self.cache.expects_sparse_forward
        stop = width if sparse else min(width, prompt.computed + columns)
        if not sparse:  # a dense suffix: its columns in order, each chunk seeing the columns before it
            cached = self.mask.shape[1] - width
            part = slice(prompt.computed, stop)
            inputs = {
                **inputs,
                "input_ids": inputs["input_ids"][:, part],
                "position_ids": inputs["position_ids"][:, part],
                "attention_mask": self.mask[:, : cached + stop],
            }
        out = run_forward(self.model, inputs)
        self.forwards += 1
        prompt.computed = stop
        return out.logits[:, -1:, :].float() if stop == width else None

    def _first_tokens(self, prompt: _Prompt, logits: torch.Tensor, trees: list[DraftTree] | None) -> list[RowOutput]:
        """The rows' first tokens from the complete prompt forward's logits ``[P, 1 + nodes, V]`` (``trees``: those
        it verified, or None): counts the computed tokens, repeats a repeated prompt, records each row's reuse."""
        work, prompts, shared_computed = prompt.work, prompt.prompts, prompt.shared_computed
        rows, input_ids, position_ids = list(work.rows), prompt.input_ids, prompt.position_ids
        repeats = len(rows) if work.repeat else 1
        assert self.cache is not None, "the prompt forward ran"
        reuse = self.cache.last_reuse if isinstance(self.cache, ChunkReuseCache) else []
        loaded = [reuse[index].cached_tokens if index < len(reuse) else 0 for index in range(len(prompts))]
        self.computed_tokens += sum(len(p) - n for p, n in zip(prompts, loaded, strict=True))
        self.computed_tokens += sum(shared_computed.values())
        if repeats > 1:
            self.cache.batch_repeat_interleave(repeats)
            if trees is not None and self.draft is not None and self.draft.cache is not None:
                self.draft.cache.batch_repeat_interleave(repeats)
                trees = [tree for tree in trees for _ in range(repeats)]
            input_ids, self.mask, position_ids, logits = (
                tensor.repeat_interleave(repeats, dim=0) for tensor in (input_ids, self.mask, position_ids, logits)
            )
            reuse, loaded = [copy.copy(entry) for entry in reuse * repeats], loaded * repeats
        self.positions = position_ids[:, -1]
        for index, row in enumerate(rows):
            if index < len(reuse):
                row.reuse = reuse[index]
                row.reuse.cached_tokens = max(0, loaded[index] - shared_computed.get(index, 0))
            if row.request.keep_first_logits:
                row.first_logits = logits[index, 0].cpu()
        if trees is not None and self.draft is not None:
            return self._verify_trees(self.draft, trees, logits, self.mask, self.positions)
        outputs = self._sample(logits[:, 0])
        if self.draft is not None:  # after the first tokens were sampled (their time is the TTFT)
            self.draft.prefill(input_ids, self.mask, position_ids, prompt.starts)
        return outputs

    def _prompt_forward(
        self,
        rows: list[DecodeRow],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_starts: tuple[int, ...],
    ) -> tuple[torch.Tensor, list[DraftTree] | None]:
        """The target's prompt forward (stored chunks loaded first). With a draft, a row that may take two tokens,
        and a dense forward (not a sparse repair forward, whose K/V are scattered to the prompt's own columns), the
        draft prefills the prompts first and proposes each row's first tree below its last prompt token, and this
        forward verifies it too: one target forward fewer per generation (the draft's prefill then counts in the
        time to first token). Returns the logits ``[B, 1 + nodes, V]`` (the last prompt token's, then each
        node's) and the trees (None when nothing was drafted: ``[B, 1, V]``). ``rows``: the prompts' rows (the
        first of a repeated prompt drafts for all); ``segment_starts``: theirs (the draft's cache is built with them
        too)."""
        inputs = forward_inputs(self.cache, input_ids=input_ids, attention_mask=self.mask,
                                position_ids=position_ids, logits_to_keep=1)  # fmt: skip
        draft, budget = self.draft, max(row.request.max_new_tokens for row in rows)
        sparse = isinstance(self.cache, ChunkReuseCache) and self.cache.expects_sparse_forward
        trees = None
        if draft is not None and budget > 1 and not sparse:
            sizes = draft.level_sizes(budget - 1, len(rows))
            first, roots = draft.prefill(input_ids, self.mask, position_ids, segment_starts), position_ids[:, -1]
            trees = draft.expand(first, self.mask, roots, sizes, lambda i, lg, d: rows[i].draft_scores(lg, d))
            inputs = self._with_tree_queries(inputs, trees, roots)
        out = run_forward(self.model, inputs)
        self.forwards += 1
        keep = inputs["logits_to_keep"]
        return out.logits[:, -keep:, :].float(), trees

    def _with_tree_queries(
        self, inputs: dict[str, Any], trees: list[DraftTree], root_positions: torch.Tensor
    ) -> dict[str, Any]:
        """Dense prompt forward inputs (a suffix of the prompt after the cached columns) with every row's tree
        nodes appended as queries: the suffix stays causal over the prompt's columns, each node sees the whole
        prompt and its ancestors, at position ``root_positions + depth``; logits are kept for the last prompt
        token and every node."""
        suffix = inputs["input_ids"]
        rows, length = suffix.shape
        nodes = len(trees[0].tokens)
        cached = self.mask.shape[1] - length
        valid = self.mask[:, cached:].bool().cpu()
        visible = torch.zeros(rows, length + nodes, length + nodes, dtype=torch.bool)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        visible[:, :length, :length] = causal & (valid[:, None, :] | torch.eye(length, dtype=torch.bool))
        visible[:, length:, :length] = valid[:, None, :]
        visible[:, length:, length:] = torch.stack([tree.sees() for tree in trees])
        depths = torch.tensor([tree.depths for tree in trees], device=self.device)
        positions = inputs["position_ids"]  # the suffix's (the prefill always passes positions)
        tokens = torch.tensor([tree.tokens for tree in trees], device=self.device)
        return {
            **inputs,
            "input_ids": torch.cat([suffix, tokens], dim=1),
            "position_ids": torch.cat([positions, root_positions[:, None] + depths], dim=1),
            "attention_mask": tree_attention_mask(self.mask[:, :cached], visible, model_dtype(self.model)),
            "logits_to_keep": 1 + nodes,
        }

    def step(self) -> list[RowOutput]:
        """One decode step for every running row (speculative with a draft: one or more tokens per row); returns
        each row's tokens, in the order of :attr:`running`."""
        with self._counting_streamed_bytes():
            return self._step()

    def _step(self) -> list[RowOutput]:
        # a draft only pays when a row can still take two tokens: with one left, its proposals could not be used
        if self.draft is not None and any(row.tokens_left > 1 for row in self.running):
            return self._speculative_step(self.draft)
        last_on_host = torch.tensor([[row.tokens[-1]] for row in self.running], dtype=torch.long)
        last = last_on_host.to(self.device, non_blocking=True)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.running), 1)], dim=1)
        self.positions = self.positions + 1
        if (capacity := self._graph_capacity()) is None:
            logits = self._forward(last, self.positions[:, None])
        else:
            logits = self._graphed_forward(capacity, last, last_on_host)
        self._save(tail=False)  # chunks completed so far (background writes; never inside the TTFT)
        return self._sample(logits)

    def _speculative_step(self, draft: Drafter) -> list[RowOutput]:
        """Draft a tree (a chain without a tree budget) per row, verify every row's tree in one target forward,
        take each row's own choices down the tree while a child holds them (plus one more), and keep only the
        accepted path's columns in both caches."""
        running = self.running
        budget = max(row.tokens_left for row in running)
        sizes = draft.level_sizes(budget - 1, len(running))
        last = torch.tensor([[row.tokens[-1]] for row in running], device=self.device)
        trees = draft.propose(last, self.mask, self.positions, sizes, lambda i, lg, d: running[i].draft_scores(lg, d))
        nodes = sum(sizes)
        fed = torch.tensor([[row.tokens[-1], *tree.tokens] for row, tree in zip(running, trees, strict=True)])
        visible = torch.zeros(len(running), nodes + 1, nodes + 1, dtype=torch.bool)
        visible[:, :, 0] = True  # every query sees the root
        for row, tree in enumerate(trees):
            visible[row, 1:, 1:] = tree.sees()
        depths = torch.tensor([[0, *tree.depths] for tree in trees], device=self.device)
        positions = self.positions[:, None] + 1 + depths
        mask = tree_attention_mask(self.mask, visible, model_dtype(self.model))
        started = time.perf_counter()
        logits = self._forward(fed.to(self.device), positions, keep=nodes + 1, attention_mask=mask)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # the forward's whole time, for the adaptive tree budget
        draft.costs.add(len(running) * (nodes + 1), time.perf_counter() - started)
        root_mask = torch.cat([self.mask, self.mask.new_ones(len(running), 1)], dim=1)
        outputs = self._verify_trees(draft, trees, logits, root_mask, self.positions + 1)
        self._save(tail=False)
        return outputs

    def _verify_trees(
        self,
        draft: Drafter,
        trees: list[DraftTree],
        logits: torch.Tensor,
        root_mask: torch.Tensor,
        root_positions: torch.Tensor,
    ) -> list[RowOutput]:
        """Each running row's tokens from a verify forward's logits ``[B, 1 + nodes, V]`` (its root's, then each
        node's); keeps only the accepted paths' columns in both caches. Layout before: ``root_mask`` ``[B, C]``
        covers the columns up to each row's root (the last; at ``root_positions`` ``[B]``), then the tree's nodes in
        both caches (the draft's: each tree's first ``fed`` nodes)."""
        greedy = greedy_tokens(logits).tolist()  # every plain greedy row's choices, in one transfer
        walks = [self._verify(row, logits[i], trees[i], greedy[i]) for i, row in enumerate(self.running)]
        now = time.perf_counter()
        kept = [path for path, _, _ in walks]
        self.verify_forwards += 1
        base = root_mask.shape[1]
        self._keep_path(draft, trees, kept, root_mask, root_positions)
        target_columns = [[*range(base), *(base + node for node in path)] for path in kept]
        keep_cache_columns(self._cache(), target_columns)
        nodes = len(trees[0].tokens)
        self.mask = select_columns(torch.cat([root_mask, root_mask.new_ones(len(trees), nodes)], dim=1),
                                   target_columns, dim=1)  # fmt: skip
        self.positions = root_positions + torch.tensor([len(path) for path in kept], device=self.device)
        logprobs = self._path_logprobs(logits, walks)
        return [
            RowOutput(row, tuple(tokens), found, now, draft)
            for row, (_, tokens, draft), found in zip(self.running, walks, logprobs, strict=True)
        ]

    def _path_logprobs(
        self, logits: torch.Tensor, walks: list[tuple[list[int], list[int], DraftRound | None]]
    ) -> list[tuple[TokenLogprob, ...]]:
        """Per running row, the log-probabilities of the tokens it took down its tree (:meth:`_verify`'s ``walks``;
        none for a row that asked for none), from the verify logits ``[B, 1 + nodes, V]`` of its root and each kept
        node, computed in one pass."""
        picks = [
            (i, column, token)
            for i, (path, tokens, _) in enumerate(walks)
            if self.running[i].request.top_logprobs is not None
            for column, token in zip([0, *(node + 1 for node in path)], tokens, strict=True)
        ]
        per_row: list[list[TokenLogprob]] = [[] for _ in walks]
        if picks:
            rows, columns, tokens = zip(*picks, strict=True)
            picked = logits[list(rows), list(columns)]
            _, found = sampled([self.running[i] for i in rows], picked, to_device(tokens, self.device))
            for i, entry in zip(rows, found, strict=True):
                if entry is not None:
                    per_row[i].append(entry)
        return [tuple(entries) for entries in per_row]

    def _keep_path(
        self,
        draft: Drafter,
        trees: list[DraftTree],
        kept: list[list[int]],
        root_mask: torch.Tensor,
        root_positions: torch.Tensor,
    ) -> None:
        """Reduce the draft's cache to each row's columns up to its root and its kept path, in the target cache's
        layout (see :meth:`_verify_trees`).

        The draft fed each tree's first ``fed`` nodes; a kept path that ends on a later node is fed to it now (one
        forward; rows without one feed a placeholder that is dropped)."""
        assert draft.cache is not None, "the draft's prefill ran"
        rows, base, inner = len(trees), root_mask.shape[1], trees[0].fed
        fed_paths = [[node for node in path if node < inner] for path in kept]
        columns = [[*range(base), *(base + node for node in path)] for path in fed_paths]
        keep_cache_columns(draft.cache, columns)
        width = max(len(c) for c in columns)
        mask = select_columns(torch.cat([root_mask, root_mask.new_ones(rows, inner)], dim=1), columns, dim=1)
        leaves = [path[-1] if path and path[-1] >= inner else None for path in kept]
        if all(leaf is None for leaf in leaves):
            return
        tokens = [
            [tree.tokens[leaf] if leaf is not None else self.pad_token_id]
            for tree, leaf in zip(trees, leaves, strict=True)
        ]
        depths = [[tree.depths[leaf] if leaf is not None else 1] for tree, leaf in zip(trees, leaves, strict=True)]
        positions = root_positions[:, None] + torch.tensor(depths, device=self.device)
        draft.forward(torch.tensor(tokens, device=self.device), torch.cat([mask, mask.new_ones(rows, 1)], dim=1),
                      positions)  # fmt: skip
        final = [[*range(width - len(c), width), *([width] if leaf is not None else [])]
                 for c, leaf in zip(columns, leaves, strict=True)]  # fmt: skip
        keep_cache_columns(draft.cache, final, base + max(len(path) for path in kept))

    def _verify(
        self, row: DecodeRow, logits: torch.Tensor, tree: DraftTree, greedy: list[int]
    ) -> tuple[list[int], list[int], DraftRound | None]:
        """Walk ``row`` down its tree with the verify forward's logits ``[1 + nodes, V]`` (the root's, then each
        node's; ``greedy``: their argmax, the choice of a plain greedy row): its own choice at the root, then at the
        child holding that choice, and so on until no child holds it, its budget is spent or it chose an end token
        (a row that does not speculate takes the root's choice only). Returns the tree nodes whose columns stay
        (every taken token's but the last: the accepted nodes), the taken tokens (one of the target's own plus the
        accepted ones) and the round (None for a row that does not speculate)."""
        path: list[int] = []
        tokens: list[int] = []
        node = -1
        while True:
            index = node + 1
            token = greedy[index] if row.plain_greedy else row.choose(logits[index : index + 1], tokens)
            tokens.append(token)
            limited = token in row.end_ids or len(tokens) >= row.tokens_left
            child = tree.child(node, token) if row.speculates and not limited else None
            if child is None:
                break
            path.append(child)
            node = child
        if not row.speculates:
            return path, tokens, None
        return path, tokens, DraftRound(len(tree.tokens), len(path), not limited and tree.has_children(node))

    def close(self) -> None:
        """Store what the caches computed (each row's unfinished last chunk included) and drop them."""
        self._save(tail=True)
        self.close_without_saving()

    def close_without_saving(self) -> None:
        """Drop the caches unsaved (after a failed forward they may be inconsistent)."""
        self.cache = None
        if self.draft is not None:
            self.draft.cache = None

    def _cache(self) -> ChunkReuseCache | DynamicCache:
        assert self.cache is not None, "the loop has a cache between prefill and close"
        return self.cache

    def _save(self, tail: bool) -> None:
        """Write back the chunks completed so far (target and draft caches; ``tail``: unfinished ones too)."""
        if isinstance(self.cache, ChunkReuseCache):
            self.cache.save(tail=tail)
        if self.draft is not None:
            self.draft.save(tail=tail)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: int = 1,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One target forward (``attention_mask`` default: the loop's 2D mask); the last ``keep`` positions'
        logits (fp32), ``[B, V]`` for ``keep == 1`` else ``[B, keep, V]``."""
        out = forward(
            self.model,
            self.cache,
            input_ids=input_ids,
            attention_mask=self.mask if attention_mask is None else attention_mask,
            position_ids=position_ids,
            logits_to_keep=keep,
        )
        self.forwards += 1
        logits = out.logits[:, -keep:, :].float()
        return logits[:, -1, :] if keep == 1 else logits

    def _graph_capacity(self) -> int | None:
        """The static capacity (tokens) for a graphed plain decode step, or None when the step runs eagerly (no
        graphs, a draft, a plain cache, a context adjustment, rows outside the buckets, a capacity above the cap)."""
        cache = self.cache
        if self.graphs is None or self.draft is not None or not isinstance(cache, ChunkReuseCache):
            return None
        if cache.attention_kwargs() or not self.graphs.config.enabled:
            return None
        if len(self.running) not in self.graphs.config.row_buckets:
            return None
        needed = cache.get_seq_length() + max(row.tokens_left for row in self.running)
        return capacity_bucket(needed, self.graphs.config)

    def _graphed_forward(self, capacity: int, last: torch.Tensor, last_on_host: torch.Tensor) -> torch.Tensor:
        """A plain decode step through the graphs (the cache made static first when it is not, or too small);
        recorded with the host's copy of the fed tokens, so no step waits on the device for them."""
        cache = self.cache
        assert isinstance(cache, ChunkReuseCache) and self.graphs is not None
        if cache.max_cache_len is None or cache.max_cache_len < cache.get_seq_length() + 1:
            cache.set_max_cache_len(capacity)
        cache.ensure_room(1)
        logits = self.graphs.step(cache, last, self.positions[:, None], self.mask)
        cache.record(last_on_host)
        self.forwards += 1
        return logits.float()

    def _store_prefix(self, prefix: list[int]) -> int:
        """Compute and store the chunk-aligned ``prefix`` (one forward, batch of one) unless all its chunks are
        stored; returns the tokens computed here."""
        assert self.new_cache is not None, "prefixes are stored only with reuse on"
        cache = self.new_cache(())
        keys = chain_prefix_keys(cache.namespace, prefix, chunk_spans(prefix, cache.chunking))
        if all(cache.store.contains_many(keys)):  # one Redis round trip for all of them
            return 0
        forward(self.model, cache, input_ids=torch.tensor([prefix], device=self.device), logits_to_keep=1)
        self.forwards += 1
        cache.save(tail=False)
        loaded = cache.last_reuse[0].cached_tokens if cache.last_reuse else 0
        logger.debug("stored a shared prefix of %d tokens", len(prefix))
        return len(prefix) - loaded

    # ------------------------------------------------------------------ tokens and rows
    def _sample(self, logits: torch.Tensor) -> list[RowOutput]:
        """One token per running row from the last positions' logits ``[B, V]``: plain greedy rows take the argmax
        on the device, the others go through their processors and own choice; the ids and log-probabilities come
        to the host in one transfer."""
        rows = self.running
        chosen = greedy_tokens(logits)
        if others := [i for i, row in enumerate(rows) if not row.plain_greedy]:
            picks = [rows[i].choose(logits[i : i + 1]) for i in others]
            chosen = chosen.index_put((to_device(others, logits.device),), to_device(picks, logits.device))
        tokens, logprobs = sampled(rows, logits, chosen)
        now = time.perf_counter()
        return [
            RowOutput(row, (token,), () if logprob is None else (logprob,), now)
            for row, token, logprob in zip(rows, tokens, logprobs, strict=True)
        ]

    def retire_finished(self) -> None:
        """Drop the rows that ended (:attr:`DecodeRow.finished`, decided by the caller) from the batch; their chunks
        (unfinished last chunks included) are stored first. A chunked prompt forward whose rows all ended (e.g.
        cancelled) is dropped, the chunks it completed stored."""
        for prompt in [prompt for prompt in self._prompts if all(row.finished for row in prompt.work.rows)]:
            self._prompts.remove(prompt)
            if isinstance(prompt.state.cache, ChunkReuseCache):
                prompt.state.cache.save(tail=False)
        keep = [i for i, row in enumerate(self.running) if not row.finished]
        if len(keep) == len(self.running):
            return
        self._save(tail=True)  # store the leaving rows' chunks (and unfinished last chunks) first
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.close()
            return
        index = torch.tensor(keep, device=self.device)
        self._cache().batch_select_indices(index)
        if self.draft is not None and self.draft.cache is not None:
            self.draft.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]

    def abandon(self) -> None:
        """Drop every running row, every prompt forward under way and the caches unsaved (after a failed forward
        they may be inconsistent)."""
        self.running, self._prompts = [], []
        self.close_without_saving()


def sampled(
    rows: Sequence[DecodeRow], logits: torch.Tensor, chosen: torch.Tensor
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The ``chosen`` ids ``[N]`` (on the logits' device) as ints, and for each row that asked for
    log-probabilities its chosen token's and top ``k`` under the unscaled distribution of its logits ``[N, V]``
    (None for the others): computed on the device, brought to the host in one transfer."""
    asks = [i for i, row in enumerate(rows) if row.request.top_logprobs is not None]
    parts = [chosen.double()]
    top = max((rows[i].request.top_logprobs or 0 for i in asks), default=0)
    if asks:
        index = to_device(asks, logits.device)
        log_probs = torch.log_softmax((logits if len(asks) == len(rows) else logits[index]).float(), dim=-1)
        values, ids = log_probs.topk(top, dim=-1)
        parts += [log_probs.gather(1, chosen[index, None]).flatten(), values.flatten(), ids.flatten()]
    host = torch.cat([part.double() for part in parts]).tolist()  # ids < 2**53: exact in float64
    count = len(rows)
    tokens = [int(token) for token in host[:count]]
    found: list[TokenLogprob | None] = [None] * count
    values_at, ids_at = count + len(asks), count + len(asks) * (1 + top)
    for slot, i in enumerate(asks):
        k = rows[i].request.top_logprobs or 0
        pairs = tuple((int(host[ids_at + slot * top + j]), host[values_at + slot * top + j]) for j in range(k))
        found[i] = TokenLogprob(tokens[i], host[count + slot], pairs)
    return tokens, found


def to_device(values: Sequence[Any], device: torch.device) -> torch.Tensor:
    """``values`` (ints, nested lists) as a long tensor on ``device``, copied without a host synchronisation."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a left-padded batch on ``device``."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids.to(device), mask.to(device)
