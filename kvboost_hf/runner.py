"""The model runner: runs what :class:`~kvboost_hf.scheduling.Scheduler` decided, one decode loop per running batch,
and returns what it sampled.

:meth:`ModelRunner.execute` takes a :class:`~kvboost_hf.scheduling.SchedulerOutput` (plain data: per batch its id
and key, the rows preempted since its last step, a decode step, prefill chunks) and returns a
:class:`~kvboost_hf.scheduling.StepReport` of :class:`~kvboost_hf.scheduling.BatchResult` (the tokens sampled per
row, the prefills completed, the prompt tokens computed, or the error that failed the batch). It decides nothing: it
holds no queue, reads no store (a cache stitches stored chunks) and leaves every stop to the scheduler;
:meth:`ModelRunner.release` then drops the rows the scheduler ended (their chunks stored) and closes the loops of the
batches that ended, and :meth:`ModelRunner.widths` reports each batch's width, which the scheduler's K/V projection
counts.

Invariants: one loop per batch id, from the step that formed the batch to its release; a batch's preempted rows
leave its loop (their chunks stored) before any forward of that step, so a preempted row admitted again in the same
step loads what it stored; an exception fails only the batches whose work raised it (every batch in a shared
forward that raised), whose loops drop their caches unsaved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvboost_hf.core.config import DEFAULT_PACK_FORWARDS
from kvboost_hf.hf.decode import DecodeLoop, PackedStep, PrefillWork, RowOutput, prefill_apart
from kvboost_hf.hf.packed import packable, packed_forward
from kvboost_hf.scheduling import BatchKey, BatchResult, BatchWork, SchedulerOutput, StepReport

logger = logging.getLogger(__name__)

StepResult = tuple[list[RowOutput], list[PrefillWork]] | BaseException
"""One batch's step: the tokens sampled and the works whose prefill completed, or the exception that failed it."""


