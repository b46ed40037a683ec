"""Optimizer and LR schedule of every training loop: AdamW over the trainable parameters; linear warm-up then cosine
decay (:class:`CosineSchedule`), one :class:`LRSchedule` and one way to apply it (:func:`step_optimizer`).

The LR of step ``s`` (0-based: the metrics row of step ``s + 1``) is ``train.lr x factor(s)``, with warm-up ``W``
(``train.warmup_steps``), floor ``r`` (``train.min_lr_ratio``) and total ``T`` (``train.steps``)::

    factor(s) = (s + 1) / W                                  for s < W
              = r + (1 - r) * (1 + cos(pi * phase(s))) / 2   otherwise
    phase(s)  = p_a + (1 - p_a) * min(1, (s - a) / max(1, T_a - a))

for the last segment ``(a, p_a, T_a)`` with ``a <= s``; a new run has the one segment ``(W, 0, T)``. Extending
(or shortening) a run on resume at step ``k`` to a new total ``T'`` (:meth:`CosineSchedule.extended`) adds the
segment ``(a', phase(a'), T')`` with ``a' = max(k, W)``: the remaining cosine is re-stretched from the current
phase to end at ``T'``, so the LR goes on from where it was, without a jump (a finished run, phase 1, stays at
``r x lr``). The checkpoint records the segments (``LRSchedule.state_dict``), so a run extended twice continues
the same curve.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plait.config.schema import TrainConfig
from plait.models.multimodal import MultimodalModel

__all__ = ["CosineSchedule", "LRSchedule", "build_optimizer", "build_scheduler", "lr_factor", "step_optimizer"]

log = logging.getLogger(__name__)


def build_optimizer(
    model: MultimodalModel, lr: float, weight_decay: float, betas: tuple[float, float],
    lr_scales: dict[str, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over trainable parameters only (frozen ones are not in it); no weight decay on biases and
    norms (parameters with fewer than 2 dims); encoder branch ``b`` (encoder and projector) learns at
    ``lr * lr_scales[b]``, each group's base LR also kept as ``initial_lr`` (what :class:`LRSchedule` scales).

    Raises:
        ValueError: when nothing is trainable.
    """
    lr_scales = lr_scales or {}
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.trainable_parameters():
        branch = name.split(".")[1] if name.startswith("encoders.") else None
        groups.setdefault((lr_scales.get(branch, 1.0), p.ndim >= 2), []).append(p)
    if not groups:
        raise ValueError("every parameter is frozen: nothing to train")
    return torch.optim.AdamW(
        [{"params": ps, "lr": lr * scale, "initial_lr": lr * scale, "weight_decay": weight_decay if decay else 0.0}
         for (scale, decay), ps in groups.items()],
        lr=lr, betas=betas,
    )


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up then cosine decay, as a function step -> LR factor (module docstring for the formula).

    Attributes:
        warmup: warm-up steps ``W``.
        min_ratio: the factor the cosine ends at, ``r``.
        segments: ``(start step a, phase at a, end step T_a)`` in order; the first starts at ``W`` with phase 0.
    """

    warmup: int
    min_ratio: float
    segments: tuple[tuple[int, float, int], ...]

    @classmethod
    def new(cls, warmup: int, total: int, min_ratio: float) -> "CosineSchedule":
        """The schedule of a new run: warm-up over ``warmup`` steps, cosine to ``min_ratio`` at step ``total``."""
        return cls(int(warmup), float(min_ratio), ((int(warmup), 0.0, int(total)),))

    @property
    def total(self) -> int:
        """The step the cosine ends at (the run's length)."""
        return self.segments[-1][2]

    def phase(self, step: int) -> float:
        """The cosine's phase at ``step`` (0 at the top, 1 at the floor); 0 during warm-up."""
        start, p, end = next((seg for seg in reversed(self.segments) if seg[0] <= step), self.segments[0])
        return p + (1.0 - p) * min(1.0, max(0, step - start) / max(1, end - start))

    def __call__(self, step: int) -> float:
        """The LR factor of ``step`` (0-based)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * self.phase(step)))

    def extended(self, step: int, total: int) -> "CosineSchedule":
        """This schedule continued at ``step`` to end at ``total`` instead: the remaining cosine re-stretched from
        the phase at ``max(step, warmup)`` (module docstring); itself when ``total`` is unchanged."""
        if total == self.total:
            return self
        start = max(int(step), self.warmup)
        kept = tuple(seg for seg in self.segments if seg[0] < start)
        return CosineSchedule(self.warmup, self.min_ratio, kept + ((start, self.phase(start), int(total)),))

    def to_json(self) -> str:
        """The schedule as a JSON string (what checkpoints record)."""
        return json.dumps({"warmup": self.warmup, "min_ratio": self.min_ratio,
                           "segments": [list(seg) for seg in self.segments]})

    @classmethod
    def from_json(cls, text: str) -> "CosineSchedule":
        """Read :meth:`to_json`."""
        data = json.loads(text)
        return cls(int(data["warmup"]), float(data["min_ratio"]),
                   tuple((int(a), float(p), int(t)) for a, p, t in data["segments"]))


def lr_factor(warmup: int, total: int, min_ratio: float) -> CosineSchedule:
    """The LR factor of step ``step`` (0-based): linear warm-up over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at step ``total`` (a new run's :class:`CosineSchedule`)."""
    return CosineSchedule.new(warmup, total, min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`lr_factor` on ``optimizer``: linear warm-up over ``warmup`` steps, then cosine
    decay to ``min_ratio`` x lr at step ``total``. The trainers use :class:`LRSchedule` (which also extends on
    resume); this is PyTorch's form of the same schedule, which checkpoints also restore into and from."""
    schedule = lr_factor(warmup, total, min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))


class LRSchedule:
    """The LR schedule of every training loop: the LR of the current step is each base LR times ``factor(step)``;
    :meth:`step` advances. With an ``optimizer`` it drives the optimizer's groups as a ``LambdaLR`` does (base LRs:
    each group's ``initial_lr``, set from its ``lr``; the groups' ``lr`` set at construction, :meth:`step` and
    :meth:`load_state_dict`); without one (a pipeline rank or resilient worker, whose optimizer may be missing or
    rebuilt), :func:`step_optimizer` applies it to the optimizer of the step (:meth:`apply`). Its state holds a
    ``LambdaLR``'s position keys (``base_lrs``, ``last_epoch``, ``_step_count``, ``_last_lr``), so checkpoints of
    either kind restore into the other (``plait.train.checkpoint`` takes only the position across layouts), plus
    ``schedule``: the :class:`CosineSchedule` as JSON, from which :meth:`load_state_dict` continues (and extends,
    when this job's total differs).

    Args:
        base_lr: the job's LR (``train.lr``).
        factor: step -> factor (:func:`lr_factor`).
        optimizer: the optimizer whose groups it drives, or None.

    Attributes:
        extended_from: after :meth:`load_state_dict`, the saved total when this job's total differs and the saved
            schedule was re-stretched to it (None otherwise).
    """

    @classmethod
    def of_job(cls, train: TrainConfig, total: int, optimizer: torch.optim.Optimizer | None = None) -> LRSchedule:
        """The schedule of a job's ``[train]`` section (``lr``, ``warmup_steps``, ``min_lr_ratio``) over ``total``
        steps: every training loop's, ``plait train``'s and ``plait launch``'s workers'."""
        return cls(train.lr, lr_factor(train.warmup_steps, total, train.min_lr_ratio), optimizer)

    def __init__(self, base_lr: float, factor: Callable[[int], float],
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.base_lr, self.factor, self.optimizer = base_lr, factor, optimizer
        self.base_lrs = [base_lr]
        if optimizer is not None:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
            self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch, self._step_count = 0, 1  # as a freshly built LambdaLR
        self.extended_from: int | None = None
        self._apply()

    def current_factor(self) -> float:
        """The factor of the current step."""
        return self.factor(self.last_epoch)

    @property
    def lr(self) -> float:
        """The job's LR of the current step (``train.lr`` x factor; what the metrics record)."""
        return self.base_lr * self.current_factor()

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Set each group of ``optimizer`` to its base LR (``initial_lr``, set from its ``lr`` the first time)
        times the current factor."""
        factor = self.current_factor()
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * factor

    def get_last_lr(self) -> list[float]:
        """Each base LR x the factor of the current step (``LambdaLR``'s accessor)."""
        return [base * self.current_factor() for base in self.base_lrs]

    def step(self) -> None:
        """Advance to the next step."""
        self.last_epoch += 1
        self._step_count += 1
        self._apply()

    def _apply(self) -> None:
        """Write the current LRs into the driven optimizer's groups."""
        if self.optimizer is not None:
            self.apply(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The position, under a ``LambdaLR``'s keys, and the schedule (``schedule``: JSON, or ``""``)."""
        schedule = self.factor.to_json() if isinstance(self.factor, CosineSchedule) else ""
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch, "_step_count": self._step_count,
                "_last_lr": self.get_last_lr(), "schedule": schedule}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the position of a saved schedule (this job's base LRs stay) and, when it recorded its
        :class:`CosineSchedule`, continue that one: unchanged when this job's total is the same, re-stretched to
        this job's total otherwise (:meth:`CosineSchedule.extended`, setting ``extended_from``). A saved schedule
        with another warm-up or floor than this job's is dropped for this job's (logged: the LR may jump)."""
        self.last_epoch, self._step_count = int(state["last_epoch"]), int(state["_step_count"])
        saved = state.get("schedule")
        if saved and isinstance(self.factor, CosineSchedule):
            old = CosineSchedule.from_json(saved)
            if (old.warmup, old.min_ratio) != (self.factor.warmup, self.factor.min_ratio):
                log.warning("train.warmup_steps / train.min_lr_ratio differ from the checkpoint's (%d / %g): the LR "
                            "follows this job's schedule from step %d and may jump", old.warmup, old.min_ratio,
                            self.last_epoch)
            else:
                self.extended_from = old.total if old.total != self.factor.total else None
                self.factor = old.extended(self.last_epoch, self.factor.total)
        self._apply()


def step_optimizer(optimizer: torch.optim.Optimizer | None, schedule: LRSchedule) -> float:
    """Step ``optimizer`` (None: a rank with nothing to train) at the schedule's current LR, zero its gradients
    and advance the schedule: the one optimizer step of every loop. Returns the job's LR used
    (:attr:`LRSchedule.lr`)."""
    lr = schedule.lr
    if optimizer is not None:
        schedule.apply(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return lr
