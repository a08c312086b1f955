"""The scheduler: which requests run, in which batch, prefilled how. One contract for ``KVBoost.generate_batch``,
``generate_many`` and the server's worker.

The contract, in the shape of vLLM's ``schedule()`` / ``update_from_output()``:

1. :meth:`Scheduler.add` queues a :class:`RequestGroup` (one request's rows: the ``n`` choices of one prompt);
2. :meth:`Scheduler.schedule` decides what runs now and returns it as a :class:`SchedulerOutput`: for every running
   batch, one decode step of its running rows and chunks (:class:`PrefillChunk`) of the
   :class:`~kvboost_hf.hf.decode.PrefillWork` of the groups admitted to it, within the step's token budget;
3. the model runner (:class:`~kvboost_hf.runner.ModelRunner`, which the scheduler does not hold and which makes
   no decision of its own) runs it and returns the tokens it sampled per row
   (:class:`~kvboost_hf.hf.decode.RowOutput`, in a :class:`StepReport`) and the prefills it completed;
4. :meth:`Scheduler.update_from_output` appends them to their rows (the text decoded incrementally), decides which
   rows stop (:func:`stop_reason`: an end token, the budget, a stop string, cancellation; tokens after the one
   that ends a row are dropped), reports each token to its group (``on_token``) and retires the batches that
   ended; the runner then drops the ended rows (their chunks stored) and reports each batch's width
   (:meth:`Scheduler.record_widths`), which the K/V projection reads.

:class:`~kvboost_hf.engine_core.EngineCore` holds both and steps them. What crosses between them is plain data:
:class:`SchedulerOutput` (per batch: its id and key, the rows preempted since the last step, a decode step, prefill
chunks) one way, :class:`StepReport` (sampled tokens, completed prefills, computed tokens, errors) and the batches'
widths the other.

The rules, in order:

1. rows of one batch share one cache namespace: the same ``cache_salt`` (the :class:`BatchKey`);
2. admission: a pending group whose key matches a running batch joins it at once (continuous batching: its prompt is
   prefilled from that step on, after the batch's decode step, then its rows decode in the same forward as the
   running rows), unless joining would add more left padding than ``join_padding_limit`` (a batch is as wide as its
   widest row): then it starts a batch of its own at once, decoded by its own forward each step, and later groups
   join whichever batch of their key their padding grows least; other pending groups of one key form a
   new batch once the oldest has waited ``batch_window_s`` (or they fill ``max_rows``); the rows of all running
   batches, those being prefilled included, stay within ``max_rows``, and groups are admitted oldest first;
2b. token budget: a step computes at most ``token_budget`` tokens (0: no budget): every running row's decode step
   first (one token each), then chunks of the prefills under way, oldest first (:func:`split_budget`); a prompt
   longer than what is left is prefilled over several steps (chunked prefill: exact, each chunk attends to the
   columns before it), so a long prompt joining a batch never pauses its running rows for its whole prefill;
2c. K/V memory (with a :class:`~kvboost_hf.kv_budget.KVBudget`): a group is admitted only if the running
   batches' projected K/V bytes (:mod:`kvboost_hf.kv_budget`: every row as wide as its batch's widest, each taking
   all its tokens) still fit the budget with its rows; else it waits, and the groups after it of its key wait too
   (a batch is admitted partly). Before admitting, while the projection exceeds the budget (a prefill spread over
   several steps while the batch widened, a speculative step, a budget lowered), the newest admitted group is
   preempted: its rows leave their batch unfinished (the step's :class:`BatchWork` names them: the runner stores
   their chunks first; writing them back is the swap, the store is a cache already) and the group goes back to the
   front of the queue, its tokens kept; the projection counts the batch's width as the runner last reported it
   until the runner reports it again (rows leaving may narrow it: counted wider, never narrower); admitted again,
   each row is prefilled from its prompt and tokens (loading what was stored, computing the rest) and goes on with
   the tokens it would have taken. A group that cannot fit the budget alone is refused
   (:class:`~kvboost_hf.core.errors.CapacityError` from :meth:`Scheduler.add`, or through ``on_fail`` when the
   budget was lowered under it);
2d. a long-RoPE restart (``restart_after``: models whose ``generate()`` drops its cache once the sequence passes
   their original length, Phi3's family, :func:`~kvboost_hf.hf.models.cache_restart_length`): a running row whose
   context (prompt and tokens) passes ``restart_after`` tokens, its K/V all computed at or below it, is preempted as
   in 2c and queued again at the front, once: its next forward is a prefill of its whole context, computed with the
   long factors at every position (reuse is off past that length), as ``generate()`` recomputes it;
2e. and no batch holds rows on both sides of ``restart_after``: transformers picks the RoPE factors from the largest
   position of a whole forward, so a row past the length would switch its batch-mates' queries to the long factors
   (their tokens would then depend on who they ran with). A group joins only a batch whose rows are on its side;
3. prefill: the rows admitted to a batch in one schedule are prefilled together, in left-padded forwards of rows of
   similar context lengths (:func:`padding_groups`: a row's left padding is at most its own length or
   :data:`PADDING_SLACK` columns, so short prompts admitted with a long one are not padded to its width), except
   those :meth:`BatchPolicy.prefill_alone` names, each prompt of which is prefilled in a cache of its own and then
   joined. Rows of one prompt (the ``n`` choices of a request) prefilled together are prefilled once and repeated;
   rows with different prompts that share chunk-aligned prefixes have those prefixes computed and stored once
   first, unless the store holds them already (the plan reads the store; the runner reads none): by the first of
   their forwards in plan order, the others load them. Prompts prefilled alone are

   * segment prompts (documents given as segments, looked up by content key so they stitch at any position): a
     cache is built with one prompt's segment starts, which shape its chunks and keys; each row keeps its own once
     joined (its ledger carries them), so its chunks are written back under the keys its own cache would use;
   * with ``mode="chunk_kv_reuse"``, prompts for which the store holds non-prefix hits (chunks at or after the first
     missed chunk, stored under prefix or content key; see :func:`~kvboost_hf.reuse.plan.has_nonprefix_hits`):
     the cache stitches and repairs those for one row at a time.

Invariants: a group's rows run in one batch at a time (a preempted group leaves it whole and is admitted again
whole); after :meth:`Scheduler.schedule` the running batches' projected K/V bytes are within the budget, so no step
holds more K/V than it (:mod:`kvboost_hf.kv_budget` says what is counted); a failure while running a batch fails
that batch's groups and nothing else. :meth:`Scheduler.add` may be called from any thread (the queue has its own
lock, never held during a store read or a forward); every other method from one thread at a time.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvboost_hf.core.chunking import ChunkingConfig, chunk_spans
from kvboost_hf.core.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_TOKEN_BUDGET, GenerationMode
from kvboost_hf.core.errors import CapacityError, ConfigError, InputError, KVBoostError
from kvboost_hf.core.keys import KeySpace, chain_prefix_keys
from kvboost_hf.core.values import check_bounds, is_integer
from kvboost_hf.hf.decode import DecodeRow, PrefillWork, RowOutput, SharedPrefix
from kvboost_hf.kv_budget import BatchShape, KVBudget
from kvboost_hf.reuse.plan import ChunkSource, has_nonprefix_hits, stored_prefix_tokens

#: Columns of left padding a row prefilled together with others may take whatever its length (see
#: :func:`padding_groups`): below it, splitting a forward saves less than a forward and a join cost.
PADDING_SLACK = 64

#: Cells (row x column) of left padding a group may add to a running batch by joining it, when the batches' steps
#: share one packed forward (:meth:`~kvboost_hf.runner.ModelRunner.run_steps`): a batch of its own then costs its parts'
#: attention calls, not one more read of the weights, so a join is worth no more padding than a few slack columns
#: per row (:data:`PADDING_SLACK` x :data:`DEFAULT_MAX_BATCH_SIZE`). Measured on the embedded model (2 CPU threads):
#: 8 short rows and a 922-token row took 100 ms per step joined (padded), 67 ms as two batches in one forward.
PACKED_JOIN_PADDING_CELLS = PADDING_SLACK * DEFAULT_MAX_BATCH_SIZE

logger = logging.getLogger(__name__)


class RequestCancelled(KVBoostError, RuntimeError):
    """The request was cancelled before it started."""


@dataclass(frozen=True)
class BatchKey:
    """Requests with equal keys may share a batch (and join a running one)."""

    cache_salt: str | None


class BatchPolicy:
    """Which requests may share a batch, and which prompts are prefilled alone, for one store, key space and mode.

    Args:
        store: the chunk store the caches read.
        key_space: the caches' :class:`~kvboost_hf.core.keys.KeySpace` (each tenant's namespace, the chunking).
        mode: the generation mode of the batches.
    """

    def __init__(self, store: ChunkSource, key_space: KeySpace, mode: GenerationMode | str) -> None:
        self.store = store
        self.key_space = key_space
        self.mode = GenerationMode(mode)

    @property
    def chunking(self) -> ChunkingConfig:
        return self.key_space.chunking

    def key(self, cache_salt: str | None) -> BatchKey:
        """The batch key of a request of tenant ``cache_salt``."""
        return BatchKey(cache_salt)

    def prefill_alone(
        self, prompt_ids: Sequence[int], cache_salt: str | None, segment_starts: Sequence[int] = ()
    ) -> bool:
        """Whether the prompt is prefilled in a cache of its own (rule 3): with reuse on, when it has segment starts;
        with ``mode="chunk_kv_reuse"``, also when the store holds non-prefix hits for it (reads the store)."""
        if self.mode is GenerationMode.BASELINE:
            return False  # plain K/V: no cache to build per prompt
        if segment_starts:
            return True
        if self.mode is not GenerationMode.CHUNK_KV_REUSE:
            return False
        namespace = self.key_space.namespace(cache_salt)
        return has_nonprefix_hits(self.store, prompt_ids, namespace=namespace, chunking=self.key_space.chunking)

    def prefill_works(self, rows: Sequence[DecodeRow], cache_salt: str | None) -> list[PrefillWork]:
        """The prefills of ``rows`` of tenant ``cache_salt`` admitted together (see :func:`prefill_works`), less the
        shared prefixes the store holds already (:func:`without_stored_prefixes`: reads the store), so the runner
        computes every prefix it is given."""
        namespace = self.key_space.namespace(cache_salt)
        works = prefill_works(
            rows,
            self.chunking,
            reuse=self.mode is not GenerationMode.BASELINE,
            alone=lambda prompt_ids, starts: self.prefill_alone(prompt_ids, cache_salt, starts),
            stored=lambda together: stored_prefix_tokens(
                self.store, [row.context_ids for row in together], namespace=namespace, chunking=self.chunking
            ),
        )
        return without_stored_prefixes(works, self.store, namespace, self.chunking)


def prefill_works(
    rows: Sequence[DecodeRow],
    chunking: ChunkingConfig,
    *,
    reuse: bool,
    alone: Callable[[Sequence[int], Sequence[int]], bool],
    slack: int = PADDING_SLACK,
    stored: Callable[[Sequence[DecodeRow]], list[int]] | None = None,
) -> list[PrefillWork]:
    """The prefills of ``rows`` admitted together (rule 3): first the rows prefilled together, one work per
    :func:`padding_groups` group (narrowest first), then, per prompt and segment starts that ``alone(prompt ids,
    segment starts)`` names, its rows in a cache of their own. Rows of one prompt are in one work, a repeated
    prefill when they are all of it; with ``reuse`` (chunk-reuse caches) the works prefilled together get the
    shared prefixes of the rows their forwards compute (a repeated prompt once; :func:`shared_prefixes`; each given
    to the first work holding a row that starts with it, :func:`give_prefixes`: that work computes and stores it,
    the later ones load it), and a work of one segment setting its segment starts. ``alone`` is asked once per
    distinct prompt, and not at all when the rows are one prompt.

    ``stored`` (with ``reuse``): per row of those prefilled together, the tokens the store holds of its context as
    leading prefix chunks; each padding group is then split the same way by the tokens left to compute (context
    less stored), since a left-padded prompt forward loads for every row only the columns all its rows have stored
    and computes the rest: a cold row beside warm ones made them all compute their whole prompts.

    Invariants: every row is in exactly one work; in a work prefilled together ``widest - narrowest <=
    max(narrowest, slack)`` context tokens, so each row's left padding is at most ``max(its context tokens,
    slack)`` columns (see :func:`padding_groups`), and with ``stored`` the same bound holds for the tokens left to
    compute as the store held them when asked, so no row computes more than ``max(2 x its own, its own + slack)``
    of them."""
    keys = [row.prefill_setting for row in rows]  # tuples of the whole prompt: built once per row
    settings = list(dict.fromkeys(keys))
    if len(settings) == 1:
        return [prefill_work(rows, reuse=reuse, settings=settings)]
    verdicts = {setting: alone(*setting) for setting in settings}
    together = [row for row, key in zip(rows, keys, strict=True) if not verdicts[key]]
    groups = padding_groups(together, slack)
    if reuse and stored is not None and len(together) > 1:
        held = dict(zip(map(id, together), stored(together), strict=True))
        groups = [
            part
            for group in groups
            for part in length_groups(group, lambda row: row.context_length - held[id(row)], slack)
        ]
    works = [prefill_work(group, reuse=reuse) for group in groups]
    if reuse and not any(row.request.segment_starts for row in together):  # prefixes: chunked without starts
        computed = [row for work in works for row in (work.rows[:1] if work.repeat else work.rows)]
        works = give_prefixes(works, shared_prefixes([row.context_ids for row in computed], chunking))
    for setting in settings:
        if verdicts[setting]:
            members = [row for row, key in zip(rows, keys, strict=True) if key == setting]
            works.append(prefill_work(members, reuse=reuse, settings=[setting]))
    return works


def without_stored_prefixes(
    works: Sequence[PrefillWork], store: ChunkSource, namespace: str, chunking: ChunkingConfig
) -> list[PrefillWork]:
    """``works`` without the shared prefixes all of whose chunks ``store`` holds under their prefix keys in
    ``namespace`` (the prompt forwards load those): one ``contains_many`` for all of them, none when no work has
    one."""
    prefixes = [prefix for work in works for prefix in work.shared_prefixes]
    if not prefixes:
        return list(works)
    keys = [chain_prefix_keys(namespace, prefix.tokens, chunk_spans(prefix.tokens, chunking)) for prefix in prefixes]
    found = store.contains_many([key for chain in keys for key in chain])  # one Redis round trip for all of them
    stored, start = set(), 0
    for prefix, chain in zip(prefixes, keys, strict=True):
        if all(found[start : start + len(chain)]):
            stored.add(prefix.tokens)
        start += len(chain)
    return [
        dataclasses.replace(work, shared_prefixes=tuple(p for p in work.shared_prefixes if p.tokens not in stored))
        for work in works
    ]


def padding_groups(rows: Sequence[DecodeRow], slack: int = PADDING_SLACK) -> list[list[DecodeRow]]:
    """``rows`` split into the groups of one left-padded prompt forward each by context length
    (:func:`length_groups`).

    Invariants: every row is in exactly one group; in each, ``widest - narrowest <= max(narrowest, slack)``, so a
    row's left padding (the group's widest less its length) is at most ``max(its length, slack)`` columns: a
    forward's padding cells are at most its real cells, or ``slack`` per row for rows shorter than ``slack``; rows
    of one length (those of one prompt) are in one group."""
    return length_groups(rows, lambda row: row.context_length, slack)


def length_groups(
    rows: Sequence[DecodeRow], length: Callable[[DecodeRow], int], slack: int = PADDING_SLACK
) -> list[list[DecodeRow]]:
    """``rows`` split by ``length(row)`` (tokens), shortest first: walking the lengths up, a group starts with its
    shortest row and takes the next rows while they are at most ``max(shortest, slack)`` tokens longer; each group
    holds its rows in their order in ``rows``. Every row is in exactly one group; rows of one length in one."""
    lengths = [length(row) for row in rows]
    starts: list[int] = []  # each group's shortest length, ascending
    for value in sorted(lengths):
        if not starts or value - starts[-1] > max(starts[-1], slack):
            starts.append(value)
    groups: list[list[DecodeRow]] = [[] for _ in starts]
    for row, value in zip(rows, lengths, strict=True):
        groups[bisect.bisect_right(starts, value) - 1].append(row)
    return groups


def prefill_work(
    rows: Sequence[DecodeRow],
    *,
    reuse: bool,
    settings: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
) -> PrefillWork:
    """One prefill of ``rows``, repeated when they are one prompt (and segment starts), with the segment starts of
    rows of one setting when ``reuse``; no shared prefix. ``settings``: the rows' distinct prefill settings when the
    caller has them."""
    if settings is None:
        settings = list({row.prefill_setting for row in rows})
    starts = settings[0][1] if reuse and len(settings) == 1 else ()
    return PrefillWork(tuple(rows), segment_starts=starts, repeat=len(settings) == 1 and len(rows) > 1)


def give_prefixes(works: Sequence[PrefillWork], prefixes: Sequence[SharedPrefix]) -> list[PrefillWork]:
    """``works`` with each of ``prefixes`` (found over all their rows) given to the first work some of whose rows
    start with it, counted for the first of those rows (its index in the work's rows): that work computes and stores
    it, the later ones load it. Replaces the works' shared prefixes. (A later work whose prefill begins first, its
    chunk fitting a token budget too small for the earlier work's rows, computes the prefix in its own forward.)"""
    left = list(prefixes)
    given = []
    for work in works:
        found = []
        for prefix in list(left):
            size = len(prefix.tokens)
            first = next((i for i, row in enumerate(work.rows) if row.context_ids[:size] == prefix.tokens), None)
            if first is not None:
                found.append(SharedPrefix(prefix.tokens, first))
                left.remove(prefix)
        given.append(dataclasses.replace(work, shared_prefixes=tuple(found)))
    return given


def shared_prefixes(prompts: Sequence[Sequence[int]], chunking: ChunkingConfig) -> list[SharedPrefix]:
    """For each group of prompts with the same first chunk, the longest chunk-aligned prefix they all share and are
    all longer than (a prompt's last token is always computed, so a prefix that is a whole prompt saves nothing),
    counted for the group's first prompt (none for a prompt alone in its group)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        spans = chunk_spans(prompt, chunking)
        if spans:
            groups.setdefault(tuple(prompt[: spans[0][1]]), []).append(index)
    found = []
    for members in groups.values():
        if len(members) < 2:
            continue
        first = list(prompts[members[0]])
        shared = 0
        for _, end in chunk_spans(first, chunking):
            if any(len(prompts[m]) <= end or list(prompts[m][:end]) != first[:end] for m in members):
                break
            shared = end
        if shared:
            found.append(SharedPrefix(tuple(first[:shared]), members[0]))
    return found


@dataclass(eq=False)
class RequestGroup:
    """One request's rows (the ``n`` choices of one prompt, vLLM's sequence group), queued with :meth:`Scheduler.add`.

    ``on_token(row)`` is called after each token of one of its rows (and once when a row is cancelled); ``on_fail``
    with the error when the group cannot run (cancelled before it started, its batch failed, shutdown); neither
    may block. ``cancel``: when set before admission the group is dropped (:class:`RequestCancelled`); its rows'
    requests usually share it, ending them after their current token. ``arrival`` and ``admitted_at`` (its first
    admission) are ``time.perf_counter()`` values; ``batch`` is the batch it was admitted to (None while pending);
    ``admission`` orders its latest admission among all (the newest is preempted first); ``waited_for_memory``: its
    admission waited for K/V memory at least once.
    """

    rows: list[DecodeRow]
    cache_salt: str | None = None
    on_token: Callable[[DecodeRow], None] = lambda row: None
    on_fail: Callable[[BaseException], None] = lambda error: None
    cancel: threading.Event | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    batch: RunningBatch | None = None
    admission: int = -1
    waited_for_memory: bool = False

    def __post_init__(self) -> None:
        if not self.rows:
            raise InputError("a request group needs at least one row")

    @property
    def done(self) -> bool:
        return all(row.finished for row in self.rows)

    def end_cancelled(self, before: str) -> None:
        """End this cancelled group while it has no running row (queued, or its prefill under way): fail it with
        :class:`RequestCancelled` (``before``: what it was cancelled before) when no row has a token yet; else it
        was preempted after taking tokens, and its live rows end ``"cancelled"``, each reported once through
        ``on_token`` as a running row's cancellation is (it ended twice: finished and failed)."""
        if not any(row.tokens for row in self.rows):
            for row in self.rows:
                row.cancel()
            self.on_fail(RequestCancelled(f"cancelled before {before}"))
            return
        for row in self.live_rows:
            row.cancel()
            self.on_token(row)

    @property
    def live_rows(self) -> list[DecodeRow]:
        """Its rows not finished (all of them until one ends; a preempted group is admitted again with these)."""
        return [row for row in self.rows if not row.finished]

    @property
    def contexts(self) -> list[tuple[int, int]]:
        """``(context tokens, tokens left)`` of each live row: what its prefill computes or loads and what it may
        still take (see :class:`~kvboost_hf.kv_budget.BatchShape`)."""
        return [(row.context_length, row.tokens_left) for row in self.live_rows]


