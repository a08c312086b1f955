"""Tests of :mod:`kvboost_hf.engine_core`: a step is schedule -> runner.execute -> update_from_output -> release, and
the batches' widths reach the scheduler's K/V projection from the runner alone. Fake loops (see helpers.FakeLoop);
the whole path on a model is tested in test_scheduling.py, test_packed.py and the server's tests."""

from __future__ import annotations

from helpers import FakeLoop

from kvboost_hf.core.chunking import ChunkingConfig
from kvboost_hf.core.keys import KeySpace
from kvboost_hf.engine_core import EngineCore
from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest
from kvboost_hf.kv_budget import KVBudget
from kvboost_hf.runner import ModelRunner
from kvboost_hf.scheduling import BatchPolicy, RequestGroup, Scheduler
from kvboost_hf.store.chunk_store import ChunkStore


def core_of(kv_budget: KVBudget | None = None) -> tuple[EngineCore, list[FakeLoop], list[FakeLoop]]:
    """An engine core on fake loops: the core, the loops built and the loops closed (in order). A batch of tenant
    ``"no-memory"`` cannot get a loop (building it raises MemoryError)."""
    built: list[FakeLoop] = []
    closed: list[FakeLoop] = []

    def new_loop(key):
        if key.cache_salt == "no-memory":
            raise MemoryError("no memory for a draft cache")
        built.append(FakeLoop())
        return built[-1]

    def on_close(loop):
        closed.append(loop)
        return {"steps": loop.steps}

    policy = BatchPolicy(ChunkStore(), KeySpace("digest", "torch.float32", ChunkingConfig(4)), "prefix_cache")
    scheduler = Scheduler(policy, decode=lambda ids: "", max_rows=4, token_budget=0, kv_budget=kv_budget)
    return EngineCore(scheduler, ModelRunner(new_loop, on_close=on_close)), built, closed


def group_of(*prompts, tokens: int) -> RequestGroup:
    requests = [DecodeRequest(prompt_ids=list(p), max_new_tokens=tokens) for p in prompts]
    return RequestGroup(DecodeLoop.rows_for(requests, set()))


def test_the_scheduler_counts_the_width_the_runner_reports_after_every_step():
    """A 6-token prompt and a 2-token one decode together: after each step the scheduler's batch is as wide as the
    runner's loop (6, then a column more per step), and the projection counts that width."""
    core, built, _ = core_of(KVBudget(1 << 20, 1))
    group = group_of([1] * 6, [2, 2], tokens=4)
    core.scheduler.add(group)
    for step in range(3):
        core.step()
        (batch,) = core.scheduler.running
        assert batch.columns == built[0].columns == 6 + step
        assert batch.shape().width == 6 + step
    assert core.scheduler.reserved_bytes == 2 * (6 + 2 + 1)  # two rows, width 8, one token left each


def test_an_ended_batch_closes_its_loop_once_with_its_decode_counts_and_abort_closes_the_rest():
    """Two tenants' batches: the 2-token one ends at the second step (its loop closed then, its counts on the batch
    its group names); abort ends the other (cancelled, its loop closed too). Each loop closes once."""
    core, built, closed = core_of()
    short, running = group_of([1], tokens=2), group_of([2], tokens=9)
    running.cache_salt = "tenant-b"
    core.scheduler.add(short)
    core.scheduler.add(running)
    assert core.step().ended == ()
    report = core.step()
    assert report.ended == (short.batch,) and closed == [built[0]] and short.batch.decode_counts == {"steps": 1}
    assert core.runner.widths() == {running.batch.id: 2}
    core.abort(RuntimeError("shutdown"))
    assert closed == built and core.scheduler.idle and running.rows[0].finish_reason == "cancelled"
    assert running.batch.decode_counts == {"steps": 1} and core.runner.loops == {}


def test_a_batch_whose_loop_cannot_be_built_fails_its_groups_and_the_core_goes_on():
    core, built, closed = core_of()
    failures: list[BaseException] = []
    doomed, fine = group_of([1], tokens=3), group_of([2], tokens=3)
    doomed.cache_salt, doomed.on_fail = "no-memory", failures.append
    core.scheduler.add(doomed)
    core.scheduler.add(fine)
    report = core.step()
    assert [type(result.error) for result in report.results] == [MemoryError, type(None)]
    assert report.ended == (doomed.batch,) and doomed.batch.decode_counts == {}
    assert [str(error) for error in failures] == ["no memory for a draft cache"]
    core.run()
    assert fine.done and len(fine.rows[0].tokens) == 3 and closed == built
