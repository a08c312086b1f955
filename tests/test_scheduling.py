"""Tests of :mod:`kvboost_hf.scheduling`.

First the scheduler's contract without a model: admission (keys, windows, row budget, oldest first, joins), prefill
plans (rows prefilled together or alone, repeated choices, shared prefixes), cancellation, failures kept to their
batch, and the end of every batch reported once; the model runner is a recording fake. Then the one batching policy
of ``generate_many`` and the server through the engine on a tiny model: segment prompts and requests whose reuse
needs repair keep it, in batches. The decode loop's own behaviour is tested in test_decode.py."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest
import torch
from conftest import make_tiny_model, noisy_copy
from helpers import FakeLoop, word_tokenizer, words
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from oracle import GREEDY, cache_reference, engine_reference

from kvboost_hf import KVBoost
from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.errors import CapacityError, ConfigError
from kvboost_hf.core.keys import KeySpace
from kvboost_hf.engine_core import EngineCore
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, PrefillWork, SharedPrefix
from kvboost_hf.hf.forward_routes import ForwardRouter
from kvboost_hf.hf.graphs import GraphConfig
from kvboost_hf.hf.models import forward_read_bytes
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.hf.speculative import DraftConfig
from kvboost_hf.kv_budget import BatchShape, KVBudget
from kvboost_hf.runner import ModelRunner
from kvboost_hf.scheduling import (
    BatchPolicy,
    Prefilling,
    RequestCancelled,
    RequestGroup,
    Scheduler,
    padding_groups,
    prefill_works,
    split_budget,
)
from kvboost_hf.store.chunk_store import ChunkStore

CHUNK = 4
SPACE = KeySpace("digest", "torch.float32", ChunkingConfig(CHUNK))


class Harness:
    """A scheduler and a runner of fake loops (``core`` steps them), with every loop, failure and ended batch
    recorded."""

    def __init__(
        self,
        max_rows: int = 4,
        window_s: float = 0.0,
        fail_salt: str | None = "never",
        store=None,
        script=None,
        token_budget: int = 0,
        kv_budget: KVBudget | None = None,
        join_padding_limit: int | None = None,
    ) -> None:
        self.loops: list[FakeLoop] = []
        self.failures: list[tuple[RequestGroup, BaseException]] = []
        self.done: list[FakeLoop] = []
        policy = BatchPolicy(store if store is not None else ChunkStore(), SPACE, "chunk_kv_reuse")

        def new_loop(key):
            self.loops.append(FakeLoop(fail_after=0 if key.cache_salt == fail_salt else None, script=script))
            return self.loops[-1]

        def on_close(loop):
            self.done.append(loop)
            return {"steps": loop.steps}

        self.scheduler = Scheduler(
            policy, decode=lambda ids: "".join(f"<{t}>" for t in ids), max_rows=max_rows, token_budget=token_budget,
            kv_budget=kv_budget, join_padding_limit=join_padding_limit, batch_window_s=window_s,
        )  # fmt: skip
        self.runner = ModelRunner(new_loop, on_close=on_close)
        self.core = EngineCore(self.scheduler, self.runner)

    def group(
        self, *prompts, tokens: int = 3, salt: str | None = None, arrival: float = 0.0, starts=()
    ) -> RequestGroup:
        requests = [
            DecodeRequest(prompt_ids=list(p), max_new_tokens=tokens, segment_starts=tuple(starts)) for p in prompts
        ]
        group = RequestGroup(
            DecodeLoop.rows_for(requests, set()),
            salt,
            on_fail=lambda error: self.failures.append((group, error)),
            cancel=threading.Event(),
            arrival=arrival,
        )
        self.scheduler.add(group)
        return group


def test_groups_of_one_key_share_a_batch_joining_it_while_it_runs_and_tenants_get_their_own():
    h = Harness()
    first = h.group([1, 2, 3])
    output = h.scheduler.schedule(now=0.0)
    assert [(w.new, len(w.prefills)) for w in output.work] == [(True, 1)]
    h.core.execute(output)
    second, other = h.group([4, 5]), h.group([6], salt="tenant-b")
    report = h.core.step(now=0.0)
    assert len(h.loops) == 2 and first.batch is second.batch is not other.batch
    assert [w.rows for w in h.loops[0].works] == [tuple(first.rows), tuple(second.rows)]  # joined, prefilled apart
    assert [(r.work.new, r.computed_tokens) for r in report.results] == [(False, 2), (True, 1)]
    h.core.run()
    assert h.scheduler.idle and sorted(map(id, h.done)) == sorted(map(id, h.loops))  # each ended once
    # the join step decodes the running row too: first's tokens 2-3 and second's 2-3 take three steps, not two
    assert first.batch.decode_counts == {"steps": 3} and all(g.done for g in (first, second, other))


@pytest.mark.parametrize("limit", [None, 86, 87])
def test_a_join_that_would_pad_the_running_rows_past_the_limit_starts_a_batch_of_its_own(limit):
    """Three 1-token prompts run (1 column wide after their prefill); a 30-token prompt joining would widen each of
    them by 29 columns (87 cells of padding): with a join padding limit below that it starts a second batch of the
    key, at the limit or without one it joins. A 2-token prompt arriving next joins the narrow batch, 2 columns wide
    by then (padding 0, against 1 x (30 - 2) = 28 for the wide one). Every row gets its tokens, a step decoding both
    batches."""
    h = Harness(max_rows=6, join_padding_limit=limit)
    running = h.group([1], [2], [3], tokens=6)
    h.core.step(now=0.0)
    long = h.group(list(range(30)), tokens=3)
    h.core.step(now=0.0)
    assert (long.batch is running.batch) == (limit is None or limit >= 87)
    short = h.group([4, 5], tokens=2)
    report = h.core.step(now=0.0)
    assert short.batch is running.batch and long.batch.key == running.batch.key
    if long.batch is not running.batch:
        assert len(h.loops) == 2 and h.loops[1].works == [h.loops[1].works[0]]  # the long prompt alone there
        assert [len(result.outputs) for result in report.results] == [3 + 1, 1]  # each batch decoded this step
    h.core.run()
    assert all(group.done for group in (running, long, short)) and h.failures == []
    assert [len(row.tokens) for group in (running, long, short) for row in group.rows] == [6, 6, 6, 3, 2]


def test_a_join_padding_limit_below_zero_is_refused():
    with pytest.raises(ConfigError, match="join_padding_limit"):
        Harness(join_padding_limit=-1)


def test_a_new_batch_waits_for_its_window_unless_full_or_windows_are_skipped():
    h = Harness(max_rows=3, window_s=10.0)
    h.group([1, 2], arrival=0.0)
    assert h.scheduler.schedule(now=5.0).work == () and h.scheduler.next_deadline() == 10.0
    assert len(h.scheduler.schedule(now=10.0).work) == 1
    h = Harness(max_rows=3, window_s=10.0)
    h.group([1], [1], [1], arrival=0.0)  # three rows fill max_rows
    assert len(h.scheduler.schedule(now=0.0).work) == 1
    h = Harness(max_rows=3, window_s=10.0)
    h.group([1], arrival=0.0)
    h.scheduler.skip_windows = True
    assert len(h.scheduler.schedule(now=0.0).work) == 1


def test_rows_stay_within_max_rows_and_groups_are_admitted_oldest_first():
    h = Harness(max_rows=3)
    first, second, third = h.group([1], [1], tokens=3), h.group([2], [2]), h.group([3])
    h.core.step(now=0.0)  # first's prefill: its first tokens
    assert first.batch is not None and second.batch is None and third.batch is None  # second does not fit: waits,
    assert h.scheduler.running_rows == 2  # and the younger third waits behind it
    h.core.step(now=0.0)
    h.core.step(now=0.0)  # first gets its third token: it finishes
    assert second.batch is None
    h.core.step(now=0.0)
    assert second.batch is not None and third.batch is not None and h.scheduler.running_rows == 3
    with pytest.raises(ValueError, match="max_rows=3"):
        h.group([1], [1], [1], [1])


def test_a_group_cancelled_while_pending_fails_with_request_cancelled_and_never_runs():
    h = Harness()
    group = h.group([1, 2])
    group.cancel.set()
    assert h.scheduler.schedule(now=0.0).work == ()
    assert [(g, type(e)) for g, e in h.failures] == [(group, RequestCancelled)] and not h.loops


def test_a_failing_batch_fails_its_groups_only():
    h = Harness(fail_salt="bad")
    bad, good = h.group([1, 2], tokens=5, salt="bad"), h.group([3], tokens=5)
    h.core.step(now=0.0)
    report = h.core.step(now=0.0)
    assert [type(r.error) for r in report.results] == [RuntimeError, type(None)]
    assert [g for g, _ in h.failures] == [bad] and h.loops[0].closed and bad.batch in report.ended
    h.core.run()
    assert good.done and not h.loops[1].closed


def test_a_failed_prefill_plan_fails_the_admitted_groups_and_the_batch_goes_on():
    class BrokenStore(ChunkStore):
        def contains_many(self, keys):
            raise ConnectionError("store unreachable")

    h = Harness(store=BrokenStore())
    running = h.group([9, 9], tokens=4)
    h.core.step(now=0.0)  # one prompt alone: no store read
    joining = h.group([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])  # two prompts: the plan reads the store
    h.core.step(now=0.0)
    assert [(g, type(e)) for g, e in h.failures] == [(joining, ConnectionError)] and joining.batch is None
    h.core.run()
    assert running.done and len(h.loops[0].works) == 1


@pytest.mark.parametrize("cancelled_while", ["queued", "prefilled"])
def test_a_preempted_group_cancelled_before_it_resumes_ends_with_its_tokens(cancelled_while):
    """A group preempted after taking tokens, then cancelled while queued again or while its prefill runs again,
    failed with "cancelled before it started" (or "before its first token") after its tokens had been reported:
    it ended twice. Its rows now end ``"cancelled"`` with their tokens, reported once each, and it does not fail
    (found by the K/V budget state machine)."""
    h = Harness(max_rows=4, token_budget=6, kv_budget=KVBudget(60, 1))
    now = itertools.count(1.0)
    h.group([0] * 7, tokens=3)
    h.group([0], tokens=1)
    for _ in range(2):
        h.core.step(now=next(now))
    preempted = h.group([0], [0], tokens=3)
    for _ in range(2):
        h.core.step(now=next(now))
    h.scheduler.kv_budget = KVBudget(12, 1)
    late = h.group([0], tokens=1)  # prefilled together with the preempted group's rows when they resume
    h.core.step(now=next(now))
    if cancelled_while == "prefilled":
        h.core.step(now=next(now))
        late.cancel.set()  # a prefill under way is dropped once all its groups are cancelled
    assert all(row.tokens and row.preemptions == 1 for row in preempted.rows)
    assert (preempted in h.scheduler.pending) == (cancelled_while == "queued")
    reported: list = []
    preempted.on_token = reported.append
    preempted.cancel.set()
    h.scheduler.kv_budget = KVBudget(1 << 20, 1)
    h.core.run()
    failed = {id(group): str(error) for group, error in h.failures}
    assert id(preempted) not in failed
    if cancelled_while == "prefilled":
        assert failed[id(late)] == "cancelled before its first token"
    assert [row.finish_reason for row in preempted.rows] == ["cancelled", "cancelled"]
    assert reported == preempted.rows and all(row.tokens for row in preempted.rows)


def test_abort_fails_what_waits_and_cancels_what_runs():
    h = Harness(max_rows=1)
    running, waiting = h.group([1], tokens=9), h.group([2])
    h.core.step(now=0.0)
    h.core.abort(RuntimeError("shutdown"))
    assert running.rows[0].finish_reason == "cancelled" and [g for g, _ in h.failures] == [waiting]
    assert h.scheduler.idle and h.done == h.loops


def test_run_admits_what_waits_without_waiting_for_its_window():
    """``run()`` skips windows: with an hour's batch window, a queued group is admitted and finished at once (a
    scheduler that waited for the window would still be spinning when the thread is joined)."""
    h = Harness(window_s=3600.0)
    group = h.group([1, 2], arrival=time.perf_counter())
    runner = threading.Thread(target=h.core.run, daemon=True)
    runner.start()
    runner.join(30)
    assert not runner.is_alive() and group.done and h.scheduler.idle
    assert not h.scheduler.skip_windows  # restored: a later step waits for windows again


def test_the_scheduler_appends_sampled_tokens_and_decides_every_stop():
    """The runner only samples (here three tokens per call, as a verify round); the scheduler appends them, ends
    each row at its stop string, end token, budget or cancellation, drops what follows, reports every kept token,
    and counts the round with the tokens kept."""
    h = Harness(script=lambda row: (5, 6, 7))
    seen: list[tuple[int, int]] = []
    requests = [
        DecodeRequest(prompt_ids=[1], max_new_tokens=9, stop=("<6>",)),
        DecodeRequest(prompt_ids=[2], max_new_tokens=9, sampling=SamplingConfig(stop_token_ids=(6,))),
        DecodeRequest(prompt_ids=[3], max_new_tokens=4),
        DecodeRequest(prompt_ids=[4], max_new_tokens=9, cancel=threading.Event()),
    ]
    rows = DecodeLoop.rows_for(requests, set())
    requests[3].cancel.set()
    h.scheduler.add(RequestGroup(rows, on_token=lambda row: seen.append((rows.index(row), row.tokens[-1]))))
    report = h.core.step(now=0.0)
    assert [output.tokens for output in report.results[0].outputs] == [(5, 6, 7)] * 4  # what the runner sampled
    stopped, ended, budget, cancelled = rows
    assert (stopped.tokens, stopped.text, stopped.finish_reason) == ([5, 6], "<5>", "stop")
    assert (ended.tokens, ended.text, ended.finish_reason) == ([5, 6], "<5><6>", "stop")
    assert (cancelled.tokens, cancelled.finish_reason) == ([5], "cancelled")
    assert (budget.tokens, budget.finish_reason) == ([5, 6, 7], None) and budget.text == "<5><6><7>"
    assert (stopped.draft_accepted, stopped.draft_rejected, stopped.draft_rounds) == (1, 0, [(1, False)])
    assert budget.draft_rounds == [(2, False)]
    h.core.run()
    assert (budget.tokens, budget.finish_reason) == ([5, 6, 7, 5], "length")
    assert seen == [(0, 5), (0, 6), (1, 5), (1, 6), (2, 5), (2, 6), (2, 7), (3, 5), (2, 5)]
    assert h.loops[0].done and h.scheduler.idle


def test_a_long_prompt_joins_in_chunks_while_the_running_rows_take_a_token_every_step():
    """Token budget 20, three running rows: each step decodes them first (3 tokens), and the 100-token prompt that
    joins gets the 17 columns left, until its last 15; its first token comes with the last chunk. Its row counts
    against ``max_rows`` meanwhile, so a group that would exceed it waits."""
    h = Harness(max_rows=4, token_budget=20)
    running = h.group([1], [2], [3], tokens=12)  # three prompts: one forward of three rows
    h.core.step(now=0.0)
    joining = h.group(list(range(100)), tokens=2)
    waiting = h.group([7])
    for step in range(6):
        h.core.step(now=0.0)
        assert [len(row.tokens) for row in running.rows] == [2 + step] * 3
        assert waiting.batch is None and h.scheduler.running_rows == 4
        assert joining.rows[0].tokens == ([1] if step == 5 else [])
    assert [columns for work, columns in h.loops[0].chunks if work.rows == tuple(joining.rows)] == [17] * 5 + [15]
    h.core.run()
    assert all(group.done for group in (running, joining, waiting))


def test_abort_fails_a_group_whose_prefill_is_under_way():
    h = Harness(max_rows=2, token_budget=4)
    running = h.group([1], tokens=9)
    h.core.step(now=0.0)
    joining = h.group(list(range(30)))
    h.core.step(now=0.0)
    assert joining.batch is not None and not joining.rows[0].tokens  # 3 of its 30 columns computed
    h.core.abort(RuntimeError("shutdown"))
    assert [g for g, _ in h.failures] == [joining] and running.rows[0].finish_reason == "cancelled"
    assert h.scheduler.idle and h.done == h.loops and h.loops[0].done


def test_a_group_cancelled_while_its_prompt_is_prefilled_in_chunks_fails_and_its_chunks_stop():
    h = Harness(max_rows=2, token_budget=4)
    running = h.group([1], tokens=6)
    h.core.step(now=0.0)
    joining = h.group(list(range(30)))
    h.core.step(now=0.0)
    joining.cancel.set()
    h.core.step(now=0.0)
    assert [(g, type(e)) for g, e in h.failures] == [(joining, RequestCancelled)]
    assert len([columns for work, columns in h.loops[0].chunks if work.rows == tuple(joining.rows)]) == 1
    assert joining.rows[0].finish_reason == "cancelled" and not joining.rows[0].tokens
    h.core.run()
    assert running.done and len(running.rows[0].tokens) == 6 and h.scheduler.idle and h.loops[0].done


def test_without_a_token_budget_a_join_is_prefilled_whole_after_the_running_rows_step():
    h = Harness(max_rows=4)
    running = h.group([1], tokens=5)
    h.core.step(now=0.0)
    joining = h.group(list(range(100)), tokens=2)
    report = h.core.step(now=0.0)
    work = report.results[0].work
    assert work.decode and [chunk.columns for chunk in work.prefills] == [100]  # the whole prompt in this step
    assert len(running.rows[0].tokens) == 2 and joining.rows[0].tokens == [1]


@pytest.mark.parametrize("budget", [-1, 1, 3])
def test_a_token_budget_below_max_rows_is_refused(budget):
    with pytest.raises(ConfigError, match="token_budget"):
        Harness(max_rows=4, token_budget=budget)


def prefill_entry(rows: int, repeat: bool, left: int) -> Prefilling:
    """A prefill under way of ``rows`` rows (one prompt when ``repeat``, else one each) with ``left`` columns."""
    prompts = [[1]] * rows if repeat else [[index + 1] for index in range(rows)]
    decoded = DecodeLoop.rows_for([DecodeRequest(prompt_ids=p, max_new_tokens=1) for p in prompts], set())
    return Prefilling(PrefillWork(tuple(decoded), repeat=repeat and rows > 1), left)


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 64),
    decode_rows=st.integers(0, 8),
    prefills=st.lists(st.tuples(st.integers(1, 4), st.booleans(), st.integers(1, 40)), max_size=5),
)
def test_split_budget_decodes_first_then_fills_prefills_oldest_first_within_the_budget(budget, decode_rows, prefills):
    """Without a budget every prefill gets all its columns; with one, the decode rows' tokens plus each prefill's
    forward rows x columns stay within it, no prefill gets more than it has left, and a prefill that gets less
    than that leaves less than one column of its forward rows for those after it (oldest first)."""
    assume(budget == 0 or budget >= decode_rows)  # the scheduler's rule: a budget is at least max_rows
    entries = [prefill_entry(rows, repeat, left) for rows, repeat, left in prefills]
    columns = split_budget(budget, decode_rows, entries)
    lefts = [left for _, _, left in prefills]
    if budget == 0:
        assert columns == lefts
        return
    widths = [1 if repeat else rows for rows, repeat, _ in prefills]
    assert all(0 <= n <= left for n, left in zip(columns, lefts, strict=True))
    assert decode_rows + sum(w * n for w, n in zip(widths, columns, strict=True)) <= budget
    rest = budget - decode_rows
    for width, n, left in zip(widths, columns, lefts, strict=True):
        rest -= width * n
        assert n == left or rest < width, "a prefill took less than it could"


prompt_pool = st.lists(st.integers(0, 2), min_size=1, max_size=11)  # few tokens: prompts share prefixes often


def longest_shared_prefix(members: list[list[int]]) -> tuple[int, ...]:
    """The longest prefix of whole ``CHUNK``-token chunks that every one of ``members`` starts with and is longer
    than (a prompt's last token is always computed), written out here."""
    size = 0
    while all(len(p) > size + CHUNK and p[: size + CHUNK] == members[0][: size + CHUNK] for p in members):
        size += CHUNK
    return tuple(members[0][:size])


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(prompt_pool, min_size=1, max_size=6),
    alone_mask=st.lists(st.booleans(), min_size=6, max_size=6),
    reuse=st.booleans(),
    slack=st.integers(0, 6),
)
@example(prompts=[[0, 0, 0, 0], [0, 0, 0, 0, 0]], alone_mask=[False] * 6, reuse=True, slack=0)  # a whole-prompt prefix
def test_prefill_plans_cover_every_row_once_with_the_scheduling_rules(prompts, alone_mask, reuse, slack):
    """Every row is in exactly one work; the rows prefilled together come first, narrowest first, in works whose
    widest row is at most ``max(narrowest, slack)`` tokens longer than the narrowest; each prompt named alone gets a
    work of its own after them; rows of one prompt share a work, repeated when it holds nothing else; the shared
    prefixes are, for each group of prompts the together works compute (a repeated one once) starting with the same
    chunk, the longest chunk-aligned prefix they share, given to the first work holding one of them (which computes
    it once; the others load it)."""
    rows = DecodeLoop.rows_for([DecodeRequest(prompt_ids=p, max_new_tokens=1) for p in prompts], set())
    named = {tuple(p) for p, alone in zip(prompts, alone_mask, strict=False) if alone}
    works = prefill_works(
        rows, ChunkingConfig(CHUNK), reuse=reuse, alone=lambda ids, starts: tuple(ids) in named, slack=slack
    )
    assert sorted(id(row) for work in works for row in work.rows) == sorted(map(id, rows))
    prompt_of = {id(row): tuple(row.request.prompt_ids) for row in rows}
    home = {prompt_of[id(row)]: set() for row in rows}
    for index, work in enumerate(works):
        for row in work.rows:
            home[prompt_of[id(row)]].add(index)
    assert all(len(indices) == 1 for indices in home.values()), "rows of one prompt share a work"
    distinct = set(home)
    alone_prompts = named & distinct if len(distinct) > 1 else set()
    together_works = works[: len(works) - len(alone_prompts)]
    assert [{prompt_of[id(row)] for row in work.rows} for work in works[len(together_works) :]] == [
        {p} for p in dict.fromkeys(tuple(p) for p in prompts) if p in alone_prompts
    ]
    narrowest = [min(len(row.request.prompt_ids) for row in work.rows) for work in together_works]
    assert narrowest == sorted(set(narrowest)), "narrowest first, each length in one work"
    for work, low in zip(together_works, narrowest, strict=True):
        assert max(len(row.request.prompt_ids) for row in work.rows) - low <= max(low, slack)
    computed = []  # (work index, prompt) of each prompt a together work's forward computes
    for index, work in enumerate(works):
        prompts_of = [list(row.request.prompt_ids) for row in work.rows]
        assert work.repeat == (len(work.rows) > 1 and len({tuple(p) for p in prompts_of}) == 1)
        if index < len(together_works):
            computed += [(index, p) for p in (prompts_of[:1] if work.repeat else prompts_of)]
        for prefix in work.shared_prefixes:  # counted for the first row starting with it
            size = len(prefix.tokens)
            assert prefix.row == min(i for i, p in enumerate(prompts_of) if p[:size] == list(prefix.tokens))
    expected: dict[int, set[tuple[int, ...]]] = {index: set() for index in range(len(works))}
    if reuse:
        by_first: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for index, p in computed:
            if len(p) >= CHUNK:
                by_first.setdefault(tuple(p[:CHUNK]), []).append((index, p))
        for members in by_first.values():
            if len(members) > 1 and (prefix := longest_shared_prefix([p for _, p in members])):
                expected[min(index for index, _ in members)].add(prefix)
    assert {index: {p.tokens for p in work.shared_prefixes} for index, work in enumerate(works)} == expected


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), slack=st.integers(0, 80))
def test_padding_groups_bound_each_forwards_padding_by_its_real_tokens(lengths, slack):
    """Every row is in one group, in its input order, and its left padding (its group's widest less its length) is
    at most its length or ``slack``; the groups are narrowest first and disjoint in length (rows of one length share
    a group)."""
    rows = DecodeLoop.rows_for([DecodeRequest(prompt_ids=[1] * n, max_new_tokens=1) for n in lengths], set())
    groups = padding_groups(rows, slack)
    assert sorted(id(row) for group in groups for row in group) == sorted(map(id, rows))
    position = {id(row): index for index, row in enumerate(rows)}
    for group in groups:
        assert [position[id(row)] for row in group] == sorted(position[id(row)] for row in group)
        sizes = [row.context_length for row in group]
        assert all(max(sizes) - n <= max(n, slack) for n in sizes)  # each row's padding
    for narrower, wider in itertools.pairwise(groups):
        assert max(row.context_length for row in narrower) < min(row.context_length for row in wider)