class RunningBatch:
    """A batch the scheduler runs (one cache namespace, one runner batch of id ``id``) and the groups admitted to
    it, each row reporting to its group.

    ``rows`` are its running rows (prefilled, not ended) as the scheduler counts them; ``columns`` its width as the
    runner last reported it (:meth:`Scheduler.record_widths`; 0 before its first report); ``leaving`` the rows
    preempted since its last step (the next :class:`BatchWork` hands them to the runner). ``decode_counts`` is
    filled when it ends (what the runner's ``on_close`` returned); ``started`` is a ``time.perf_counter()`` value.
    """

    def __init__(self, key: BatchKey, batch_id: int) -> None:
        self.key = key
        self.id = batch_id
        self.groups: list[RequestGroup] = []
        self._owners: dict[int, RequestGroup] = {}
        self.rows: list[DecodeRow] = []
        self.columns = 0
        self.leaving: list[DecodeRow] = []
        self.started = time.perf_counter()
        self.decode_counts: dict[str, Any] | None = None
        self.prefilling: list[Prefilling] = []

    def admit(self, groups: Sequence[RequestGroup], now: float) -> None:
        """Make ``groups`` part of this batch (their live rows are prefilled from the next step on, once
        :meth:`Scheduler.schedule` planned their :class:`~kvboost_hf.hf.decode.PrefillWork`)."""
        for group in groups:
            group.admitted_at, group.batch = group.admitted_at or now, self
            self._owners.update((id(row), group) for row in group.rows)
        self.groups += groups

    def preempt(self, group: RequestGroup) -> list[RequestGroup]:
        """Take ``group`` out of this batch unfinished, with the groups whose rows share a prefill under way with
        its rows (one prompt forward leaves whole): their rows are :attr:`leaving` (the runner stores their chunks
        and drops them at the next step: :meth:`~kvboost_hf.hf.decode.DecodeLoop.preempt`). Returns the groups taken
        out, in admission order."""
        taken = {id(group): group}
        for entry in self.prefilling:
            owners = {id(self.owner(row)): self.owner(row) for row in entry.work.rows}
            if id(group) in owners:
                taken.update(owners)
        leaving = [row for member in taken.values() for row in member.live_rows]
        ids = {id(row) for row in leaving}
        self.prefilling = [entry for entry in self.prefilling if not ids.intersection(map(id, entry.work.rows))]
        self.rows = [row for row in self.rows if id(row) not in ids]
        self.leaving += leaving
        for row in leaving:
            row.preemptions += 1
        self.groups = [member for member in self.groups if id(member) not in taken]
        for member in taken.values():
            member.batch = None
            for row in member.rows:
                del self._owners[id(row)]
        return sorted(taken.values(), key=lambda member: member.admission)

    def shape(self) -> BatchShape:
        """This batch as the K/V projection sees it (:class:`~kvboost_hf.kv_budget.BatchShape`): its width (as the
        runner last reported it, 0 with no row running), its running rows' tokens left, and the contexts of the rows
        whose prefill is not complete."""
        joining = tuple((row.context_length, row.tokens_left) for row in self.joining_rows)
        return BatchShape(self.columns if self.rows else 0, tuple(row.tokens_left for row in self.rows), joining)

    def drop(self, groups: Sequence[RequestGroup], error: BaseException) -> None:
        """Take ``groups`` (admitted, not prefilled) out of this batch and report ``error`` to them."""
        dropped = {id(group) for group in groups}
        self.groups = [group for group in self.groups if id(group) not in dropped]
        for group in groups:
            group.batch = None
            group.on_fail(error)

    def fail(self, error: BaseException) -> None:
        """Report ``error`` to every group of this batch still running (or being prefilled) and forget its rows and
        prefills (the runner dropped its caches unsaved: they may be inconsistent after a failed forward)."""
        for group in self.groups:
            if not group.done:
                group.on_fail(error)
        self.prefilling, self.rows = [], []

    def drop_cancelled_prefills(self) -> None:
        """Drop the prefills under way whose groups were all cancelled (``RequestGroup.cancel``): their rows end
        ``"cancelled"`` (:meth:`RequestGroup.end_cancelled`: a group with no token yet fails with
        :class:`RequestCancelled`, as if cancelled while pending); the runner drops their prompt forwards when it
        next drops ended rows."""
        for entry in list(self.prefilling):
            groups = list({id(self.owner(row)): self.owner(row) for row in entry.work.rows}.values())
            if not all(group.cancel is not None and group.cancel.is_set() for group in groups):
                continue
            self.prefilling.remove(entry)
            for group in groups:
                group.end_cancelled("its first token")

    def take(self, result: BatchResult) -> None:
        """Take the runner's ``result`` of this batch's step: the rows of the prefills it completed run from now on
        (those already ended excepted), the prefills leave :attr:`prefilling`."""
        completed = {id(work) for work in result.prefilled}
        self.prefilling = [entry for entry in self.prefilling if id(entry.work) not in completed]
        self.rows += [row for work in result.prefilled for row in work.rows if not row.finished]

    @property
    def joining_rows(self) -> list[DecodeRow]:
        """The rows admitted whose prefill is not complete."""
        return [row for entry in self.prefilling for row in entry.work.rows]

    @property
    def done(self) -> bool:
        """No row running and no prefill admitted and not complete (one that got no column yet included)."""
        return not self.rows and not self.prefilling

    @property
    def age_s(self) -> float:
        return time.perf_counter() - self.started

    def owner(self, row: DecodeRow) -> RequestGroup:
        """The group ``row`` belongs to."""
        return self._owners[id(row)]


