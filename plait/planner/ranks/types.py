"""The LoRA rank room's value types: a calibration run, an observed loss, a fitted power law and the chosen ranks.

Frozen dataclasses that round-trip through JSON (``serialize.JsonDataclass``); the fits and the choice are
``rank_law``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.planner.serialize import JsonDataclass

__all__ = [
    "CalibrationRun",
    "Observation",
    "PowerLaw",
    "RankChoice",
    "RankCombo",
]


@dataclass(frozen=True)
class CalibrationRun(JsonDataclass):
    """One calibration run: only ``module``'s adapters train, at ``rank``, on the first ``samples`` training
    samples for ``steps`` optimizer steps of ``batch`` samples (``name``: its folder, unique)."""

    module: str
    rank: int
    samples: int
    steps: int
    batch: int

    @property
    def name(self) -> str:
        """Folder name of the run, e.g. ``"llm_r8_d128"``."""
        return f"{self.module}_r{self.rank}_d{self.samples}"


@dataclass(frozen=True)
class Observation(JsonDataclass):
    """What one finished calibration run measured: convergence time (samples) and final validation loss."""

    module: str
    rank: int
    samples: int
    convergence: float
    val_loss: float
    first_loss: float


@dataclass(frozen=True)
class PowerLaw(JsonDataclass):
    """``y = offset + scale * D^data_exp * r^(rank_exp + rank_data_exp * ln(D / ref_samples))``, fitted in log
    space (:func:`fit_power_law`); with ``rank_data_exp`` 0 (the default) the rank exponent is ``rank_exp`` at
    every data size.

    Attributes:
        offset, scale, data_exp, rank_exp: the law's parameters (``scale`` > 0; ``rank_exp``: the rank exponent at
            ``D = ref_samples``).
        r2: coefficient of determination of ``log(y - offset)`` (1 = perfect; 0 = no better than the mean).
        residuals: ``y - prediction`` per observation, in ``y``'s unit, in input order.
        rank_data_exp: change of the rank exponent per unit of ``ln D``.
        ref_samples: the data size (samples) at which the rank exponent is ``rank_exp``.
    """

    offset: float
    scale: float
    data_exp: float
    rank_exp: float
    r2: float
    residuals: tuple[float, ...]
    rank_data_exp: float = 0.0
    ref_samples: float = 1.0

    def rank_exponent(self, samples: float) -> float:
        """The rank exponent at ``samples`` (D): ``rank_exp + rank_data_exp * ln(D / ref_samples)``."""
        return self.rank_exp + self.rank_data_exp * math.log(samples / self.ref_samples)

    def predict(self, samples: float, rank: float) -> float:
        """The law at ``samples`` (D) and ``rank`` (r)."""
        return self.offset + self.scale * samples ** self.data_exp * rank ** self.rank_exponent(samples)

    def solve_rank(self, target: float, samples: float) -> float | None:
        """The real rank ``r > 0`` with ``predict(samples, r) == target``; None when there is none (target at or
        below ``offset``, or a law that does not depend on the rank at ``samples``)."""
        exponent = self.rank_exponent(samples)
        if exponent == 0 or target <= self.offset:
            return None
        return ((target - self.offset) / (self.scale * samples ** self.data_exp)) ** (1.0 / exponent)

    def describe(self, name: str) -> str:
        """One line for people, e.g. ``t = 12.0 + 3.1 * D^0.52 * r^-0.31  (R^2 0.93, max |residual| 4.1)`` (the rank
        exponent as ``r^(-0.31 - 0.1 ln(D/80))`` when it changes with the data size)."""
        worst = max((abs(x) for x in self.residuals), default=0.0)
        rank = f"r^{self.rank_exp:.3f}" if not self.rank_data_exp else \
            f"r^({self.rank_exp:.3f} {self.rank_data_exp:+.3f} ln(D/{self.ref_samples:.4g}))"
        return (f"{name} = {self.offset:.4g} + {self.scale:.4g} * D^{self.data_exp:.3f} * {rank}  "
                f"(R^2 {self.r2:.3f}, max |residual| {worst:.3g})")


@dataclass(frozen=True)
class RankCombo(JsonDataclass):
    """One combination of ranks (module -> rank) with its predicted convergence times (samples) and the largest
    time ratio between an encoder and the LLM (1 = aligned), plus each encoder's exact solution (None: none)."""

    ranks: dict[str, int]
    times: dict[str, float]
    mismatch: float
    solved: dict[str, float | None]


@dataclass(frozen=True)
class RankChoice(JsonDataclass):
    """The outcome of a search: kept combinations with their Law-P scores (``predicted_loss``, same order; a ranking
    score, not a forecast of the fine-tune's validation loss) and the chosen one."""

    combos: tuple[RankCombo, ...]
    predicted_loss: tuple[float, ...]
    chosen: dict[str, int]