class SchedulerMachine(RuleBasedStateMachine):
    """Random queues, steps, cancellations and failing batches under a token budget of 6 (prompts up to 9 tokens
    are prefilled in chunks): every group ends exactly once (finished or failed), rows never exceed ``max_rows``
    nor a step's tokens the budget, a group runs in one batch only, and every batch's end is reported once."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(max_rows=4, window_s=0.0, fail_salt="bad", token_budget=6)
        self.groups: list[RequestGroup] = []
        self.now = 0.0

    @rule(
        rows=st.integers(1, 3),
        tokens=st.integers(1, 4),
        salt=st.sampled_from([None, "tenant-b", "bad"]),
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    )
    def add(self, rows, tokens, salt, prompt):
        self.groups.append(self.h.group(*[prompt] * rows, tokens=tokens, salt=salt, arrival=self.now))

    @rule()
    def step(self):
        self.now += 1.0
        scheduler = self.h.scheduler
        output = scheduler.schedule(now=self.now)
        decoded = sum(  # the rows preempted now leave before the forward
            len(self.h.runner.loops[work.batch_id].running) - len(work.preempted) for work in output.work if work.decode
        )
        prefilled = sum(
            (1 if chunk.work.repeat else len(chunk.work.rows)) * chunk.columns
            for work in output.work
            for chunk in work.prefills
        )
        assert decoded + prefilled <= scheduler.token_budget
        self.h.core.execute(output)

    @rule(index=st.integers(0, 50))
    def cancel(self, index):
        if self.groups:
            self.groups[index % len(self.groups)].cancel.set()

    @invariant()
    def rows_within_budget_and_one_batch_per_group(self):
        scheduler = self.h.scheduler
        assert scheduler.running_rows <= scheduler.max_rows
        owners = [id(group) for batch in scheduler.running for group in batch.groups]
        assert len(owners) == len(set(owners))
        pending = {id(group) for group in scheduler.pending}
        assert not pending & set(owners)

    def teardown(self):
        self.h.core.run()
        failed = [id(group) for group, _ in self.h.failures]
        assert len(failed) == len(set(failed)), "a group failed twice"
        for group in self.groups:
            # a group cancelled while its prompt was prefilled fails, its rows ended without a token
            cancelled_early = id(group) in failed and not any(row.tokens for row in group.rows)
            assert cancelled_early or group.done != (id(group) in failed), "a group ends once: finished or failed"
        ended = [id(loop) for loop in self.h.done]
        assert sorted(ended) == sorted(id(loop) for loop in self.h.loops), "every batch's end reported once"


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


class KVBudgetMachine(SchedulerMachine):
    """The same under a K/V budget (one byte per token and row) that rules change at random: after every schedule
    the bytes reserved are within the budget, and so are the bytes the fake runners hold (rows x their width, joins
    included) after every step; a group that cannot fit alone is refused with CapacityError (when queued, or later
    through ``on_fail``); preempted rows keep their tokens; every group still ends once."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(max_rows=4, window_s=0.0, fail_salt="bad", token_budget=6, kv_budget=KVBudget(60, 1))

    @rule(
        rows=st.integers(1, 3),
        tokens=st.integers(1, 4),
        salt=st.sampled_from([None, "tenant-b", "bad"]),
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    )
    def add(self, rows, tokens, salt, prompt):
        try:
            super().add(rows, tokens, salt, prompt)
        except CapacityError as error:
            assert rows * (len(prompt) + tokens) > self.h.scheduler.kv_budget.budget_bytes, error

    @rule(budget=st.integers(4, 60))
    def change_budget(self, budget):
        self.h.scheduler.kv_budget = KVBudget(budget, 1)

    @rule()
    def step(self):
        super().step()
        scheduler = self.h.scheduler
        budget = scheduler.kv_budget.budget_bytes
        assert scheduler.memory.reserved_bytes <= budget
        held = sum(
            (len(loop.running) + len(loop.joining)) * max(loop.columns, *widths)
            for loop in self.h.runner.loops.values()
            for widths in [[row.context_length for row in loop.joining] or [0]]
        )
        assert held <= scheduler.memory.reserved_bytes <= budget
        for group in self.groups:
            assert all(len(row.tokens) <= row.request.max_new_tokens for row in group.rows)

    def teardown(self):
        self.h.scheduler.kv_budget = KVBudget(1 << 20, 1)  # what waits can run (a refused group already failed)
        super().teardown()


KVBudgetMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_kv_budget_state_machine = KVBudgetMachine.TestCase


def test_a_prefill_work_checks_its_invariants():
    rows = DecodeLoop.rows_for(
        [DecodeRequest(prompt_ids=p, max_new_tokens=1) for p in ([1, 2, 3, 4], (1, 2, 3, 4), [1, 2, 9])], set()
    )
    assert PrefillWork(tuple(rows[:2]), repeat=True).repeat  # one prompt, whatever sequence type holds it
    with pytest.raises(ValueError, match="repeat needs rows of one prompt"):
        PrefillWork(tuple(rows), repeat=True)
    with pytest.raises(ValueError, match="not row 2's prefix"):
        PrefillWork(tuple(rows), shared_prefixes=(SharedPrefix((1, 2, 3, 4), 2),))
    with pytest.raises(ValueError, match="at least one row"):
        PrefillWork(())


@pytest.fixture(scope="module")
def engine():
    return KVBoost(make_tiny_model("llama", seed=0), word_tokenizer(), chunking=8)


def test_generate_many_batches_segment_prompts_with_plain_prompts_and_keeps_their_repair(engine, monkeypatch):
    """Two RAG prompts (segments: a question prefix, warmed documents in another order, a question) and three plain
    prompts run in one decode loop: each RAG prompt is prefilled alone in a cache built with its own segment starts
    and joined, so its content-key hits, repair, reuse figures and tokens equal what transformers' ``generate()``
    gets through a drop-in cache for it alone (from the same store contents), and every plain row equals
    transformers' greedy tokens."""
    documents = [words(50, 24), words(54, 17)]
    rag = [[words(51, 5), documents[1], documents[0], words(52, 6)], [words(55, 3), documents[0], words(56, 4)]]
    others = [words(57 + i, 12 + i) for i in range(3)]

    def warm_documents_only() -> None:
        engine.store.clear()
        for document in documents:
            engine.warm(document)

    warm_documents_only()
    alone = [cache_reference(engine, prompt, 6) for prompt in rag]  # the oracle writes nothing back
    assert all(reference.reuse.approx_tokens > 0 for reference in alone)
    plain = [engine_reference(engine, prompt, 6).tokens for prompt in others]
    loops = []
    decode_loop = engine.factories.decode_loop

    def counted_loop(*args, **kwargs):
        loops.append(decode_loop(*args, **kwargs))
        return loops[-1]

    monkeypatch.setattr(engine.factories, "decode_loop", counted_loop)
    results = engine.generate_many([others[0], rag[0], others[1], rag[1], others[2]], max_new_tokens=6)
    assert len(loops) == 1  # one batch, one decode loop for the five rows
    for got, expected in zip([results[1], results[3]], alone, strict=True):
        figures = ("cached_tokens", "approx_tokens", "recomputed_tokens", "prompt_tokens")
        assert got.output_ids == expected.tokens
        assert [getattr(got, name) for name in figures] == [getattr(expected.reuse, name) for name in figures]
    for got, expected_tokens in zip([results[0], results[2], results[4]], plain, strict=True):
        assert got.output_ids == expected_tokens