@dataclass
class Prefilling:
    """A prefill admitted to a batch and not complete: its ``work`` and at most how many columns of its prompt
    forward are left to compute (``left``: the left-padded prompts' width less the columns scheduled so far; the
    runner computes fewer when the store holds the prompts' first chunks)."""

    work: PrefillWork
    left: int

    @property
    def forward_rows(self) -> int:
        """Rows of its prompt forward: one for a repeated prompt (the ``n`` choices of a request)."""
        return 1 if self.work.repeat else len(self.work.rows)


@dataclass(frozen=True)
class PrefillChunk:
    """Part of a prefill a batch runs in one step: up to ``columns`` (>= 1) more columns of ``work``'s prompt
    forward (the runner computes the whole forward at once when ``columns`` is at least its width)."""

    work: PrefillWork
    columns: int


@dataclass(frozen=True)
class BatchWork:
    """What one batch runs in one scheduler step, as plain data for the runner: the batch's id (``batch_id``) and
    key (``new``: formed now, the runner builds its loop), the rows preempted since its last step (``preempted``:
    taken out first, their chunks stored), one decode step for its running rows (``decode``), then chunks of its
    prefills (``prefills``: of the groups admitted now, ``admitted``, and of earlier ones not complete)."""

    batch_id: int
    key: BatchKey
    new: bool = False
    admitted: tuple[RequestGroup, ...] = ()
    decode: bool = False
    prefills: tuple[PrefillChunk, ...] = ()
    preempted: tuple[DecodeRow, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """One scheduler step's decisions, one :class:`BatchWork` per running batch."""

    work: tuple[BatchWork, ...] = ()


@dataclass(frozen=True)
class BatchResult:
    """How one :class:`BatchWork` ran (the runner's report): the prompt tokens its prefills computed (not loaded;
    counted when a prefill completes), the tokens the runner sampled per row (``outputs``; appended to the rows by
    :meth:`Scheduler.update_from_output`, which drops any after the one that ends a row), the prefills that completed
    (``prefilled``: their rows' first tokens are in ``outputs``) and the error that failed the batch (None: it ran)."""

    work: BatchWork
    computed_tokens: int = 0
    error: BaseException | None = None
    outputs: tuple[RowOutput, ...] = ()
    prefilled: tuple[PrefillWork, ...] = ()


@dataclass
class MemoryCounters:
    """The K/V memory side of admission, over every schedule of the schedulers sharing it: ``preemptions`` (groups
    preempted), ``rows_preempted``, ``admissions_deferred`` (groups whose admission waited for memory, each counted
    once), ``reserved_bytes`` (the running batches' projected K/V bytes after the latest schedule) and
    ``peak_reserved_bytes`` (the most after any schedule)."""

    preemptions: int = 0
    rows_preempted: int = 0
    admissions_deferred: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0

    def reserve(self, reserved: int) -> None:
        """Record the projection after a schedule."""
        self.reserved_bytes = reserved
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, reserved)


