"""Optimizer and LR schedule of both trainers: AdamW over the trainable parameters, linear warm-up then cosine
decay (a ``LambdaLR`` on the optimizer, or :class:`LRSchedule` driven directly by the pipeline trainer)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from plait.models.multimodal import MultimodalModel

__all__ = ["LRSchedule", "build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(
    model: MultimodalModel, lr: float, weight_decay: float, betas: tuple[float, float],
    lr_scales: dict[str, float] | None = None,
) -> torch.optim.AdamW:
    """AdamW over trainable parameters only (frozen ones are not in it); no weight decay on biases and
    norms (parameters with fewer than 2 dims); encoder branch ``b`` (encoder and projector) learns at
    ``lr * lr_scales[b]``.

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
        [{"params": ps, "lr": lr * scale, "weight_decay": weight_decay if decay else 0.0}
         for (scale, decay), ps in groups.items()],
        lr=lr, betas=betas,
    )


def lr_factor(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """The LR factor of step ``step`` (0-based): linear warm-up over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :func:`lr_factor` on ``optimizer``: linear warm-up over ``warmup`` steps, then cosine
    decay to ``min_ratio`` x lr at step ``total``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(warmup, total, min_ratio))


class LRSchedule:
    """An LR schedule driven directly, without an optimizer of its own: the LR of the current step is the base
    LR times ``factor(step)``; :meth:`step` advances. Its state is a ``LambdaLR``'s position (``base_lrs``,
    ``last_epoch``, ``_step_count``, ``_last_lr``), so checkpoints of either kind restore into the other
    (``plait.train.checkpoint`` takes only the position across layouts).

    Args:
        base_lr: the job's LR (``train.lr``).
        factor: step -> factor (:func:`lr_factor`).
    """

    def __init__(self, base_lr: float, factor: Callable[[int], float]) -> None:
        self.base_lr, self.factor = base_lr, factor
        self.last_epoch, self._step_count = 0, 1  # as a freshly built LambdaLR

    def current_factor(self) -> float:
        """The factor of the current step."""
        return self.factor(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        """``[base LR x factor]`` of the current step (``LambdaLR``'s accessor)."""
        return [self.base_lr * self.current_factor()]

    def step(self) -> None:
        """Advance to the next step."""
        self.last_epoch += 1
        self._step_count += 1

    def state_dict(self) -> dict[str, Any]:
        """The position, under a ``LambdaLR``'s keys."""
        return {"base_lrs": [self.base_lr], "last_epoch": self.last_epoch, "_step_count": self._step_count,
                "_last_lr": self.get_last_lr()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the position of a saved schedule (this job's base LR stays)."""
        self.last_epoch, self._step_count = int(state["last_epoch"]), int(state["_step_count"])
