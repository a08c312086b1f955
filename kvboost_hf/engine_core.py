"""The engine core: one :class:`~kvboost_hf.scheduling.Scheduler` and one :class:`~kvboost_hf.runner.ModelRunner`,
stepped together (vLLM's ``EngineCore.step()``), for ``KVBoost.generate_many`` and the server's worker alike.

A step (:meth:`EngineCore.step`) is

1. ``scheduler.schedule()``: what runs now, as plain data (:class:`~kvboost_hf.scheduling.SchedulerOutput`);
2. ``runner.execute(output)``: the forwards; the tokens sampled per row (:class:`~kvboost_hf.scheduling.StepReport`);
3. ``scheduler.update_from_output(report)``: the tokens appended, stops decided, ended batches retired;
4. ``runner.release(ended)``: the ended rows dropped from their loops (their chunks stored), the ended batches'
   loops closed (their decode counts kept on the batch); then ``scheduler.record_widths(runner.widths())``.

Neither side holds the other: only this class calls both. Steps 2-4 are :meth:`EngineCore.execute`, so a caller that
plans outside a lock (the server's worker) can run them under it.
"""

from __future__ import annotations

from kvboost_hf.runner import ModelRunner
from kvboost_hf.scheduling import RunningBatch, Scheduler, SchedulerOutput, StepReport


class EngineCore:
    """A scheduler and the runner of its batches. Every method from one thread at a time (``scheduler.add`` from
    any)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def execute(self, output: SchedulerOutput) -> StepReport:
        """Run ``output`` (from ``scheduler.schedule()``), have the scheduler take what it sampled, release what
        ended; returns the scheduler's report (its ``ended`` batches carry their ``decode_counts``)."""
        report = self.scheduler.update_from_output(self.runner.execute(output))
        self._release(report.ended)
        return report

    def step(self, now: float | None = None) -> StepReport:
        """One step: ``scheduler.schedule(now)``, then :meth:`execute`."""
        return self.execute(self.scheduler.schedule(now))

    def run(self) -> None:
        """Step until nothing is pending or running (windows are not waited for: the scheduler's ``skip_windows``
        is set meanwhile, so what is pending is admitted as soon as it fits)."""
        skipping, self.scheduler.skip_windows = self.scheduler.skip_windows, True
        try:
            while not self.scheduler.idle:
                self.step()
        finally:
            self.scheduler.skip_windows = skipping

    def abort(self, error: BaseException) -> None:
        """Fail every pending group with ``error``, end every running row now (cancelled; what was computed is
        stored) and close every batch (:meth:`Scheduler.abort <kvboost_hf.scheduling.Scheduler.abort>`)."""
        self._release(self.scheduler.abort(error))

    def _release(self, ended: tuple[RunningBatch, ...]) -> None:
        """The runner drops the ended rows and closes the ``ended`` batches' loops (their decode counts go on the
        batches); the scheduler takes the widths of the batches that run on."""
        counts = self.runner.release(batch.id for batch in ended)
        for batch in ended:
            batch.decode_counts = counts.get(batch.id, {})
        self.scheduler.record_widths(self.runner.widths())
