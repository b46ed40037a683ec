"""The step loop of every plait job: ``plait train`` (:class:`~plait.train.trainer.Trainer`, any layout) and each
worker of ``plait launch`` (:class:`~plait.train.resilient.ResilientWorker`) run :func:`run_steps`, which decides
when a step's metrics row is written, when to validate and when to checkpoint (:class:`LoopSchedule`), shows the
progress bar and stops on an agreed signal. What a step, a validation and a checkpoint are is the job's
(:class:`StepHost`): a layout's runner for ``plait train``; for a resilient worker the same, committed by every
survivor and replayed after a reconfiguration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from plait.config.schema import JobConfig
from plait.data.progress import Progress

__all__ = ["LoopResult", "LoopSchedule", "StepHost", "run_steps", "total_steps"]


def total_steps(cfg: JobConfig, batches_per_epoch: int) -> int:
    """The job's steps: ``train.steps``, else ``train.epochs`` of ``batches_per_epoch`` global batches, rounded up."""
    t = cfg.train
    return t.steps or math.ceil(t.epochs * batches_per_epoch)


@dataclass(frozen=True)
class LoopSchedule:
    """When the loop writes, validates and checkpoints (steps count from 1: step ``n`` is done after ``n`` optimizer
    steps).

    Attributes:
        total: the job's steps (:func:`total_steps`); validation and a checkpoint always follow the last.
        end: the step this run stops at (``total``, or fewer: ``stop_after``); a checkpoint follows it.
        log_every: a training row every that many steps, and after ``end`` (``metrics.log_every``).
        eval_every: validation every that many steps (0: only after ``total``; ``train.eval_every``).
        checkpoint_every: a checkpoint every that many steps (0: only after ``end`` or a stop; ``checkpoint.every``).
        validates: whether the job has a validation set.
    """

    total: int
    end: int
    log_every: int = 1
    eval_every: int = 0
    checkpoint_every: int = 0
    validates: bool = False

    @classmethod
    def of(cls, cfg: JobConfig, total: int, end: int | None = None, validates: bool = False) -> LoopSchedule:
        """The schedule of job ``cfg`` over ``total`` steps, this run ending at ``end`` (default ``total``)."""
        return cls(total, total if end is None else end, cfg.metrics.log_every, cfg.train.eval_every,
                   cfg.checkpoint.every, validates)

    def logs_after(self, step: int) -> bool:
        """Whether step ``step``'s training row is written."""
        return step % self.log_every == 0 or step == self.end

    def validates_after(self, step: int) -> bool:
        """Whether validation follows step ``step``."""
        every = self.eval_every
        return self.validates and ((every > 0 and step % every == 0) or step == self.total)

    def checkpoints_after(self, step: int, stopped: int = 0) -> bool:
        """Whether a checkpoint follows step ``step`` (``stopped``: a signal ended the run after it)."""
        every = self.checkpoint_every
        return (every > 0 and step % every == 0) or step == self.end or bool(stopped)


class StepHost(Protocol):
    """What :func:`run_steps` asks of a job. ``step`` arguments count from 1 except in :meth:`before_step`."""

    def before_step(self, step: int) -> None:
        """Before step ``step + 1`` (``step`` steps done): e.g. admit workers that rejoin then."""

    def next_step(self) -> dict[str, Any]:
        """Train the next step; its metrics row (``step``: steps done after it, ``loss``, ``tokens_per_s``...)."""

    def validate(self, step: int) -> dict[str, Any]:
        """Validate after step ``step``; the validation row (``step``, ``eval``: exact match per task, ...)."""

    def write(self, row: dict[str, Any]) -> None:
        """Write a metrics row (training or validation)."""

    def stop_agreed(self) -> int:
        """The signal that stops the run after this step, the same on every rank (0: none; collective)."""

    def checkpoint(self, step: int) -> None:
        """Write the checkpoint of step ``step``."""

    def say(self, message: str) -> None:
        """Print a line for the user (the main rank's; others say nothing)."""


@dataclass
class LoopResult:
    """What :func:`run_steps` did: the step reached, the training losses of this run (one per step), the last
    validation's exact match per task, and the signal that stopped it (0: none)."""

    step: int
    losses: list[float]
    evals: dict[str, float]
    stopped: int = 0


def run_steps(host: StepHost, when: LoopSchedule, start: int, bar: Progress) -> LoopResult:
    """Steps ``start + 1 .. when.end`` of ``host``: per step :meth:`StepHost.before_step`, :meth:`StepHost.next_step`,
    its row written when :meth:`LoopSchedule.logs_after`, the progress bar advanced (loss, tokens/s), validation
    when :meth:`LoopSchedule.validates_after` (its row written, its exact match said), the stop agreed, and a
    checkpoint when :meth:`LoopSchedule.checkpoints_after`. A signal agreed after a step ends the loop after its
    checkpoint."""
    result = LoopResult(start, [], {})
    while result.step < when.end and not result.stopped:
        host.before_step(result.step)
        row = host.next_step()
        result.step = step = row["step"]
        result.losses.append(row["loss"])
        if when.logs_after(step):
            host.write(row)
        bar.update(1, **{"loss": f"{row['loss']:.3f}", "tokens/s": f"{row['tokens_per_s']:.0f}"})
        if when.validates_after(step):
            evaluation = host.validate(step)
            host.write(evaluation)
            result.evals = evaluation["eval"]
            host.say(f"step {step}: validation exact match "
                     + ", ".join(f"{k}={v:.1%}" for k, v in result.evals.items()))
        result.stopped = host.stop_agreed()
        if when.checkpoints_after(step, result.stopped):
            host.checkpoint(step)
    return result