def test_prompts_needing_repair_are_prefilled_alone_and_decode_in_the_batch(engine):
    """Plain prompts holding a warmed document after new text (content-key hits at chunk boundaries) share a
    batch with other prompts: each is prefilled alone (the repair is made for one row at a time), joined, and
    decoded with the others; every row's tokens and approximate tokens equal what transformers' ``generate()``
    gets through a drop-in cache for it alone."""
    documents = [words(80 + i, 24) for i in range(2)]
    for document in documents:
        engine.warm(document)
    repaired = [f"{words(90 + i, 8)} {document}" for i, document in enumerate(documents)]
    prompts = [repaired[0], words(95, 10), repaired[1], words(96, 13)]
    policy = engine.factories.batch_policy()
    assert [policy.prefill_alone(engine.encode(p), None) for p in prompts] == [True, False, True, False]
    rows = engine.factories.new_rows([DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=6) for p in prompts])
    works = policy.prefill_works(rows, None)  # the plain rows together, then each repaired prompt alone
    assert [[rows.index(row) for row in work.rows] for work in works] == [[1, 3], [0], [2]]
    alone = [cache_reference(engine, prompt, 6) for prompt in prompts]  # the oracle writes nothing back
    assert [reference.reuse.approx_tokens > 0 for reference in alone] == [True, False, True, False]
    batch = engine.generate_batch(prompts, max_new_tokens=6)
    for got, expected in zip(batch, alone, strict=True):
        assert (got.output_ids, got.approx_tokens) == (expected.tokens, expected.reuse.approx_tokens)
    # the store now holds more (the batch wrote back): equal outputs, not equal loaded-token counts
    assert engine.generate_many(prompts, max_new_tokens=6)[2].output_ids == alone[2].tokens