@dataclass(frozen=True)
class StepReport:
    """What a step did: each batch's result (the runner's, with the tokens sampled) and the batches that ended
    (finished or failed) in it (:meth:`Scheduler.update_from_output` names them)."""

    results: tuple[BatchResult, ...] = ()
    ended: tuple[RunningBatch, ...] = ()


class Scheduler:
    """Owns the queue, admission, prefill decisions and the running batches (the rules above).

    Args:
        policy: the batch keys and prefill-alone verdicts (the engine's :meth:`~InferenceEngine.batch_policy`).
        decode: token ids -> text (special tokens skipped), e.g. ``tokenizer.decode``: the rows' text, decoded a
            few recent tokens at a time; called under ``tokenizer_lock``.
        max_rows: rows running at once, over all batches (>= 1).
        token_budget: tokens one step computes at most, over all batches (0: no budget, or >= ``max_rows``): each
            running row's decode step counts one (a speculative step's tree nodes are not counted), the rest goes
            to prefill chunks, the batches' oldest prefills first, each prompt forward of ``r`` rows taking up to
            ``rest // r`` columns of what is left of it.
        kv_budget: the K/V memory budget of admission and preemption (rule 2c; None: rows are the only limit). It
            may be replaced between steps (e.g. lowered when free memory shrinks): the next schedule preempts to fit.
        memory: where the memory counters go (:class:`MemoryCounters`; default: this scheduler's own).
        join_padding_limit: the most cells (row x column) of left padding a group may add to a running batch of its
            key by joining it (:meth:`~kvboost_hf.kv_budget.BatchShape.join_padding`): a group that would add more (a
            long prompt joining short rows, or the reverse) starts a batch of its own, decoded by a forward of its own
            each step where the runner does not pack the batches' steps into one. The break-even is the model's weight
            bytes over its K/V bytes per token (one more forward reads the weights once more; the padding is read by
            every step). None: a group always joins (one batch per key).
        batch_window_s: how long the oldest pending group of a key waits for others before its batch forms
            (``skip_windows = True`` admits without waiting).
        tokenizer_lock: serialises ``decode`` with other threads using the same tokenizer (None: no lock).
        restart_after: context tokens past which a running row is prefilled again from its whole context (rule 2d;
            None: never).
    """

    def __init__(
        self,
        policy: BatchPolicy,
        *,
        decode: Callable[[list[int]], str],
        max_rows: int = DEFAULT_MAX_BATCH_SIZE,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        kv_budget: KVBudget | None = None,
        memory: MemoryCounters | None = None,
        join_padding_limit: int | None = None,
        batch_window_s: float = 0.0,
        tokenizer_lock: contextlib.AbstractContextManager | None = None,
        restart_after: int | None = None,
    ) -> None:
        for name, value in (("max_rows (max_batch_size)", max_rows), ("token_budget", token_budget)):
            if not is_integer(value):
                raise ConfigError(f"{name} must be a whole number, got {value!r}")
        check_bounds("Scheduler", [("batch_window_s", batch_window_s, 0.0, False)])
        if max_rows < 1:
            raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
        if token_budget < 0 or 0 < token_budget < max_rows:
            raise ConfigError(f"token_budget must be 0 (none) or >= max_rows={max_rows}, got {token_budget}")
        if join_padding_limit is not None and join_padding_limit < 0:
            raise ConfigError(f"join_padding_limit must be None (always join) or >= 0 cells, got {join_padding_limit}")
        self.policy = policy
        self.decode = decode
        self.tokenizer_lock = tokenizer_lock or contextlib.nullcontext()
        self.max_rows = max_rows
        self.token_budget = token_budget
        self.kv_budget = kv_budget
        self.memory = memory if memory is not None else MemoryCounters()
        self.join_padding_limit = join_padding_limit
        self.restart_after = restart_after
        self._admissions = 0
        self._batch_ids = itertools.count()
        self.batch_window_s = batch_window_s
        self._pending: list[RequestGroup] = []
        self._queue_lock = threading.Lock()
        self.running: list[RunningBatch] = []
        self.skip_windows = False

    # ------------------------------------------------------------------ queue
    def add(self, group: RequestGroup) -> None:
        """Queue ``group``; raises :class:`~kvboost_hf.core.errors.CapacityError` when it has more rows than
        ``max_rows`` or its K/V cannot fit the budget even alone (:meth:`alone_bytes`)."""
        if len(group.rows) > self.max_rows:
            raise CapacityError(f"a request needs 1 to max_rows={self.max_rows} rows, got {len(group.rows)}")
        if (error := self._never_fits(group)) is not None:
            raise error
        with self._queue_lock:
            self._pending.append(group)

    def alone_bytes(self, group: RequestGroup) -> int:
        """The projected K/V bytes of ``group``'s live rows in a batch of their own (0 without a K/V budget)."""
        if self.kv_budget is None:
            return 0
        return self.kv_budget.bytes(BatchShape().join(group.contexts))

    def _never_fits(self, group: RequestGroup) -> CapacityError | None:
        """The error refusing ``group`` when its K/V cannot fit the budget alone, else None."""
        if self.kv_budget is None or (needed := self.alone_bytes(group)) <= self.kv_budget.budget_bytes:
            return None
        return CapacityError(
            f"a request of {len(group.live_rows)} rows needs {needed} bytes of K/V (prompt and max tokens, "
            f"{self.kv_budget.bytes_per_token} bytes per token and row), over the K/V budget of "
            f"{self.kv_budget.budget_bytes} bytes"
        )

    @property
    def reserved_bytes(self) -> int:
        """The running batches' projected K/V bytes (0 without a K/V budget): see :mod:`kvboost_hf.kv_budget`."""
        if self.kv_budget is None:
            return 0
        return sum(self.kv_budget.bytes(batch.shape()) for batch in self.running)

    @property
    def pending(self) -> list[RequestGroup]:
        """The groups waiting for admission, oldest first (a copy)."""
        with self._queue_lock:
            return list(self._pending)

    @property
    def running_rows(self) -> int:
        """Rows in running batches, those whose prefill is under way included."""
        return sum(len(batch.rows) + len(batch.joining_rows) for batch in self.running)

    @property
    def idle(self) -> bool:
        """Nothing pending and nothing running."""
        return not self.pending and not self.running

    def next_deadline(self) -> float | None:
        """When (``time.perf_counter()``) the oldest pending group's window ends; None when nothing is pending."""
        with self._queue_lock:
            return min((group.arrival + self.batch_window_s for group in self._pending), default=None)

    # ------------------------------------------------------------------ the contract
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Admit what is ready and fits (groups cancelled while pending fail with :class:`RequestCancelled`), plan
        the admitted rows' prefills, and split the step's token budget: a decode step for every running row first,
        then chunks of the prefills, oldest first (:func:`split_budget`)."""
        now = time.perf_counter() if now is None else now
        self._restart_long_contexts()
        self._preempt()
        admitted: dict[int, tuple[bool, list[RequestGroup]]] = {}
        for key, batch, groups in self._admit(now):
            new = batch is None
            if batch is None:
                batch = RunningBatch(key, next(self._batch_ids))
                self.running.append(batch)
            for group in groups:
                group.admission, self._admissions = self._admissions, self._admissions + 1
            batch.admit(groups, now)
            admitted[id(batch)] = (new, groups)
        for batch_id, (new, groups) in admitted.items():
            batch = next(batch for batch in self.running if id(batch) == batch_id)
            rows = [row for group in groups for row in group.live_rows]
            try:
                prefills = self.policy.prefill_works(rows, batch.key.cache_salt)
            except Exception as error:  # e.g. the store could not be read: these groups fail, the batch goes on
                logger.exception("planning the prefill of %d rows failed", len(rows))
                batch.drop(groups, error)
                admitted[batch_id], prefills = (new, []), []
            batch.prefilling += [Prefilling(work, prompt_width(work)) for work in prefills]
        for batch in self.running:
            batch.drop_cancelled_prefills()
        prefilling = [entry for batch in self.running for entry in batch.prefilling]
        decode_rows = sum(len(batch.rows) for batch in self.running)
        columns = split_budget(self.token_budget, decode_rows, prefilling)
        chunks = {id(entry): PrefillChunk(entry.work, n) for entry, n in zip(prefilling, columns, strict=True) if n}
        for entry, n in zip(prefilling, columns, strict=True):
            entry.left -= n
        work = []
        for batch in self.running:
            new, groups = admitted.get(id(batch), (False, []))
            planned = tuple(chunks[id(entry)] for entry in batch.prefilling if id(entry) in chunks)
            leaving, batch.leaving = tuple(batch.leaving), []
            work.append(BatchWork(batch.id, batch.key, new, tuple(groups), bool(batch.rows), planned, leaving))
        if self.kv_budget is not None:
            self.memory.reserve(self.reserved_bytes)
        return SchedulerOutput(tuple(work))

    def update_from_output(self, report: StepReport) -> StepReport:
        """Take the runner's ``report`` of a step: each batch's completed prefills (their rows run from now on), its
        sampled tokens appended to its rows, the rows that stop ended (:func:`stop_reason`; tokens after the one that
        ends a row are dropped), each token reported to its group; a batch whose step raised fails
        (:meth:`RunningBatch.fail`). Retires the batches that ended (the runner's loops of those, and the ended rows
        of the others, are the caller's to release: :class:`~kvboost_hf.engine_core.EngineCore`). Returns
        ``report`` with them."""
        batches = {batch.id: batch for batch in self.running}
        for result in report.results:
            batch = batches[result.work.batch_id]
            if result.error is not None:
                batch.fail(result.error)
                continue
            batch.take(result)
            for output in result.outputs:
                append_output(output, self.decode, batch.owner(output.row).on_token, self.tokenizer_lock)
            batch.rows = [row for row in batch.rows if not row.finished]
        ended = tuple(batch for batch in self.running if batch.done)
        self.running = [batch for batch in self.running if not batch.done]
        return StepReport(report.results, ended)

    def record_widths(self, columns: dict[int, int]) -> None:
        """Take the runner's widths of the running batches (batch id -> columns of K/V each running row holds),
        which the K/V projection counts (:meth:`RunningBatch.shape`)."""
        for batch in self.running:
            batch.columns = columns.get(batch.id, 0)
        if not self.running:
            self.memory.reserve(0)  # nothing runs: nothing is reserved (until the next schedule)

    def abort(self, error: BaseException) -> tuple[RunningBatch, ...]:
        """Fail every pending group with ``error`` and end every running row now (cancelled, reported once to its
        group); a group whose prefill is under way fails with ``error`` too. Returns the batches ended (their
        runner's loops are the caller's to release: what was computed is stored then)."""
        with self._queue_lock:
            waiting, self._pending = self._pending, []
        for group in waiting:
            group.on_fail(error)
        for batch in self.running:
            for row in batch.rows:
                row.cancel()
                batch.owner(row).on_token(row)
            for group in {id(batch.owner(row)): batch.owner(row) for row in batch.joining_rows}.values():
                for row in group.rows:
                    row.cancel()
                group.on_fail(error)
            batch.prefilling, batch.rows = [], []
        ended, self.running = tuple(self.running), []
        return ended

    # ------------------------------------------------------------------ decisions
    def _preempt(self) -> None:
        """While the running batches' projected K/V exceed the budget, preempt the newest admitted group (with
        those sharing a prefill under way with it) and queue them again at the front, oldest first (rule 2c)."""
        if self.kv_budget is None:
            return
        preempted: list[RequestGroup] = []
        while self.reserved_bytes > self.kv_budget.budget_bytes:
            admitted = [group for batch in self.running for group in batch.groups if not group.done]
            newest = max(admitted, key=lambda group: group.admission)  # some group holds the bytes reserved
            assert newest.batch is not None, "an admitted group has a batch"
            taken = newest.batch.preempt(newest)
            self.memory.preemptions += len(taken)
            self.memory.rows_preempted += sum(len(group.live_rows) for group in taken)
            preempted += taken
            logger.info("preempted %d request(s) to keep K/V within %d bytes", len(taken), self.kv_budget.budget_bytes)
        if preempted:
            with self._queue_lock:
                self._pending[:0] = sorted(preempted, key=lambda group: group.admission)

    def _restart_long_contexts(self) -> None:
        """Preempt the groups of running rows whose context passed :attr:`restart_after` tokens with K/V computed at
        or below it, and queue them again at the front, oldest first (rule 2d; each row once)."""
        limit = self.restart_after
        if limit is None:
            return
        restarted: list[RequestGroup] = []
        for batch in self.running:
            running = {id(row) for row in batch.rows}
            for group in list(batch.groups):
                rows = [row for row in group.live_rows if id(row) in running]
                if group.done or not any(
                    row.context_length > limit >= len(row.request.prompt_ids) and not row.restarted for row in rows
                ):
                    continue
                taken = batch.preempt(group)
                for member in taken:
                    for row in member.live_rows:
                        row.restarted = True
                restarted += taken
        if restarted:
            logger.info("prefilling %d request(s) again past %d tokens (long RoPE factors)", len(restarted), limit)
            with self._queue_lock:
                self._pending[:0] = sorted(restarted, key=lambda group: group.admission)

    def _past_restart(self, rows: Sequence[DecodeRow]) -> bool:
        """Whether any of ``rows`` holds more context (tokens) than :attr:`restart_after` (rule 2e's side)."""
        limit = self.restart_after
        return limit is not None and any(row.context_length > limit for row in rows)

    def _admit(self, now: float) -> list[tuple[BatchKey, RunningBatch | None, list[RequestGroup]]]:
        """Pending groups that are ready and fit, by key: ``(key, running batch to join or None, groups)``."""
        with self._queue_lock:
            cancelled = [group for group in self._pending if group.cancel is not None and group.cancel.is_set()]
            self._pending = [group for group in self._pending if group not in cancelled]
            refused = [(group, error) for group in self._pending if (error := self._never_fits(group)) is not None]
            dropped = {id(group) for group, _ in refused}
            self._pending = [group for group in self._pending if id(group) not in dropped]
            formed = self._ready(now)
            taken = {id(group) for _, _, groups in formed for group in groups}
            self._pending = [group for group in self._pending if id(group) not in taken]
        for group in cancelled:
            group.end_cancelled("it started")
        for group, error in refused:  # the budget was lowered under it after it was queued
            group.on_fail(error)
        return formed

    def _ready(self, now: float) -> list[tuple[BatchKey, RunningBatch | None, list[RequestGroup]]]:
        """The pending groups to admit now (rule 2), by key: each to the batch :meth:`_lane_for` picks (called with
        the queue locked)."""
        by_key: dict[BatchKey, list[RequestGroup]] = {}
        for group in self._pending:  # insertion order = oldest first
            by_key.setdefault(self.policy.key(group.cache_salt), []).append(group)
        free = self.max_rows - self.running_rows
        budget = self.kv_budget
        spare = 0 if budget is None else budget.budget_bytes - self.reserved_bytes
        formed = []
        for key, members in by_key.items():
            lanes = [_Lane(batch, batch.shape()) for batch in self.running if not batch.done and batch.key == key]
            window_over = now >= members[0].arrival + self.batch_window_s
            ready = bool(lanes) or sum(len(g.live_rows) for g in members) >= self.max_rows or window_over
            if not (ready or self.skip_windows):
                continue
            for group in members:
                if len(group.live_rows) > free:
                    break
                lane = self._lane_for(lanes, group)
                grown = lane.shape.join(group.contexts)
                if budget is not None:
                    more = budget.bytes(grown) - budget.bytes(lane.shape)
                    if more > spare:
                        if not group.waited_for_memory:
                            group.waited_for_memory = True
                            self.memory.admissions_deferred += 1
                        break
                    spare -= more
                if lane not in lanes:
                    lanes.append(lane)
                lane.shape = grown
                lane.groups.append(group)
                free -= len(group.live_rows)
            formed += [(key, lane.batch, lane.groups) for lane in lanes if lane.groups]
        return formed

    def _lane_for(self, lanes: list[_Lane], group: RequestGroup) -> _Lane:
        """The batch ``group`` joins among ``lanes`` (its key's running batches, then those formed in this schedule),
        or a new one (not yet in ``lanes``): with no join limit the first; else the one whose padding grows least
        (:meth:`~kvboost_hf.kv_budget.BatchShape.join_padding`) while it grows by at most ``join_padding_limit``;
        under :attr:`restart_after`, among the batches on the group's side of it only (rule 2e)."""
        if self.restart_after is not None:  # rule 2e: only batches on the group's side of it
            side = self._past_restart(group.live_rows)
            lanes = [lane for lane in lanes if self._past_restart(lane.live_rows()) == side]
        if not lanes:
            return _Lane(None, BatchShape())
        if self.join_padding_limit is None:
            return lanes[0]
        padding, best = min((lane.shape.join_padding(group.contexts), i) for i, lane in enumerate(lanes))
        return lanes[best] if padding <= self.join_padding_limit else _Lane(None, BatchShape())


@dataclass(eq=False)
class _Lane:
    """A batch admission may add groups to: a running one or one formed in this schedule (``batch`` None), its shape
    with the groups chosen so far (``groups``) joined."""

    batch: RunningBatch | None
    shape: BatchShape
    groups: list[RequestGroup] = field(default_factory=list)

    def live_rows(self) -> list[DecodeRow]:
        """The rows it would run: its running batch's groups' and the chosen groups' live rows."""
        groups = [*(self.batch.groups if self.batch is not None else ()), *self.groups]
        return [row for group in groups for row in group.live_rows]


def prompt_width(work: PrefillWork) -> int:
    """Columns of ``work``'s left-padded prompt forward before stored chunks are loaded: its longest context (a
    prompt, and a preempted row's tokens)."""
    return max(row.context_length for row in work.rows)


def split_budget(budget: int, decode_rows: int, prefilling: Sequence[Prefilling]) -> list[int]:
    """Columns of each prefill to compute in one step under a token ``budget`` (0: none: each prefill gets all its
    ``left`` columns) after ``decode_rows`` decode steps of one token: in order, each prefill takes what is left of
    the budget divided by its forward rows, at most its ``left`` columns; a prefill that gets no column waits (0).

    Invariants: with a budget, ``decode_rows + sum(forward_rows * columns) <= budget`` when ``decode_rows <=
    budget``; every prefill gets ``0 <= columns <= left``; the first prefill gets at least one column when
    ``decode_rows + its forward rows <= budget``."""
    if not budget:
        return [entry.left for entry in prefilling]
    rest = budget - decode_rows
    columns = []
    for entry in prefilling:
        take = max(0, min(entry.left, rest // entry.forward_rows))
        rest -= take * entry.forward_rows
        columns.append(take)
    return columns


def stop_reason(row: DecodeRow) -> str | None:
    """Why ``row`` stops after its newest token, or None: ``"stop"`` (a stop string in its text, or an end token),
    ``"length"`` (its budget is spent), ``"cancelled"`` (its cancel event is set); checked in that order."""
    if row.stop_string_found or row.tokens[-1] in row.end_ids:
        return "stop"
    if len(row.tokens) >= row.request.max_new_tokens:
        return "length"
    if row.request.cancel is not None and row.request.cancel.is_set():
        return "cancelled"
    return None


def append_output(
    output: RowOutput,
    decode: Callable[[list[int]], str],
    on_token: Callable[[DecodeRow], None],
    tokenizer_lock: contextlib.AbstractContextManager | None = None,
) -> None:
    """Append ``output``'s tokens to its row one by one (``decode`` under ``tokenizer_lock``: ids -> text), each
    reported through ``on_token``, until the row stops (:func:`stop_reason`): the tokens after that one are
    dropped, and a verify round is counted with the tokens kept."""
    row = output.row
    for index, token in enumerate(output.tokens):
        logprob = output.logprobs[index] if output.logprobs else None
        with tokenizer_lock or contextlib.nullcontext():
            row.append(token, decode, logprob, output.at)
        if (reason := stop_reason(row)) is not None:
            row.finish(reason)
        if output.draft is not None and (row.finished or index == len(output.tokens) - 1):
            row.record_round(output.draft, index + 1)
        on_token(row)
        if row.finished:
            return
