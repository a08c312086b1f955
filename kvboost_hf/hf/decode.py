"""Stage 8: one batch's decode loop; :mod:`kvboost_hf.scheduling` decides what it runs, and
:class:`~kvboost_hf.runner.ModelRunner` (one loop per running batch) hands it over.

One :class:`DecodeLoop` runs a batch of rows (prompts of any lengths and prefixes, each with its own settings) on
one model and one cache. It makes no scheduling decision: the scheduler's output gives it

* :class:`PrefillWork`: rows to prefill together in one fresh cache (built with the work's segment starts). Their
  prompts are left-padded into one forward (a :class:`~kvboost_hf.hf.cache.ChunkReuseCache` stitches stored chunks,
  called explicitly through :func:`~kvboost_hf.hf.prefill.forward`, and computes only the rest); the work's shared
  prefixes (those the scheduler found missing from the store) are computed once (batch of one) and stored first,
  so the batch prefill loads them for every row; a
  work whose rows are one prompt (the ``n`` choices of a request) is prefilled once and repeated. Each row gets its
  first token, then the rows are appended below the running ones (continuous batching).
* :meth:`DecodeLoop.step`: one forward for the rows still running. Each row's logits go through its own
  transformers ``LogitsProcessorList`` (:func:`~kvboost_hf.hf.sampling.build_processors`: bias, penalties,
  min_tokens, a grammar constraint, temperature, top-k/p, min-p), then the row picks its token with its own seeded
  generator (:func:`~kvboost_hf.hf.sampling.choose_token`; temperature 0 = argmax, taken for every plain greedy
  row at once on the device); log-probabilities are computed on the device, and the step's ids and
  log-probabilities reach the host in one transfer.

* speculative decode (with a :class:`~kvboost_hf.hf.speculative.Drafter`, which decides when and how large its
  trees are, :meth:`~kvboost_hf.hf.speculative.Drafter.tree_sizes`; verified by a
  :class:`~kvboost_hf.hf.verify.TreeVerifier`): the draft proposes ``g`` tokens per row, one target forward
  verifies all rows' proposals, and each row takes its own choices position by position while they equal the
  proposals (then one more), and no further than its budget or an end token. Rows accept different counts; each
  row's rejected columns are dropped and the rows right-aligned, so the layout stays left-padded. A row with a
  grammar constraint (whose state advances with every token it sees) takes one token per step. The prompt forward
  verifies the first tree too (the draft prefills the prompts and drafts before it), unless it is a sparse repair
  forward.

* a shared forward (what :meth:`~kvboost_hf.runner.ModelRunner.run_steps` runs): every batch's decode step and
  the next chunks of its prompt forwards under way as parts of one forward (:mod:`kvboost_hf.hf.packed`;
  :meth:`DecodeLoop.pack` and :meth:`DecodeLoop.unpack`), so the weights are read once per scheduler step, not
  once per batch and chunk.

All return the sampled tokens per row (:class:`RowOutput`) and decide nothing about them: the scheduler appends
them to the rows and decides which rows stop (end tokens, budget, stop strings on the incrementally decoded text,
cancellation); :meth:`DecodeLoop.retire_finished` then drops the ended rows from the batch. The loop reads no
store (stitching stored chunks is the cache's), and whether a forward runs through compiled graphs or
eagerly is its :class:`~kvboost_hf.hf.forward_routes.ForwardRouter`'s.

Invariants: a row's positions and attention mask are exactly those ``generate()`` builds for a left-padded batch
(a dropped column is left padding), so with temperature 0 each row yields the tokens it yields alone, and a row
with a given seed draws the same tokens whatever else shares its batch, with or without a draft (the draft only
saves target forwards: every position's choice is made from the same logits with the same draws);
log-probabilities are under the model's unscaled distribution (natural log); completed chunks are written back
from the second decode step on (never inside the time to first token), and each row's chunks (its unfinished last
chunk included) are stored before it leaves the batch.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvboost_hf.core.errors import InputError
from kvboost_hf.hf.cache import ChunkReuseCache, join_caches, keep_cache_columns, prepend_zeros
from kvboost_hf.hf.forward_routes import ForwardRouter
from kvboost_hf.hf.graphs import GraphedDecoder
from kvboost_hf.hf.models import model_dtype
from kvboost_hf.hf.packed import ForwardPart
from kvboost_hf.hf.prefill import forward_inputs
from kvboost_hf.hf.rows import DecodeRequest as DecodeRequest  # the rows' types, importable from here as before
from kvboost_hf.hf.rows import DecodeRow, RowOutput, Sampled, new_rows, sample
from kvboost_hf.hf.rows import DraftRound as DraftRound
from kvboost_hf.hf.rows import TokenLogprob as TokenLogprob
from kvboost_hf.hf.sampling import greedy_tokens
from kvboost_hf.hf.speculative import Drafter, DraftTree
from kvboost_hf.hf.transfer import to_device, to_host_later
from kvboost_hf.hf.verify import TreeVerifier, Verified
from kvboost_hf.hf.verify_graphs import GraphedVerifier
from kvboost_hf.offload.streamer import layer_streamer
from kvboost_hf.reuse.rope import exact_reuse_length

logger = logging.getLogger(__name__)

TRIM_MIN_COLUMNS = 64
"""Fewest all-padding leading columns (tokens) a batch drops when rows leave it (see :func:`trim_padding`)."""


@dataclass(frozen=True)
class SharedPrefix:
    """A chunk-aligned prefix (``tokens``) that several rows start with and the store does not hold (the scheduler's
    finding): computed and stored once before one work's prefill, then loaded for each row starting with it. Its
    computed tokens are counted for the work's row ``row`` (an index into :attr:`PrefillWork.rows`)."""

    tokens: tuple[int, ...]
    row: int


