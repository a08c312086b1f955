"""Tests of :mod:`kvboost_hf.runner`: the model runner runs the scheduler's plain-data output on one loop per batch id
and returns what it sampled; it decides nothing. Its loops are recording fakes here (the packed forward on a real
model is tested in test_packed.py, the scheduler around it in test_scheduling.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import FakeLoop

from kvboost_hf.hf.decode import DecodeLoop, DecodeRequest, PrefillWork
from kvboost_hf.runner import ModelRunner
from kvboost_hf.scheduling import BatchKey, BatchWork, PrefillChunk, SchedulerOutput

KEY = BatchKey(None)


class RecordingLoop(FakeLoop):
    """A fake loop that logs each call (``events``, shared by all loops of a runner) and can fail its preempt."""

    def __init__(self, name: str, events: list[tuple[str, str]], fail_after=None, fail_preempt=False) -> None:
        super().__init__(fail_after=fail_after)
        self.name, self.events, self.fail_preempt = name, events, fail_preempt

    def add(self, work, columns=0):
        self.events.append((self.name, "add"))
        return super().add(work, columns)

    def step(self, look_ahead=True):
        self.events.append((self.name, "step" if look_ahead else "step, no step ahead"))
        return super().step(look_ahead)

    def preempt(self, rows):
        self.events.append((self.name, "preempt"))
        if self.fail_preempt:
            raise OSError("store unreachable")
        super().preempt(rows)


def rows_of(*prompts):
    return DecodeLoop.rows_for([DecodeRequest(prompt_ids=list(p), max_new_tokens=4) for p in prompts], set())


def runner_of(**loops: dict) -> tuple[ModelRunner, dict[str, RecordingLoop], list[tuple[str, str]]]:
    """A runner whose batch ``i`` (in ``loops``' order) gets a :class:`RecordingLoop` named by its key in ``loops``,
    built with that entry's options; every loop it built, by name, and the events of all."""
    events: list[tuple[str, str]] = []
    names = iter(loops.items())
    built: dict[str, RecordingLoop] = {}

    def new_loop(key):
        name, options = next(names)
        built[name] = RecordingLoop(name, events, **options)
        return built[name]

    return ModelRunner(new_loop, on_close=lambda loop: {"steps": loop.steps}), built, events


def prefill(batch_id: int, rows, new: bool = True) -> BatchWork:
    return BatchWork(batch_id, KEY, new=new, prefills=(PrefillChunk(PrefillWork(tuple(rows)), 0),))


def test_a_new_batch_gets_a_loop_that_prefills_and_the_runner_returns_the_tokens_and_computed_tokens():
    runner, _, events = runner_of(a={})
    rows = rows_of([1, 2, 3], [4, 5])
    report = runner.execute(SchedulerOutput((prefill(0, rows),)))
    (result,) = report.results
    assert result.error is None and [output.row for output in result.outputs] == rows
    assert [output.tokens for output in result.outputs] == [(1,), (1,)]  # sampled, not appended: the scheduler's job
    assert [row.tokens for row in rows] == [[], []]
    assert result.prefilled == (result.work.prefills[0].work,) and result.computed_tokens == 5
    assert events == [("a", "add")] and runner.widths() == {0: 3}
    again = runner.execute(SchedulerOutput((BatchWork(0, KEY, decode=True),))).results[0]
    assert again.computed_tokens == 0 and len(again.outputs) == 2 and runner.widths() == {0: 4}


def test_a_decode_step_followed_by_prompt_chunks_of_its_batch_launches_no_step_ahead():
    """A prompt chunk added to the loop after its decode step would cut a step launched ahead off at once (lost
    device work): the runner asks the step for none then."""
    runner, _, events = runner_of(a={})
    runner.execute(SchedulerOutput((prefill(0, rows_of([1, 2])),)))
    events.clear()
    joining = prefill(0, rows_of([3, 4, 5]), new=False)
    runner.execute(SchedulerOutput((BatchWork(0, KEY, decode=True, prefills=joining.prefills),)))
    runner.execute(SchedulerOutput((BatchWork(0, KEY, decode=True),)))
    assert events == [("a", "step, no step ahead"), ("a", "add"), ("a", "step")]


def test_preempted_rows_leave_every_loop_before_any_forward_of_the_step():
    """Batch 1's preempted row may be admitted again to batch 0 in the same step: it must have left (its chunks
    stored) before batch 0's forward loads them, so every preemption runs first."""
    runner, loops, events = runner_of(a={}, b={})
    first, second = rows_of([1, 2]), rows_of([3, 4, 5])
    runner.execute(SchedulerOutput((prefill(0, first), prefill(1, second))))
    events.clear()
    output = SchedulerOutput((BatchWork(0, KEY, decode=True), BatchWork(1, KEY, decode=False, preempted=tuple(second))))
    runner.execute(output)
    assert events == [("b", "preempt"), ("a", "step")]
    assert loops["b"].running == [] and loops["a"].running == first


def test_a_batch_whose_step_or_preempt_raises_fails_alone_and_its_loop_drops_its_caches():
    runner, loops, _ = runner_of(good={}, bad={"fail_after": 0}, leaky={"fail_preempt": True})
    rows = [rows_of([1]), rows_of([2]), rows_of([3])]
    runner.execute(SchedulerOutput(tuple(prefill(index, r) for index, r in enumerate(rows))))
    output = SchedulerOutput(
        (BatchWork(0, KEY, decode=True), BatchWork(1, KEY, decode=True), BatchWork(2, KEY, preempted=tuple(rows[2])))
    )
    good, bad, leaky = runner.execute(output).results
    assert good.error is None and len(good.outputs) == 1 and not loops["good"].closed
    assert str(bad.error) == "device lost" and loops["bad"].closed and bad.outputs == ()
    assert isinstance(leaky.error, OSError) and loops["leaky"].closed


def test_release_drops_ended_rows_everywhere_and_closes_only_the_ended_batches():
    runner, loops, _ = runner_of(a={}, b={})
    first, second = rows_of([1, 2], [3]), rows_of([4])
    runner.execute(SchedulerOutput((prefill(0, first), prefill(1, second))))
    runner.execute(SchedulerOutput((BatchWork(0, KEY, decode=True), BatchWork(1, KEY, decode=True))))
    first[1].finish("stop")
    second[0].finish("length")
    counts = runner.release([1])
    assert counts == {1: {"steps": 1}} and list(runner.loops) == [0]
    assert loops["a"].running == [first[0]] and loops["b"].running == []
    assert runner.widths() == {0: 3}
    assert runner.release([7]) == {}  # a batch that never ran a step has no loop to close


def test_the_runner_imports_no_queue_and_no_store_and_the_scheduler_no_loop():
    """The contract's direction, read from the sources: the runner imports nothing of the store and only the
    scheduler's plain data; the scheduler imports no loop, runner or engine core."""
    root = Path(__file__).resolve().parents[1] / "kvboost_hf"

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
        return names

    runner = imported(root / "runner.py")
    assert not [name for name in runner if ".store" in name]
    assert {name for name in runner if name.startswith("kvboost_hf.scheduling.")} <= {
        f"kvboost_hf.scheduling.{name}" for name in ("BatchKey", "BatchResult", "BatchWork", "SchedulerOutput",
                                                     "StepReport")
    }  # fmt: skip
    scheduler = imported(root / "scheduling.py")
    assert not [name for name in scheduler if name.endswith((".DecodeLoop", ".ModelRunner", ".EngineCore"))]
    assert not [name for name in scheduler if name.startswith(("kvboost_hf.runner", "kvboost_hf.engine_core"))]