class ModelRunner:
    """The running batches' decode loops, by batch id (the scheduler's model runner).

    Args:
        new_loop: a fresh decode loop for a batch of ``key`` (one model for all of them).
        on_close: called once with each batch's loop when the batch ends (:meth:`release`); what it returns is the
            batch's decode counts.
        pack_forwards: run every batch's decode step and the next chunks of its prompts under way as one forward
            where the attention allows (:func:`~kvboost_hf.hf.packed.packed_forward`: the weights read once per
            step, not once per batch and chunk); False: a forward per batch step and per chunk. May be changed
            between steps.
    """

    def __init__(
        self,
        new_loop: Callable[[BatchKey], DecodeLoop],
        *,
        on_close: Callable[[DecodeLoop], dict[str, Any]] = lambda loop: {},
        pack_forwards: bool = DEFAULT_PACK_FORWARDS,
    ) -> None:
        self.new_loop = new_loop
        self.on_close = on_close
        self.pack_forwards = pack_forwards
        self.loops: dict[int, DecodeLoop] = {}

    def execute(self, output: SchedulerOutput) -> StepReport:
        """Run every batch's work: loops built for the batches formed now, preempted rows taken out (chunks stored),
        then every decode step and prefill chunk (:meth:`run_steps`). Returns each batch's result, in order; a batch
        whose loop cannot be built, or whose preempted rows cannot be stored, fails alone."""
        failed: dict[int, BaseException] = {}
        for work in output.work:
            try:
                if work.new:
                    self.loops[work.batch_id] = self.new_loop(work.key)
                if work.preempted:
                    self.loops[work.batch_id].preempt(work.preempted)
            except Exception as error:  # e.g. out of memory for a draft's cache, a store that cannot be written
                logger.exception("preparing the step of batch %d failed", work.batch_id)
                failed[work.batch_id] = error
        running = [work for work in output.work if work.batch_id not in failed]
        before = {work.batch_id: self.loops[work.batch_id].computed_tokens for work in running}
        steps = [(self.loops[work.batch_id], work.decode, [(chunk.work, chunk.columns) for chunk in work.prefills])
                 for work in running]  # fmt: skip
        results: dict[int, StepResult] = {**failed, **dict(zip(before, self.run_steps(steps), strict=True))}
        return StepReport(tuple(self._result(work, results[work.batch_id], before.get(work.batch_id))
                                for work in output.work))  # fmt: skip

    def _result(self, work: BatchWork, result: StepResult, before: int | None) -> BatchResult:
        """``work``'s :class:`~kvboost_hf.scheduling.BatchResult` from its step's ``result`` (``before``: its loop's
        computed tokens before the step; None: it did not run); a failed batch's loop drops its rows and caches
        unsaved."""
        loop = self.loops.get(work.batch_id)
        if loop is None:  # its loop could not be built: ``result`` says why
            assert isinstance(result, BaseException), "a batch without a loop did not run"
            return BatchResult(work, 0, result)
        computed = 0 if before is None else loop.computed_tokens - before
        if isinstance(result, BaseException):
            loop.abandon()
            return BatchResult(work, computed, result)
        outputs, prefilled = result
        return BatchResult(work, computed, outputs=tuple(outputs), prefilled=tuple(prefilled))

    def run_steps(
        self, steps: Sequence[tuple[DecodeLoop, bool, Sequence[tuple[PrefillWork, int]]]]
    ) -> list[StepResult]:
        """One scheduler step of several batches on one model, ``(loop, decode, prefills)`` each (``prefills``:
        ``(work, columns)``): every batch's decode step and the next chunks of its prompt forwards under way run as
        one forward where they can (:func:`~kvboost_hf.hf.packed.packed_forward`;
        :meth:`~kvboost_hf.hf.decode.DecodeLoop.pack`), each batch's other prefills after it; a batch that cannot
        share a forward runs its decode step (:meth:`~kvboost_hf.hf.decode.DecodeLoop.step`) and prefills
        (:meth:`~kvboost_hf.hf.decode.DecodeLoop.add`) on its own, as does everything when only one part would be
        packed or :attr:`pack_forwards` is False. Returns each batch's :data:`StepResult`, in order."""
        pack = self.pack_forwards and (len(steps) > 1 or any(prefills for _, _, prefills in steps))
        plans = [_plan(loop, decode, prefills) if pack else None for loop, decode, prefills in steps]
        parts = [part for plan in plans if isinstance(plan, PackedStep) for part in plan.parts]
        if len(parts) < 2 or not packable(steps[0][0].model, [part.cache for part in parts]):
            plans = [plan if isinstance(plan, BaseException) else None for plan in plans]  # all apart
            parts = []
        shared: list[torch.Tensor | None] | BaseException = []
        if parts:
            try:
                shared = packed_forward(steps[0][0].model, parts)
            except Exception as error:  # every batch that took part fails with it
                logger.exception("a packed forward of %d parts failed", len(parts))
                shared = error
        results: list[StepResult] = []
        taken = 0
        for (loop, decode, prefills), plan in zip(steps, plans, strict=True):
            if isinstance(plan, BaseException):  # its pack() raised
                results.append(plan)
                continue
            if plan is not None and plan.parts and isinstance(shared, BaseException):
                results.append(shared)
                continue
            try:
                if plan is None:
                    outputs = loop.step(look_ahead=not prefills) if decode else []  # a prefill would cut it
                    more, completed = prefill_apart(loop, prefills)
                    results.append((outputs + more, completed))
                else:
                    assert not isinstance(shared, BaseException)
                    logits, taken = shared[taken : taken + len(plan.parts)], taken + len(plan.parts)
                    results.append(loop.unpack(plan, logits))
            except Exception as error:
                logger.exception("batch of %d rows failed", len(loop.running))
                results.append(error)
        return results

    def release(self, ended: Iterable[int]) -> dict[int, dict[str, Any]]:
        """Drop from every loop the rows that ended (:meth:`~kvboost_hf.hf.decode.DecodeLoop.retire_finished`:
        their chunks stored first), then close the loops of the batches ``ended`` (ids): each one's decode counts
        (what ``on_close`` returned), by id (none for a batch that never ran a step)."""
        for loop in self.loops.values():
            loop.retire_finished()
        closed = [(batch_id, self.loops.pop(batch_id, None)) for batch_id in ended]
        return {batch_id: self.on_close(loop) for batch_id, loop in closed if loop is not None}

    def widths(self) -> dict[int, int]:
        """Columns of K/V each running row of each batch holds (:attr:`~kvboost_hf.hf.decode.DecodeLoop.columns`),
        by batch id."""
        return {batch_id: loop.columns for batch_id, loop in self.loops.items()}


def _plan(
    loop: DecodeLoop, decode: bool, prefills: Sequence[tuple[PrefillWork, int]]
) -> PackedStep | BaseException | None:
    """``loop``'s :meth:`~kvboost_hf.hf.decode.DecodeLoop.pack`, or the exception it raised (beginning a prefill
    can: the batch fails)."""
    try:
        return loop.pack(decode, prefills)
    except Exception as error:
        logger.exception("batch of %d rows failed", len(loop.running))
        return error