@dataclass(frozen=True)
class PrefillWork:
    """Rows that one prompt forward prefills in one fresh cache (built with ``segment_starts``): the scheduler's
    decision, the loop only runs it.

    ``repeat``: every row has one prompt (the ``n`` choices of a request): it is prefilled once and its K/V
    repeated, so a repair of non-prefix hits, which a cache makes for one row at a time, applies to every row.
    ``shared_prefixes``: prefixes to compute and store before the prompt forward (shared by rows with different
    prompts, of this work or of later works of one schedule, which load them); the runner computes each one it is
    given without asking the store (the scheduler gave it only those the store lacked, each to one work).

    Invariants (checked): at least one row; with ``repeat`` every row has the same prompt; each shared prefix is a
    prefix of its row's prompt.
    """

    rows: tuple[DecodeRow, ...]
    segment_starts: tuple[int, ...] = ()
    repeat: bool = False
    shared_prefixes: tuple[SharedPrefix, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows:
            raise InputError("a prefill work needs at least one row")
        if self.repeat and len({row.prefill_setting[0] for row in self.rows}) > 1:
            raise InputError("repeat needs rows of one prompt")
        for prefix in self.shared_prefixes:
            if self.rows[prefix.row].context_ids[: len(prefix.tokens)] != prefix.tokens:
                raise InputError(f"shared prefix of {len(prefix.tokens)} tokens is not row {prefix.row}'s prefix")

    def cache_segment_starts(self, reuse: bool) -> tuple[int, ...]:
        """The segment starts the work's cache is built with (none without ``reuse``: plain K/V). With reuse every
        row must have them (a cache is built with one prompt's segment starts, which shape its chunks and keys):
        raises :class:`~kvboost_hf.core.errors.InputError` otherwise."""
        if not reuse:
            return ()
        if differing := [row for row in self.rows if tuple(row.request.segment_starts) != self.segment_starts]:
            raise InputError(
                f"{len(differing)} rows have segment starts other than the work's {self.segment_starts}: rows with "
                "different segment starts cannot be prefilled in one cache"
            )
        return self.segment_starts


@dataclass
class _RunningRows:
    """The running rows' state taken out of a loop while it prefills new rows: their caches, 2D attention mask
    ``[B, C]`` and last positions ``[B]`` (row ``i`` of each is ``running[i]``)."""

    running: list[DecodeRow] = field(default_factory=list)
    cache: ChunkReuseCache | DynamicCache | None = None
    draft_cache: Cache | None = None
    mask: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @classmethod
    def detach(cls, loop: DecodeLoop) -> _RunningRows:
        """Take ``loop``'s running rows' state out of it (it is then empty)."""
        draft_cache = loop.draft.cache if loop.draft is not None else None
        earlier = cls(loop.running, loop.cache, draft_cache, loop.mask, loop.positions)
        loop.running, loop.cache, loop.mask, loop.positions = [], None, torch.empty(0), torch.empty(0)
        if loop.draft is not None:
            loop.draft.cache = None
        return earlier

    def attach(self, loop: DecodeLoop) -> None:
        """Put this state (from :meth:`detach`) back into ``loop``, above the rows it prefilled since: K/V (the
        draft's too), masks and positions joined, the narrower side left-padded with masked columns."""
        if not self.running:
            return
        if not loop.running:
            loop.running, loop.cache, loop.mask, loop.positions = self.running, self.cache, self.mask, self.positions
            if loop.draft is not None:
                loop.draft.cache = self.draft_cache
            return
        assert self.cache is not None and loop.cache is not None, "running rows have a cache"
        if isinstance(self.cache, ChunkReuseCache):
            self.cache.set_max_cache_len(None)  # the joined rows may be wider than its capacity
        join_caches(self.cache, loop.cache)
        if loop.draft is not None:
            assert self.draft_cache is not None and loop.draft.cache is not None, "running rows have a draft"
            join_caches(self.draft_cache, loop.draft.cache)
            loop.draft.cache = self.draft_cache
        width = max(self.mask.shape[1], loop.mask.shape[1])
        loop.mask = torch.cat([prepend_zeros(mask, width - mask.shape[1]) for mask in (self.mask, loop.mask)])
        loop.positions = torch.cat([self.positions, loop.positions])
        loop.cache, loop.running = self.cache, self.running + loop.running


def _counting_streamed_bytes(method: Callable[..., list[RowOutput]]) -> Callable[..., list[RowOutput]]:
    """``method`` of a :class:`DecodeLoop`, adding to its :attr:`~DecodeLoop.streamed_bytes` what the target's layer
    streamer copies while it runs."""

    @functools.wraps(method)
    def counted(loop: DecodeLoop, *args: Any, **kwargs: Any) -> list[RowOutput]:
        streamer = layer_streamer(loop.model)
        if streamer is None:
            return method(loop, *args, **kwargs)
        before = streamer.stats(settle=False).bytes_streamed
        try:
            return method(loop, *args, **kwargs)
        finally:
            copied = streamer.stats(settle=False).bytes_streamed - before
            loop.streamed_bytes = (loop.streamed_bytes or 0) + copied

    return counted


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
    state: _RunningRows = field(default_factory=_RunningRows)

    def next_chunk(self, cache: Any, mask: torch.Tensor, columns: int) -> ForwardPart | None:
        """The next ``columns`` columns (0: all the rest) of the prepared dense forward (:attr:`inputs`) through
        ``cache`` under the prompts' whole 2D ``mask`` ``[P, C]``, as one part of a forward (last-position logits
        asked only of the last chunk); None for a sparse repair forward, which one forward of :attr:`inputs`
        computes whole."""
        if isinstance(cache, ChunkReuseCache) and cache.expects_sparse_forward:
            return None
        width = self.inputs["input_ids"].shape[1]
        stop = min(width, self.computed + columns) if columns else width
        part = slice(self.computed, stop)
        ids, positions = self.inputs["input_ids"][:, part], self.inputs["position_ids"][:, part]
        return ForwardPart(cache, ids, positions, mask[:, : mask.shape[1] - width + stop], logits=stop == width)


@dataclass
class PackedStep:
    """One batch's share of a packed forward (:meth:`DecodeLoop.pack`): its parts, in order (its decode step first
    when ``decode``, then one chunk per prompt forward under way in ``prompts``), and the prefills it runs apart
    after the forward (``apart``: ``(work, columns)``, sparse repair forwards)."""

    decode: bool
    parts: list[ForwardPart] = field(default_factory=list)
    prompts: list[_Prompt] = field(default_factory=list)
    apart: list[tuple[PrefillWork, int]] = field(default_factory=list)


@dataclass(eq=False)
class _Ahead:
    """A plain decode step launched before the host read the tokens it feeds (:attr:`DecodeLoop.look_ahead`):
    ``rows`` fed ``fed`` (recorded in the cache once read), under ``mask`` at ``positions``, ``logits`` ``[B, V]``
    still being computed. The next :meth:`DecodeLoop.step` takes it while the same rows run, each last token the one
    it was fed; else it is cut off first (:meth:`DecodeLoop._drop_ahead`)."""

    rows: list[DecodeRow]
    fed: list[int]
    logits: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    def continues(self, running: Sequence[DecodeRow]) -> bool:
        """Whether ``running`` are its rows, in order, each still running with the token it was fed last."""
        return len(running) == len(self.rows) and all(
            row is mine and not row.finished and row.tokens and row.tokens[-1] == token
            for row, mine, token in zip(running, self.rows, self.fed, strict=True)
        )


class DecodeLoop:
    """Rows decoded together on one model and one cache, forward by forward (one batch of
    :class:`~kvboost_hf.runner.ModelRunner`).

    Args:
        model: the causal LM.
        new_cache: builds a fresh chunk-reuse cache (each call the same settings) for rows whose prompts have the
            given segment starts (``()``: none), or None for plain K/V.
        pad_token_id: the id used for left padding.
        draft: speculative decoding with this drafter (fresh, unused: the loop runs its prefills), or None. The drafter
            decides which forwards verify trees and how large (:meth:`~kvboost_hf.hf.speculative.Drafter.tree_sizes`);
            :attr:`verifier` (:class:`~kvboost_hf.hf.verify.TreeVerifier`) verifies them.
        graphs, verify_graphs: the compiled graphs that plain decode steps and prompt forwards over reused K/V
            (:class:`~kvboost_hf.hf.graphs.GraphedDecoder`), and speculative verify forwards
            (:class:`~kvboost_hf.hf.verify_graphs.GraphedVerifier`) run through where they fit; None: eager.
            :attr:`router` (:class:`~kvboost_hf.hf.forward_routes.ForwardRouter`) decides each forward's way and
            runs it; a static cache grows again when rows join (the join makes it growable first), and a graphed
            prompt forward runs in the call of a chunked prefill whose columns hold the whole uncached tail.
        look_ahead: a graphed plain step whose rows all choose greedily without processors launches the next step
            on its argmax before reading its tokens (their copy to the host waits for that copy only), so on a
            device that runs asynchronously (CUDA) the host's work on this step's tokens (the scheduler's appends,
            detokenization, stop checks) overlaps the device's next step. The next :meth:`step` takes that step
            when the same rows still run; rows leaving or joining first cut its column off, so tokens, K/V and what
            is stored are those without it (a step of device work lost).

    ``rows`` holds every row added (in order) and not preempted since, ``running`` those still decoding.
    :attr:`forwards` counts target model forwards (prefills and shared prefixes included; the draft's are
    ``draft.forwards``), ``verify_forwards`` those of them that verified draft tokens (one per speculative step, and
    a prompt forward that verified the first tree); ``streamed_bytes`` the bytes the target's layer streamer copied
    during this loop's prefills and steps (an early-exit draft's forwards on the target included; None when the
    target is not streamed); ``computed_tokens`` the prompt tokens computed (not loaded) for all rows. Call
    :meth:`add` with each :class:`PrefillWork`, and :meth:`step` while rows run: each returns the tokens it sampled
    per row (:class:`RowOutput`) and appends nothing; the caller appends them and ends rows, then calls
    :meth:`retire_finished` before the next call. :meth:`pack` and :meth:`unpack` run a step's decode and prompt
    chunks as parts of one forward shared with other batches (:meth:`~kvboost_hf.runner.ModelRunner.run_steps`).
    :meth:`preempt` takes rows out unfinished, their chunks stored.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        new_cache: Callable[[tuple[int, ...]], ChunkReuseCache] | None,
        pad_token_id: int,
        draft: Drafter | None = None,
        graphs: GraphedDecoder | None = None,
        verify_graphs: GraphedVerifier | None = None,
        look_ahead: bool = False,
    ) -> None:
        self.model = model
        self.router = ForwardRouter(model, graphs, verify_graphs, speculative=draft is not None)
        self.look_ahead = look_ahead and draft is None
        self.steps_ahead = 0  # steps launched ahead
        self.steps_ahead_dropped = 0  # of those, cut off unused
        self._ahead: _Ahead | None = None
        self.rows: list[DecodeRow] = []
        self.running: list[DecodeRow] = []
        self.new_cache = new_cache
        self.pad_token_id = pad_token_id
        self.draft = draft
        self.verifier = (
            None
            if draft is None
            else TreeVerifier(draft, pad_token_id, model_dtype(model), position_limit=exact_reuse_length(model))
        )
        self.device = model.device
        self.cache: ChunkReuseCache | DynamicCache | None = None
        self.mask = torch.empty(0)
        self.positions = torch.empty(0)
        self.verify_forwards = 0
        self.streamed_bytes: int | None = None if layer_streamer(model) is None else 0
        self.computed_tokens = 0
        self._prompts: list[_Prompt] = []  # chunked prompt forwards under way

    rows_for = staticmethod(new_rows)  # the rows of requests (:func:`~kvboost_hf.hf.rows.new_rows`)

    @property
    def done(self) -> bool:
        """No row running and no prompt forward under way."""
        return not self.running and not self._prompts

    @property
    def columns(self) -> int:
        """Columns of K/V each running row holds (0 with none running) as the K/V projection counts them: the
        left-padded batch's width; with a static cache (graphed decoding), at least its capacity less the most
        tokens a row may still take, so the projection (width + tokens left, rounded up to a capacity bucket)
        covers the capacity without counting the rows' tokens twice (a row's capacity already holds them). Prompt
        forwards under way hold at most their prompts' widths besides (see :mod:`kvboost_hf.kv_budget`)."""
        if not self.running:
            return 0
        capacity = getattr(self.cache, "max_cache_len", None) or 0
        return max(self.mask.shape[1], capacity - max(row.tokens_left for row in self.running))

    @property
    def forwards(self) -> int:
        """Target model forwards that carried this runner's work so far (:attr:`ForwardRouter.forwards
        <kvboost_hf.hf.forward_routes.ForwardRouter.forwards>`): a packed forward shared with other batches counts
        in each of them."""
        return self.router.forwards

    # ------------------------------------------------------------------ forwards
    def pack(self, decode: bool, prefills: Sequence[tuple[PrefillWork, int]]) -> PackedStep | None:
        """This batch's share of a forward packed with other batches'
        (:meth:`~kvboost_hf.runner.ModelRunner.run_steps`): its decode step when ``decode``, and the next chunk of
        each of ``prefills`` (``(work, columns)``; a sparse repair forward runs after it, apart: :meth:`add`). None
        (the whole step runs apart) when this runner's forwards cannot be packed (a draft, graphs, a streamed target,
        an attention other than ``"kvboost"``: :meth:`ForwardRouter.packs
        <kvboost_hf.hf.forward_routes.ForwardRouter.packs>`). It begins the prefills not begun yet (their shared
        prefixes computed and stored, their stored chunks loaded: what :meth:`add` does first) and sets them aside,
        so their first chunk is a part too; :meth:`unpack` takes the step once the forward ran (a prefill set aside
        and not packed goes on in :meth:`add`)."""
        if self.verifier is not None or not self.router.packs():
            return None
        self._drop_ahead()
        step = PackedStep(decode and bool(self.running))
        for work, columns in prefills:
            prompt = next((prompt for prompt in self._prompts if prompt.work is work), None)
            if prompt is None:
                earlier = _RunningRows.detach(self)
                prompt = self._begin_prefill(work, columns)
                prompt.state = _RunningRows.detach(self)
                self._prompts.append(prompt)
                earlier.attach(self)
            chunk = prompt.next_chunk(prompt.state.cache, prompt.state.mask, columns)
            if chunk is None:
                step.apart.append((work, columns))
            else:
                step.parts.append(chunk)
                step.prompts.append(prompt)
        if step.decode:
            mask = torch.cat([self.mask, self.mask.new_ones(len(self.running), 1)], dim=1)
            last = to_device([[row.tokens[-1]] for row in self.running], self.device)
            step.parts.insert(0, ForwardPart(self.cache, last, self.positions[:, None] + 1, mask, logits=True))
        return step

    def unpack(
        self, step: PackedStep, logits: Sequence[torch.Tensor | None]
    ) -> tuple[list[RowOutput], list[PrefillWork]]:
        """Take ``step`` (from :meth:`pack`) once one forward computed its parts (``logits``: each part's, in
        order; that forward counts as one of this runner's), then run its prefills apart. Returns the tokens sampled
        (the decode step's, then each completed prefill's first tokens) and the works whose prefill completed; the
        completed prefills' rows join below the running ones, as :meth:`add` leaves them."""
        self.router.forwards += bool(step.parts)
        outputs: list[RowOutput] = []
        completed: list[PrefillWork] = []
        if step.decode:
            decoded, *logits = logits
            assert decoded is not None, "a decode part asks for logits"
            self.mask, self.positions = step.parts[0].attention_mask, step.parts[0].position_ids[:, 0]
            outputs += sample(self.running, decoded)
            self._save(tail=False)
        for prompt, part, last in zip(step.prompts, step.parts[step.decode :], logits, strict=True):
            prompt.computed += part.input_ids.shape[1]
            if last is not None:
                self._prompts.remove(prompt)
                earlier = _RunningRows.detach(self)
                prompt.state.attach(self)
                outputs += self._first_tokens(prompt, last[:, None], None)
                earlier.attach(self)
                completed.append(prompt.work)
        more, also = prefill_apart(self, step.apart)
        return outputs + more, completed + also

    @_counting_streamed_bytes
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
        self._drop_ahead()
        earlier = _RunningRows.detach(self)
        outputs = self._prefill(work, columns)
        earlier.attach(self)
        return outputs

    def _prefill(self, work: PrefillWork, columns: int) -> list[RowOutput]:
        """Begin or continue ``work``'s prompt forward in the (detached) loop; its rows' first tokens once it is
        complete, else ``[]`` (the work's state is then set aside until the next call). A whole prompt forward
        (stored chunks loaded first) also verifies each row's first tree when the verifier drafts one
        (:meth:`~kvboost_hf.hf.verify.TreeVerifier.prompt_queries`: the logits are then ``[P, 1 + nodes, V]``)."""
        prompt = next((prompt for prompt in self._prompts if prompt.work is work), None)
        if prompt is None:
            prompt = self._begin_prefill(work, columns)
            assert self.cache is not None, "the prefill built a cache"
            if not columns or prompt.input_ids.shape[1] <= columns:  # the whole prompt forward in this call
                inputs, trees = prompt.inputs, None
                if self.verifier is not None:  # it also verifies each row's first tree, when the verifier drafts
                    inputs, trees = self.verifier.prompt_queries(
                        list(work.rows),
                        self.cache,
                        inputs,
                        self.mask,
                        prompt.input_ids,
                        prompt.position_ids,
                        prompt.starts,
                    )
                return self._first_tokens(prompt, self.router.prompt(self.cache, inputs, self.running), trees)
            tail = prompt.inputs["input_ids"].shape[1]  # what the store did not hold: one chunk when <= columns
            graphed = self.router.graphed_prompt(self.cache, prompt.inputs, self.running) if tail <= columns else None
            if graphed is not None:
                return self._first_tokens(prompt, graphed[:, None], None)
        else:
            self._prompts.remove(prompt)
            prompt.state.attach(self)
        last = self._prompt_chunk(prompt, columns)
        if last is None:
            prompt.state = _RunningRows.detach(self)
            self._prompts.append(prompt)
            return []
        return self._first_tokens(prompt, last, None)

    def _begin_prefill(self, work: PrefillWork, columns: int = 0) -> _Prompt:
        """Compute and store the work's shared prefixes (each one: the scheduler gave only those the store lacks),
        then make its rows the loop's, in a fresh cache, with their left-padded prompts' mask; returns the prompt
        forward to run, its stored chunks loaded (:attr:`_Prompt.inputs`)."""
        self.rows += work.rows
        rows = list(work.rows)
        prompts = [list(rows[0].context_ids)] if work.repeat else [list(row.context_ids) for row in rows]
        starts = work.cache_segment_starts(reuse=self.new_cache is not None)
        shared_computed: dict[int, int] = {}
        if self.new_cache is not None:
            for prefix in work.shared_prefixes:  # one forward each (batch of one), stored before the prompts' forward
                cache = self.new_cache(())
                ids = to_device([prefix.tokens], self.device)
                self.router.run(forward_inputs(cache, input_ids=ids, logits_to_keep=1), logits=False)
                cache.save(tail=False)
                computed = len(prefix.tokens) - (cache.last_reuse[0].cached_tokens if cache.last_reuse else 0)
                shared_computed[prefix.row] = shared_computed.get(prefix.row, 0) + computed
                logger.debug("stored a shared prefix of %d tokens", len(prefix.tokens))
        self.running = rows
        self.cache = self.new_cache(starts) if self.new_cache is not None else DynamicCache()
        input_ids, self.mask = left_pad(prompts, self.pad_token_id, self.device)
        self.router.prepare_prompt(self.cache, rows, input_ids.shape[1], columns)
        position_ids = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 1)
        prompt = _Prompt(work, prompts, input_ids, position_ids, starts, shared_computed)
        prompt.inputs = forward_inputs(self.cache, input_ids=input_ids, attention_mask=self.mask,
                                       position_ids=position_ids, logits_to_keep=1)  # fmt: skip
        return prompt

    def _prompt_chunk(self, prompt: _Prompt, columns: int) -> torch.Tensor | None:
        """Compute the next ``columns`` columns of ``prompt``'s prepared forward (all of a sparse repair forward);
        the last prompt positions' logits ``[P, 1, V]`` once every column is computed, else None."""
        chunk = prompt.next_chunk(self.cache, self.mask, columns)
        inputs, last = prompt.inputs, True
        if chunk is not None:  # a dense suffix: its columns in order, each chunk seeing the columns before it
            inputs = {**inputs, "input_ids": chunk.input_ids, "position_ids": chunk.position_ids,
                      "attention_mask": chunk.attention_mask}  # fmt: skip
            last = chunk.logits
        out = self.router.run(inputs, logits=last)  # an earlier chunk's logits are never read: no output head
        prompt.computed += inputs["input_ids"].shape[1]
        return out.logits[:, -1:, :].float() if last else None

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
                cached = max(0, loaded[index] - shared_computed.get(index, 0))
                if row.tokens:  # a preempted row resuming: its context's chunks came back from the store
                    row.resumed_cached_tokens += cached
                else:
                    row.reuse = reuse[index]
                    row.reuse.cached_tokens = cached
            if row.request.keep_first_logits and not row.tokens:
                row.first_logits = logits[index, 0].cpu()
        if trees is not None and self.verifier is not None:
            verified = self.verifier.verify(self.running, self.cache, trees, logits, self.mask, self.positions)
            return self._verified(verified)
        outputs = sample(self.running, logits[:, 0])
        if self.draft is not None:  # after the first tokens were sampled (their time is the TTFT)
            self.draft.prefill(input_ids, self.mask, position_ids, prompt.starts)
        return outputs

    @_counting_streamed_bytes
    def step(self, look_ahead: bool = True) -> list[RowOutput]:
        """One decode step for every running row (speculative when the drafter drafts for them: one or more tokens
        per row); returns each row's tokens, in the order of :attr:`running`. The chunks completed so far are
        written back after it (background writes; never inside the time to first token). ``look_ahead=False``:
        launch no step ahead (:attr:`look_ahead`) this time (the caller adds prompt chunks next, which would cut it
        off)."""
        if self.verifier is not None and (sizes := self.verifier.tree_sizes(self.running)) is not None:
            assert self.cache is not None, "running rows have a cache"
            verify = functools.partial(self.router.verify, self.cache, self.running)
            verified = self.verifier.step(self.running, self.cache, self.mask, self.positions, sizes, verify)
            outputs = self._verified(verified)
            self._save(tail=False)
            return outputs
        if self._ahead is not None and self._ahead.continues(self.running):
            ahead, self._ahead = self._ahead, None
            logits, self.mask, self.positions = ahead.logits, ahead.mask, ahead.positions
        else:
            self._drop_ahead()
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.running), 1)], dim=1)
            self.positions = self.positions + 1
            logits = self.router.decode(self.cache, self.running, self.mask, self.positions)
        if self.draft is not None and self.draft.cache is not None:  # it keeps the target's columns (its invariant)
            self.draft.follow(self.running, self.mask, self.positions)
        self._save(tail=False)
        if look_ahead and self.look_ahead and all(row.plain_greedy and row.tokens_left > 1 for row in self.running):
            return self._step_ahead(logits)
        return sample(self.running, logits)

    def _step_ahead(self, logits: torch.Tensor) -> list[RowOutput]:
        """The running rows' greedy tokens from ``logits``, the next step launched on them (graphed: else not)
        before they are read, then recorded (:attr:`look_ahead`)."""
        rows = list(self.running)
        chosen = greedy_tokens(logits)
        sampled = Sampled(rows, logits, chosen)
        read = to_host_later(sampled.packed)
        mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
        positions = self.positions + 1
        ahead = self.router.decode_ahead(self.cache, rows, chosen, mask, positions)
        outputs = sampled.outputs(read())
        if ahead is not None:
            assert isinstance(self.cache, ChunkReuseCache), "a graphed step's cache"
            fed = [output.tokens[0] for output in outputs]
            self.cache.record(torch.tensor(fed, dtype=torch.long)[:, None])
            self._ahead = _Ahead(rows, fed, ahead, mask, positions)
            self.steps_ahead += 1
        return outputs

    def _drop_ahead(self) -> None:
        """Cut off the step launched ahead, if any (rows leave or join, a forward is packed): its column off the
        cache (K/V length, recorded tokens, ledgers), so the cache and the rows are as if it never ran."""
        if self._ahead is None:
            return
        self._ahead = None
        assert isinstance(self.cache, ChunkReuseCache), "a step ahead ran graphed"
        self.cache.crop(-1)
        self.steps_ahead_dropped += 1

    def _verified(self, verified: Verified) -> list[RowOutput]:
        """Take a verify forward's result (one more verify forward): the batch's mask and positions after the
        accepted paths; returns the rows' outputs."""
        self.mask, self.positions = verified.mask, verified.positions
        self.verify_forwards += 1
        return verified.outputs

    def _save(self, tail: bool) -> None:
        """Write back the chunks completed so far (target and draft caches; ``tail``: unfinished ones too)."""
        if isinstance(self.cache, ChunkReuseCache):
            self.cache.save(tail=tail)
        if self.draft is not None:
            self.draft.save(tail=tail)

    # ------------------------------------------------------------------ rows leaving
    def retire_finished(self) -> None:
        """Drop the rows that ended (:attr:`DecodeRow.finished`, decided by the caller) from the batch; their chunks
        (unfinished last chunks included) are stored first. A chunked prompt forward whose rows all ended (e.g.
        cancelled) is dropped, the chunks it completed stored."""
        self._release(lambda row: row.finished)

    def preempt(self, rows: Sequence[DecodeRow]) -> None:
        """Take ``rows`` out of the batch unfinished (the scheduler frees their K/V memory): running rows, and
        prompt forwards under way all of whose rows are among them. Their chunks are stored first (a running row's
        unfinished last chunk included, a prompt forward's completed chunks), so a later prefill of each row's
        :attr:`~kvboost_hf.hf.rows.DecodeRow.context_ids` loads them and computes only the rest."""
        leaving = {id(row) for row in rows}
        self._release(lambda row: id(row) in leaving)
        self.rows = [row for row in self.rows if id(row) not in leaving]  # counted by the loop they end in

    def _release(self, leaving: Callable[[DecodeRow], bool]) -> None:
        """Drop the running rows and the prompt forwards under way (all of whose rows) ``leaving`` names, their
        chunks stored first; the prompt forwards of other rows go on (also when no row is left running)."""
        for prompt in [prompt for prompt in self._prompts if all(leaving(row) for row in prompt.work.rows)]:
            self._prompts.remove(prompt)
            if isinstance(prompt.state.cache, ChunkReuseCache):
                prompt.state.cache.save(tail=False)
        keep = [i for i, row in enumerate(self.running) if not leaving(row)]
        if len(keep) == len(self.running):
            return
        self._drop_ahead()
        self._save(tail=True)  # store the leaving rows' chunks (and unfinished last chunks) first
        if not keep:
            _RunningRows.detach(self)  # every chunk is stored: the caches go, prompt forwards under way stay
            return
        self.running = [self.running[i] for i in keep]
        index = to_device(keep, self.device)
        assert self.cache is not None, "running rows have a cache"
        self.cache.batch_select_indices(index)
        if self.draft is not None and self.draft.cache is not None:
            self.draft.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]
        if self.draft is None:  # a draft's cache keeps a layout of its own
            self.mask = trim_padding(self.cache, self.mask)

    def abandon(self) -> None:
        """Drop every running row, every prompt forward under way and the caches unsaved (after a failed forward
        they may be inconsistent)."""
        self.running, self._prompts, self._ahead = [], [], None
        self.cache = None
        if self.draft is not None:
            self.draft.cache = None