def test_choices_of_one_prompt_are_prefilled_once_and_all_get_the_repair(engine):
    """The n rows of one prompt (a request's choices) are prefilled as one row and repeated: each row keeps the
    approximate hits that a batch of different prompts would lose: each equals transformers' ``generate()`` through
    a drop-in cache for the prompt alone."""
    document = words(60, 24)
    engine.warm(document)
    prompt = [words(61, 7), document, words(62, 4)]
    alone = cache_reference(engine, prompt, 5)
    choices = engine.generate_batch([prompt, prompt, prompt], max_new_tokens=5)
    assert alone.reuse.approx_tokens > 0
    assert [(r.output_ids, r.approx_tokens) for r in choices] == [(alone.tokens, alone.reuse.approx_tokens)] * 3


def test_generate_many_prefills_mixed_lengths_in_forwards_of_similar_widths_with_generates_tokens(engine, monkeypatch):
    """Five prompts admitted in one schedule: a 6-token prompt twice and a 20-token one, a 90-token prompt twice, a
    216-token one; the 20- and 216-token prompts start with the same 16 tokens (two chunks of 8). They are
    prefilled in three forwards, narrowest first: ``[6, 6, 20]`` (14 columns of padding at most, under the slack of
    64), ``[90]`` repeated, ``[216]`` (not padded to by the others); the shared 16 tokens (not stored: the plan asked
    the store) are given to the first forward holding one of them, computed before it and loaded by the last. Every
    output equals transformers' greedy one."""
    engine.store.clear()
    head = words(102, 16)
    prompts = [words(100, 6), f"{head} {words(101, 4)}", words(100, 6), f"{head} {words(103, 200)}", words(104, 90)]
    prompts.append(prompts[-1])
    assert [len(engine.encode(p)) for p in prompts] == [6, 20, 6, 216, 90, 90]
    expected = [engine_reference(engine, p, 4).tokens for p in prompts]
    forwards: list[tuple[list[int], bool, list[int]]] = []
    computed: list[int] = []
    begin = DecodeLoop._begin_prefill

    def recorded_begin(loop, work, columns=0):
        prompt = begin(loop, work, columns)
        given = [len(prefix.tokens) for prefix in work.shared_prefixes]
        forwards.append(([row.context_length for row in work.rows], work.repeat, given))
        computed.append(sum(prompt.shared_computed.values()))  # the prefix tokens its shared prefixes computed
        return prompt

    monkeypatch.setattr(DecodeLoop, "_begin_prefill", recorded_begin)
    results = engine.generate_many(prompts, max_new_tokens=4, max_batch_size=8)
    assert [result.output_ids for result in results] == expected
    assert forwards == [([6, 6, 20], False, [16]), ([90, 90], True, []), ([216], False, [])]
    assert computed == [16, 0, 0]  # computed before the first forward (nothing stored); the others were not asked
    assert (results[1].cached_tokens, results[3].cached_tokens) == (0, 16)


def test_the_plan_gives_the_runner_only_the_shared_prefixes_the_store_lacks(engine):
    """The batch policy reads the store so the runner need not: a 20- and a 216-token prompt (two forwards) sharing a
    16-token head get it as the first forward's shared prefix while the store lacks its chunks; the runner computes
    it (16 tokens, counted for the first row) and the second forward loads it; planned again, the head is stored and
    no forward is given a prefix."""
    engine.store.clear()
    head = words(140, 16)
    prompts = [engine.encode(f"{head} {words(141, 4)}"), engine.encode(f"{head} {words(142, 200)}")]
    assert prompts[0][:16] == prompts[1][:16] and [len(p) for p in prompts] == [20, 216]
    policy = engine.factories.batch_policy()

    def plan() -> list[PrefillWork]:
        rows = engine.factories.new_rows([DecodeRequest(prompt_ids=p, max_new_tokens=2) for p in prompts])
        return policy.prefill_works(rows, None)

    works = plan()
    assert [[row.context_length for row in work.rows] for work in works] == [[20], [216]]
    assert [work.shared_prefixes for work in works] == [(SharedPrefix(tuple(prompts[0][:16]), 0),), ()]
    loop = engine.factories.decode_loop()
    for work in works:
        loop.add(work)
    assert loop.computed_tokens == 20 + (216 - 16)  # the head once (for the first row), then each row's own tail
    assert [row.reuse.cached_tokens for row in loop.rows] == [0, 16]
    assert [work.shared_prefixes for work in plan()] == [(), ()]


def test_a_job_submitted_while_the_scheduler_reads_the_store_is_queued_at_once(engine, monkeypatch):
    """The worker plans prefills (which may read a remote store) outside the lock ``submit`` takes: with the store's
    read stalled mid-plan, another job is still accepted at once, and every job finishes once the read returns."""
    from kvboost_hf.server.batching import Done, Job, JobParams
    from kvboost_hf.server.settings import ServerConfig
    from kvboost_hf.server.worker import Worker

    reading, release = threading.Event(), threading.Event()
    contains_many = engine.store.contains_many

    def stalled(keys):
        reading.set()
        assert release.wait(30), "the test releases the read"
        return contains_many(keys)

    monkeypatch.setattr(engine.store, "contains_many", stalled)
    worker = Worker(engine, ServerConfig(reuse_mode="chunk_kv_reuse", batch_window_ms=0, max_batch_size=4))
    finished: list[int] = []
    jobs = [
        Job(
            engine.encode(words(70 + i, 20)),
            JobParams(max_tokens=2),
            lambda e, i=i: finished.append(i) if isinstance(e, Done) else None,
        )
        for i in range(3)
    ]
    worker.submit(jobs[0])
    worker.submit(jobs[1])  # two prompts admitted together: the plan asks the store which to prefill alone
    worker.start()
    try:
        assert reading.wait(30)
        started = time.perf_counter()
        worker.submit(jobs[2])
        assert time.perf_counter() - started < 1.0 and worker.queue_depth == 1
        release.set()
        deadline = time.monotonic() + 60
        while len(finished) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(finished) == [0, 1, 2]
    finally:
        release.set()
        worker.shutdown(grace_s=5)


def test_generate_many_under_a_small_token_budget_gives_generates_tokens_over_a_partly_stored_prompt(
    engine, monkeypatch
):
    """``generate_many`` with 2 rows and a budget of 5 tokens per step: the first two prompts are prefilled 2
    columns per step (one forward of 2 rows); when both leave, the third is prefilled 5 columns per step, its first
    16 tokens loaded from the store (a warmed prefix), only the other 14 computed in chunks. Every output and first
    token distribution equals transformers' greedy ones, and the stored prefix is reported as cached."""
    engine.store.clear()
    head = words(70, 16)  # two 8-token chunks
    prompts = [words(71, 9), words(72, 12), f"{head} {words(73, 14)}"]
    engine.warm(head)
    expected = [engine_reference(engine, prompt, 5) for prompt in prompts]
    chunks: list[int] = []
    chunk = DecodeLoop._prompt_chunk

    def counted(loop, prompt, columns):
        chunks.append(columns)
        return chunk(loop, prompt, columns)

    monkeypatch.setattr(DecodeLoop, "_prompt_chunk", counted)
    results = engine.generate_many(
        prompts, max_new_tokens=5, max_batch_size=2, token_budget=5, mode="prefix_cache", logprobs=0
    )
    assert [result.output_ids for result in results] == [reference.tokens for reference in expected]
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(result.first_token_logits, reference.first_logits, atol=1e-4, rtol=1e-4)
    assert results[2].cached_tokens == 16 and chunks == [2] * 6 + [5, 5, 5]  # the last call computes 4


# ---------------------------------------------------------------------------------------------- K/V memory budget
def bytes_per_token(model) -> int:
    """One row's K/V bytes per column, from the model's config (fp32): layers x 2 x kv_heads x head_dim x 4."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


def held_kv_bytes(runner: ModelRunner) -> int:
    """The K/V bytes the runner's batches hold now, read from their caches' tensors (the running rows' caches and
    those of prompt forwards under way, the target's and a draft's)."""
    caches = []
    for loop in runner.loops.values():
        caches += [loop.cache, *(prompt.state.cache for prompt in loop._prompts)]
        if loop.draft is not None:  # the draft's caches, counted in the bytes per token too
            caches += [loop.draft.cache, *(prompt.state.draft_cache for prompt in loop._prompts)]
    tensors = [t for cache in caches if cache is not None for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def budget_run(engine, core: EngineCore, prompts, max_new_tokens: int, lower_at=None, arrive_at=None, samplings=None):
    """Queue one row per prompt (greedy unless ``samplings`` says; ``arrive_at``: the step each is added at,
    default all at once) and step
    ``core`` until idle, with ``lower_at = (step, bytes)`` lowering its K/V budget before that step. Returns
    the rows, each row's tokens as ``on_token`` reported them, and per step ``(budget, bytes reserved after the
    schedule, bytes held after the step)``."""
    arrive_at = arrive_at or [0] * len(prompts)
    samplings = samplings or [GREEDY] * len(prompts)
    requests = [
        DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=max_new_tokens, sampling=sampling)
        for p, sampling in zip(prompts, samplings, strict=True)
    ]
    rows = engine.factories.new_rows(requests)
    streamed: list[list[int]] = [[] for _ in rows]
    failures: list[BaseException] = []
    groups = [
        RequestGroup([row], on_token=lambda row, seen=seen: seen.append(row.tokens[-1]), on_fail=failures.append)
        for row, seen in zip(rows, streamed, strict=True)
    ]
    trace = []
    step = 0
    scheduler = core.scheduler
    while step <= max(arrive_at) or not scheduler.idle:
        for group, at in zip(groups, arrive_at, strict=True):
            if at == step:
                scheduler.add(group)
        if lower_at is not None and lower_at[0] == step:
            scheduler.kv_budget = dataclasses.replace(scheduler.kv_budget, budget_bytes=lower_at[1])
        output = scheduler.schedule()
        reserved = scheduler.memory.reserved_bytes
        core.execute(output)
        trace.append((scheduler.kv_budget.budget_bytes, reserved, held_kv_bytes(core.runner)))
        step += 1
        assert step < 500, "the scheduler made no progress"
    assert failures == []
    return rows, streamed, trace


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, seed=11)], ids=["greedy", "seeded"])
def test_a_batch_over_the_kv_budget_is_admitted_partly_preempted_and_resumed_with_generates_tokens(engine, sampling):
    """Four prompts whose K/V (prompt and 12 tokens each, every row as wide as the widest) fit three at a time: the
    fourth waits. After five steps the budget is lowered under three rows: the newest row (greedy, or sampled with
    a seed) is preempted (its chunks stored), waits at the front of the queue and resumes once the others end,
    loading its prompt and tokens' full chunks from the store, with its own generator. Every row's tokens equal
    transformers' (greedy; the seeded row's draws from its seed alone), each token reached its stream once, and
    after every schedule the bytes reserved, and after every step the bytes the caches hold, are within the
    budget."""
    engine.store.clear()
    prompts = [words(80, 13), words(81, 15), words(82, 17), words(83, 22)]
    lengths = [len(engine.encode(p)) for p in prompts]
    per_token = bytes_per_token(engine.model)
    three = 3 * (lengths[2] + 12) * per_token  # the first three rows, all as wide as the third, 12 tokens each
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=0, kv_budget_bytes=three)
    scheduler = core.scheduler
    assert scheduler.kv_budget.bytes_per_token == per_token
    lowered = 2 * (lengths[2] + 12) * per_token
    before = dataclasses.replace(scheduler.memory)  # the engine's counters, over its schedulers
    samplings = [GREEDY, GREEDY, sampling, GREEDY]
    rows, streamed, trace = budget_run(engine, core, prompts, 12, lower_at=(5, lowered), samplings=samplings)

    expected = [engine_reference(engine, p, 12, s).tokens for p, s in zip(prompts, samplings, strict=True)]
    assert [row.tokens for row in rows] == expected
    assert streamed == [row.tokens for row in rows]
    assert [row.preemptions for row in rows] == [0, 0, 1, 0]
    assert rows[2].resumed_cached_tokens >= 16  # its prompt and 5 tokens: 22 tokens, two full chunks of 8
    memory = scheduler.memory
    assert (memory.preemptions, memory.rows_preempted) == (before.preemptions + 1, before.rows_preempted + 1)
    assert memory.admissions_deferred >= before.admissions_deferred + 1  # the fourth row waited
    assert engine.cache_stats()["kv_preemptions"] == memory.preemptions
    for budget, reserved, held in trace:
        assert held <= reserved <= budget
    assert max(held for _, _, held in trace) > 0


def test_a_join_prefilled_over_many_steps_is_preempted_as_the_batch_widens_and_resumes_from_its_chunks(engine):
    """A 4-token prompt decodes 20 tokens; a 12-token prompt (20 tokens too) joins at the second step and is
    prefilled one column per step (token budget 2). The budget fits both only as they stand at that step: each
    step the running row widens the batch, so the joining row (every row as wide as the widest) outgrows it and is
    preempted, the chunk its prefill completed stored; it waits until the first row ends, then is prefilled again,
    loading that chunk. Both rows' tokens equal transformers' greedy ones, within the budget throughout."""
    engine.store.clear()
    prompts = [words(84, 3), words(85, 11)]
    lengths = [len(engine.encode(p)) for p in prompts]
    per_token = bytes_per_token(engine.model)
    # two rows as wide as the joining prompt and a column more, 20 tokens each: exceeded once the running row has
    # widened the batch two columns past that prompt, when the join has computed 9 of its 11 columns
    budget = 2 * (lengths[1] + 1 + 20) * per_token - 1
    core = engine.core("prefix_cache", max_batch_size=2, token_budget=2, kv_budget_bytes=budget)
    scheduler = core.scheduler
    before = scheduler.memory.preemptions
    rows, streamed, trace = budget_run(engine, core, prompts, 20, arrive_at=[0, 1])

    assert [row.tokens for row in rows] == [engine_reference(engine, p, 20).tokens for p in prompts]
    assert streamed == [row.tokens for row in rows]
    assert rows[1].preemptions == 1 and scheduler.memory.preemptions == before + 1
    assert rows[1].reuse.cached_tokens == 8  # the chunk its first prefill completed
    for budget, reserved, held in trace:
        assert held <= reserved <= budget


DRAFTS = {"chain": DraftConfig(4), "tree": DraftConfig(num_draft_tokens=2, tree_budget=8)}


@pytest.fixture(scope="module")
def speculative_engines(engine):
    """The tiny model with a noisy copy of itself as its draft (some proposals accepted: rows of one step take
    different counts), drafting chains of 4 tokens or trees of 8 nodes 2 deep."""
    draft = noisy_copy(engine.model, 0.6, seed=7)
    return {
        name: KVBoost(engine.model, word_tokenizer(), chunking=8, draft_model=draft, draft=settings)
        for name, settings in DRAFTS.items()
    }


@pytest.mark.parametrize("drafting", list(DRAFTS))
def test_a_speculative_batch_over_the_kv_budget_is_preempted_and_resumed_with_generates_tokens(
    speculative_engines, drafting, monkeypatch
):
    """Three prompts decoded with a draft (chains, or trees with 4 columns beyond their depth) under a K/V budget
    (target and draft caches) of all three; after three steps it is lowered to two: the newest row is preempted
    (its chunks and the draft's stored) and resumes later, its draft prefilled again from its prompt and tokens
    (speculative steps widen the batch by the most any row takes, so a row may be preempted again). Every row's
    tokens equal transformers' greedy ones and each reached its stream once; drafts were verified; the bytes the
    caches (target and draft) hold during every verify forward of a decode step, the tree's columns still in them,
    and after every step, stay within the bytes reserved at the schedule."""
    engine = speculative_engines[drafting]
    engine.store.clear()
    prompts = [words(130, 13), words(131, 15), words(132, 17)]
    room = max(len(engine.encode(p)) for p in prompts) + 12 + {"chain": 0, "tree": 4}[drafting]
    core = engine.core("prefix_cache", max_batch_size=3, token_budget=0, kv_budget_bytes=1)
    scheduler = core.scheduler
    assert scheduler.kv_budget is not None
    assert scheduler.kv_budget.bytes_per_token == 2 * bytes_per_token(engine.model)  # the draft is a copy
    per_token = scheduler.kv_budget.bytes_per_token
    scheduler.kv_budget = dataclasses.replace(scheduler.kv_budget, budget_bytes=3 * room * per_token)
    during: list[tuple[int, int]] = []
    verify_forward = ForwardRouter.verify

    def measured(router, *args):
        logits = verify_forward(router, *args)
        during.append((held_kv_bytes(core.runner), scheduler.memory.reserved_bytes))
        return logits

    monkeypatch.setattr(ForwardRouter, "verify", measured)
    before = engine.cache_stats()
    rows, streamed, trace = budget_run(engine, core, prompts, 12, lower_at=(3, 2 * room * per_token))

    assert [row.tokens for row in rows] == [engine_reference(engine, p, 12).tokens for p in prompts]
    assert streamed == [row.tokens for row in rows]
    after = engine.cache_stats()
    assert rows[2].preemptions >= 1 and rows[0].preemptions == 0
    assert after["kv_rows_preempted"] - before["kv_rows_preempted"] == sum(row.preemptions for row in rows)
    assert after["draft_tokens_accepted"] > before["draft_tokens_accepted"]
    assert during and all(held <= reserved for held, reserved in during)
    for budget, reserved, held in trace:
        assert held <= reserved <= budget


def test_a_request_whose_kv_cannot_fit_the_budget_alone_is_refused_naming_the_bytes(engine):
    prompt = words(86, 10)
    needed = (len(engine.encode(prompt)) + 6) * bytes_per_token(engine.model)
    scheduler = engine.core("prefix_cache", kv_budget_bytes=needed - 1).scheduler
    row = engine.factories.new_rows(
        [DecodeRequest(prompt_ids=engine.encode(prompt), max_new_tokens=6, sampling=GREEDY)]
    )
    with pytest.raises(CapacityError, match=f"needs {needed} bytes of K/V .* budget of {needed - 1} bytes"):
        scheduler.add(RequestGroup(row))
    assert scheduler.idle
    with pytest.raises(CapacityError, match=f"needs {needed} bytes"):
        engine.generate_many([prompt], max_new_tokens=6, kv_budget_bytes=needed - 1)
    result = engine.generate_many([prompt], max_new_tokens=6, kv_budget_bytes=needed)  # exactly fits
    assert result[0].output_ids == engine_reference(engine, prompt, 6).tokens


def test_a_prompt_prefilled_in_chunks_completes_when_every_running_row_ends_meanwhile(engine):
    """The running row ends (4 tokens) while an 11-token prompt that joined is prefilled one column per step: the
    runner drops the running rows' caches but keeps the prompt forward under way, which completes (it used to be
    dropped with them and never complete) with transformers' greedy tokens."""
    engine.store.clear()
    prompts = [words(87, 3), words(88, 11)]
    core = engine.core("prefix_cache", max_batch_size=2, token_budget=2, kv_budget_bytes=1 << 30)
    rows, _, _ = budget_run(engine, core, prompts, 4, arrive_at=[0, 1])
    assert [row.tokens for row in rows] == [engine_reference(engine, p, 4).tokens for p in prompts]