def prefill_apart(
    loop: DecodeLoop, prefills: Sequence[tuple[PrefillWork, int]]
) -> tuple[list[RowOutput], list[PrefillWork]]:
    """The next chunk of each of ``prefills`` (``(work, columns)``) by :meth:`DecodeLoop.add`, one forward each:
    the completed works' first tokens, and those works."""
    outputs: list[RowOutput] = []
    completed: list[PrefillWork] = []
    for work, columns in prefills:
        if first := loop.add(work, columns):
            outputs += first
            completed.append(work)
    return outputs, completed


def trim_padding(cache: Cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop from ``cache`` the leading columns that are left padding for every row of the 2D ``mask`` ``[B, C]``
    (a wider row left the batch) when they are at least :data:`TRIM_MIN_COLUMNS` and a quarter of the width, so the
    steps after read only what the rows hold and a trim's copy (one per layer) stays rare; returns the mask of the
    columns kept (``mask`` itself when none is dropped)."""
    width = mask.shape[1]
    first = int(mask.any(dim=0).int().argmax())  # one device read, only when rows leave
    if first < max(TRIM_MIN_COLUMNS, width // 4):
        return mask
    keep_cache_columns(cache, [range(first, width)] * mask.shape[0], width - first)
    return mask[:, first:]


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a left-padded batch on ``device`` (copied there without a wait)."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