def test_a_long_prompt_over_the_join_padding_limit_decodes_in_its_own_batch_with_generates_tokens(engine):
    """Two short prompts run; a 60-word prompt arrives at step 2 and would pad them past a join padding limit of 20
    cells, so it is prefilled and decoded in a second batch of the same key (a forward of its own each step); a
    short prompt arriving at step 3 joins the narrow batch, whose caches never get as wide as the long prompt. Every
    row's tokens equal transformers' greedy ones. The engine's default limit is the model's forward read bytes over
    its K/V bytes per token (the break-even of one more forward against the padding every step reads)."""
    engine.store.clear()
    default = engine.core("prefix_cache").scheduler
    assert default.join_padding_limit == forward_read_bytes(engine.model) // bytes_per_token(engine.model)
    prompts = [words(90, 4), words(91, 5), words(92, 60), words(93, 3)]
    arrive_at = [0, 0, 2, 3]
    core = engine.core("prefix_cache", max_batch_size=4, token_budget=0)
    scheduler = core.scheduler
    scheduler.join_padding_limit = 20
    rows = engine.factories.new_rows(
        [DecodeRequest(prompt_ids=engine.encode(p), max_new_tokens=6, sampling=GREEDY) for p in prompts]
    )
    groups = [RequestGroup([row]) for row in rows]
    batches_per_step, narrow_widths = [], []
    for step in range(40):
        for group, at in zip(groups, arrive_at, strict=True):
            if at == step:
                scheduler.add(group)
        core.step()
        batches_per_step.append(len(scheduler.running))
        narrow_widths.append(groups[0].batch.columns)  # the width the runner reported
        if scheduler.idle and step >= max(arrive_at):
            break
    assert scheduler.idle and max(batches_per_step) == 2
    assert groups[0].batch is groups[1].batch is groups[3].batch is not groups[2].batch
    assert max(narrow_widths) < len(engine.encode(prompts[2]))
    assert [row.tokens for row in rows] == [engine_reference(engine, p, 6).tokens for p in prompts]


def test_a_speculative_row_resumed_by_a_chunked_prefill_finishes_and_nothing_stays_reserved(engine):
    """A row preempted after verify rounds resumed in a batch whose loop ran no verify forward (its chunked
    prefill gave its last token): the loop's summary divided its rows' draft counts by 0 verify forwards and
    ``generate_many`` raised ZeroDivisionError, losing every row. Now every row finishes with generate()'s tokens,
    and once the call returns ``kv_reserved_bytes`` is 0 (the last schedule's value stayed)."""
    draft = noisy_copy(engine.model, 0.5, seed=7)
    speculative = KVBoost(engine.model, word_tokenizer(), chunking=8, draft_model=draft, draft=DraftConfig(4),
                          graphs=GraphConfig(enabled=True))  # fmt: skip
    prompts, new = [words(140, 25), words(141, 3)], 9
    budget = max(
        speculative.factories.kv_budget(1 << 40).bytes(BatchShape().join([(len(speculative.encode(p)), new)]))
        for p in prompts
    )  # the larger row alone
    results = speculative.generate_many(prompts, max_new_tokens=new, max_batch_size=4, token_budget=4,
                                        kv_budget_bytes=budget)  # fmt: skip
    assert [r.output_ids for r in results] == [engine_reference(speculative, p, new).tokens for p in prompts]
    stats = speculative.cache_stats()
    assert stats["kv_preemptions"] > 0 and stats["kv_reserved_bytes"] == 0 < stats["kv_peak_reserved_bytes"]


def test_a_step_that_fails_outside_its_batches_fails_its_requests_and_the_worker_serves_on(engine, monkeypatch):
    """An exception out of ``EngineCore.execute`` itself (a bug, such as the draft counters' division by zero)
    ended the worker thread: that request and every later one waited forever. It now fails the requests in
    flight, is counted, and the next request is answered."""
    from kvboost_hf.server.batching import Done, Failed, Job, JobParams
    from kvboost_hf.server.settings import ServerConfig
    from kvboost_hf.server.worker import Worker

    worker = Worker(engine, ServerConfig(batch_window_ms=0, max_batch_size=4))
    ends: list[tuple[int, str]] = []
    execute = worker.core.execute
    failing = [True]

    def fails_once(output):
        if failing and output.work:
            failing.clear()
            raise ZeroDivisionError("division by zero")
        return execute(output)

    monkeypatch.setattr(worker.core, "execute", fails_once)
    worker.start()
    try:
        for i in range(2):

            def sink(event, i=i):
                if isinstance(event, Done | Failed):
                    ends.append((i, type(event).__name__))

            worker.submit(Job(engine.encode(words(150 + i, 12)), JobParams(max_tokens=3), sink))
            deadline = time.monotonic() + 60
            while len(ends) <= i and time.monotonic() < deadline:
                time.sleep(0.01)
        assert ends == [(0, "Failed"), (1, "Done")]
        assert worker._thread.is_alive()
        assert worker.metrics.errors.labels("worker", "500")._value.get() == 1
    finally:
        worker.shutdown(grace_s=5)


def test_a_graphed_row_that_fits_its_kv_budget_is_never_preempted(engine):
    """With graphed decoding the runner reported a static cache's capacity as the batch's width, and the projection
    added the row's tokens left on top (the capacity already holds them), rounding up to the next capacity bucket:
    a row that fits the budget alone was preempted after nearly every step (13 times for 15 tokens) and prefilled
    again. Now it decodes graphed throughout, with generate()'s tokens."""
    graphed = KVBoost(engine.model, word_tokenizer(), chunking=8, graphs=GraphConfig(enabled=True))
    prompt, new = words(160, 20), 15
    alone = graphed.factories.kv_budget(1 << 40).bytes(BatchShape().join([(len(graphed.encode(prompt)), new)]))
    before = graphed.cache_stats()
    [result] = graphed.generate_many([prompt], max_new_tokens=new, kv_budget_bytes=alone)
    after = graphed.cache_stats()
    assert result.output_ids == engine_reference(graphed, prompt, new).tokens
    assert after["kv_preemptions"] == before["kv_preemptions"]
    assert after["graph_graphed_steps"] - before["graph_graphed_steps"] == new - 1


@pytest.mark.parametrize("token_budget", [0, 16])
def test_the_server_counts_the_prompt_tokens_of_a_chunked_prefill(engine, token_budget):
    """``kvboost_prompt_tokens{origin}`` counted a step's tokens only in the step that admitted a group, before a
    prefill spread over several steps (the token budget) had run: 0 computed and 0 loaded for a 100-token prompt
    whose first 64 tokens were stored. Both are counted when the prefill completes."""
    from kvboost_hf.server.batching import Done, Job, JobParams
    from kvboost_hf.server.settings import ServerConfig
    from kvboost_hf.server.worker import Worker

    engine.store.clear()
    prompt = engine.encode(words(170, 100))
    engine.warm(engine.tokenizer.decode(prompt[:64]))
    worker = Worker(engine, ServerConfig(token_budget=token_budget, batch_window_ms=0, max_batch_size=8))
    done = threading.Event()
    worker.start()
    try:
        worker.submit(Job(prompt, JobParams(max_tokens=3), lambda e: done.set() if isinstance(e, Done) else None))
        assert done.wait(60)
    finally:
        worker.shutdown(grace_s=5)
    counted = {origin: worker.metrics.prompt_tokens.labels(origin)._value.get() for origin in ("computed", "loaded")}
    assert counted == {"computed": len(prompt) - 64, "loaded": 64}


def test_a_warm_prompt_admitted_with_a_cold_one_loads_its_stored_prefix(engine, monkeypatch):
    """A 100-token prompt the store holds (its 12 chunks of 8 and its unfinished last 4 tokens), admitted with a
    cold prompt of 100 tokens: they were one left-padded forward, which loads for every row only the columns all
    rows have stored, so the warm row computed its whole prompt (0 cached). They are now two forwards (split by the
    tokens left to compute), the warm one loading all but its last token; both outputs equal transformers' greedy
    ones."""
    engine.store.clear()
    warm, cold = words(110, 100), words(111, 100)
    assert [len(engine.encode(p)) for p in (warm, cold)] == [100, 100]
    engine.generate(warm, max_new_tokens=1)  # stores the warm prompt
    expected = [engine_reference(engine, p, 4).tokens for p in (warm, cold)]
    forwards: list[list[int]] = []
    begin = DecodeLoop._begin_prefill

    def recorded_begin(loop, work, columns=0):
        forwards.append([row.context_length for row in work.rows])
        return begin(loop, work, columns)

    monkeypatch.setattr(DecodeLoop, "_begin_prefill", recorded_begin)
    results = engine.generate_many([warm, cold], max_new_tokens=4, max_batch_size=8)
    assert [result.output_ids for result in results] == expected
    assert forwards == [[100], [100]]
    assert [result.cached_tokens for result in results] == [99, 0]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=12),
    slack=st.integers(0, 80),
)
def test_prefill_works_bound_both_the_padding_and_the_tokens_left_to_compute(rows, slack):
    """With the store's prefix coverage given, each work prefilled together keeps the padding bound of
    :func:`padding_groups` and the same bound on the tokens left to compute (context less stored): no row of a
    work computes more than ``max(2 x its own, its own + slack)``; every row is in exactly one work."""
    lengths = [length for length, _ in rows]
    held = {index: min(stored, length - 1) for index, (length, stored) in enumerate(rows)}
    requests = [DecodeRequest(prompt_ids=[index + 2] * n, max_new_tokens=1) for index, n in enumerate(lengths)]
    decode_rows = DecodeLoop.rows_for(requests, set())
    index_of = {id(row): index for index, row in enumerate(decode_rows)}
    works = prefill_works(
        decode_rows,
        ChunkingConfig(chunk_size=8),
        reuse=True,
        alone=lambda ids, starts: False,
        slack=slack,
        stored=lambda together: [held[index_of[id(row)]] for row in together],
    )
    assert sorted(id(row) for work in works for row in work.rows) == sorted(map(id, decode_rows))
    for work in works:
        sizes = [row.context_length for row in work.rows]
        tails = [row.context_length - held[index_of[id(row)]] for row in work.rows]
        assert all(max(sizes) - n <= max(n, slack) for n in sizes)
        assert all(max(tails) - t <= max(t, slack) for t in tails)
