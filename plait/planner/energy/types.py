"""The energy room's value types: the frequency plan (per pipeline action, the GPU SM frequency to run it at;
Perseus), a GPU's power model and the energy profile of a model's units per SM frequency.

The frequency plan is one JSON file, written by the energy planner (``plait energy``: the time-energy frontier of a
schedule's DAG, ``frontier``) and read by the pipeline runtime, which sets each action's frequency before running
it (``[energy] plan = "path"``) and, on a straggler, switches to the frontier point at the straggler's iteration
time (``EnergyPlan.point_for``). Pure data: no torch, no files (callers read and write the JSON text).

An action is named by its rank and its timeline label (``action_label``: ``"F s1 m3"`` is the forward of stage 1
on microbatch 3), the label the measured and predicted timelines use for the same action.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from plait.planner.cost.types import DeviceSpec, ProfileKey
from plait.planner.serialize import JsonDataclass
from plait.planner.types import UnitCost

__all__ = [
    "PASSES",
    "ActionFrequency",
    "EnergyPlan",
    "EnergyProfile",
    "FrontierPoint",
    "GpuPowerModel",
    "UnitEnergy",
    "action_label",
    "parse_action_label",
]

_LABEL = re.compile(r"^([FBW]) s(\d+) m(\d+)$")


def action_label(kind: str, stage: int, microbatch: int) -> str:
    """The timeline label of an action: ``"<kind> s<stage> m<microbatch>"``, e.g. ``"F s1 m3"``.

    Raises:
        ValueError: on a kind other than F/B/W or a negative stage/microbatch.
    """
    if kind not in ("F", "B", "W") or stage < 0 or microbatch < 0:
        raise ValueError(f"action label needs kind F/B/W and stage, microbatch >= 0, got {kind!r}, {stage}, {microbatch}")
    return f"{kind} s{stage} m{microbatch}"


def parse_action_label(label: str) -> tuple[str, int, int]:
    """Inverse of ``action_label``: ``"F s1 m3"`` -> ``("F", 1, 3)``.

    Raises:
        ValueError: when ``label`` is not of that form.
    """
    match = _LABEL.match(label)
    if match is None:
        raise ValueError(f"action label {label!r} is not '<F|B|W> s<stage> m<microbatch>' (e.g. 'F s1 m3')")
    return match.group(1), int(match.group(2)), int(match.group(3))


@dataclass(frozen=True)
class ActionFrequency(JsonDataclass):
    """The SM frequency one action runs at.

    Attributes:
        rank: pipeline rank that runs the action.
        label: its timeline label (``action_label``), e.g. ``"F s1 m3"``.
        frequency_mhz: SM clock (MHz), > 0.

    Raises:
        ValueError: on a negative rank, a malformed label or a frequency <= 0.
    """

    rank: int
    label: str
    frequency_mhz: int

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"ActionFrequency.rank must be >= 0, got {self.rank}")
        parse_action_label(self.label)
        if self.frequency_mhz <= 0:
            raise ValueError(f"ActionFrequency {self.label} on rank {self.rank}: frequency_mhz must be > 0, "
                             f"got {self.frequency_mhz}")


@dataclass(frozen=True)
class FrontierPoint(JsonDataclass):
    """One point of the time-energy frontier: an iteration time, its least energy and the frequencies doing it.

    Attributes:
        iteration_time_s: iteration time of the pipeline with these frequencies (seconds).
        energy_j: energy of one iteration (joules), blocking (idle-wait) energy included.
        frequencies: the frequency of each action (actions not listed run at the plan's max frequency).

    Raises:
        ValueError: on a negative time or energy, or an action listed twice.
    """

    iteration_time_s: float
    energy_j: float
    frequencies: tuple[ActionFrequency, ...] = ()

    def __post_init__(self) -> None:
        if self.iteration_time_s < 0 or self.energy_j < 0:
            raise ValueError(f"FrontierPoint needs time and energy >= 0, got {self.iteration_time_s} s, "
                             f"{self.energy_j} J")
        if len(self.frequency_table) != len(self.frequencies):
            keys = [(a.rank, a.label) for a in self.frequencies]
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"FrontierPoint lists action {dup[1]!r} on rank {dup[0]} twice")

    @functools.cached_property
    def frequency_table(self) -> dict[tuple[int, str], int]:
        """``{(rank, label): frequency_mhz}`` of the listed actions (built once: the runtime asks per action)."""
        return {(entry.rank, entry.label): entry.frequency_mhz for entry in self.frequencies}


@dataclass(frozen=True)
class EnergyPlan(JsonDataclass):
    """The time-energy frontier of one schedule on one GPU type: the frequency plans the runtime chooses from.

    Attributes:
        gpu: GPU name (e.g. ``"h100"``, or the profiled device's name).
        max_frequency_mhz: the highest SM clock (MHz), the frequency of any action a point does not list.
        points: frontier points sorted by iteration time, ascending (the first is the fastest, ``T*``).
        schedule: every action of the planned schedule as ``"<rank> <label>"`` (e.g. ``"1 F s1 m3"``), so that the
            runtime refuses a plan made for another layout (:meth:`plans_action`); empty in plans written before
            it existed (not checked).

    Raises:
        ValueError: on an empty gpu name, a max frequency <= 0, or points not sorted by time.
    """

    gpu: str
    max_frequency_mhz: int
    points: tuple[FrontierPoint, ...] = ()
    schedule: tuple[str, ...] = ()

    @functools.cached_property
    def _scheduled(self) -> frozenset[str]:
        return frozenset(self.schedule)

    def plans_action(self, rank: int, label: str) -> bool:
        """Whether the planned schedule holds action ``label`` on ``rank`` (True for a plan without
        ``schedule``)."""
        return not self.schedule or f"{rank} {label}" in self._scheduled

    def __post_init__(self) -> None:
        if not self.gpu or self.max_frequency_mhz <= 0:
            raise ValueError(f"EnergyPlan needs a gpu name and max_frequency_mhz > 0, got {self.gpu!r}, "
                             f"{self.max_frequency_mhz}")
        times = [p.iteration_time_s for p in self.points]
        if times != sorted(times):
            raise ValueError(f"EnergyPlan.points must be sorted by iteration time, ascending, got {times}")

    def point_for(self, iteration_time_s: float) -> FrontierPoint:
        """The least-energy point whose time is ``<= iteration_time_s`` (the fastest point when none is): the
        plan for a pipeline that must finish within ``iteration_time_s`` (e.g. a straggler's iteration time).

        Raises:
            ValueError: when the plan has no point.
        """
        if not self.points:
            raise ValueError(f"EnergyPlan for {self.gpu} has no frontier point")
        within = [p for p in self.points if p.iteration_time_s <= iteration_time_s]
        if not within:
            return self.points[0]
        return min(within, key=lambda p: (p.energy_j, p.iteration_time_s))

    def frequency_of(self, point: FrontierPoint, rank: int, label: str) -> int:
        """The frequency (MHz) ``point`` gives the action ``label`` on ``rank``; ``max_frequency_mhz`` when it
        is not listed."""
        return point.frequency_table.get((rank, label), self.max_frequency_mhz)


PASSES = ("forward", "input_grad", "weight_grad")


@dataclass(frozen=True)
class GpuPowerModel(JsonDataclass):
    """Time and power of a GPU's passes versus SM clock (module docstring for the model and its sources).

    Attributes:
        name: preset name (``"a100"``, ``"h100"``, ``"h200"``).
        device: the roofline device of the cost model (``DeviceSpec``).
        tdp_w: board power limit (W): a compute-bound pass at the top clock draws it.
        static_w: clock-independent power of a busy GPU (W).
        blocking_w: power while waiting on a P2P transfer or idle within the iteration (W), Perseus'
            ``P_blocking``.
        frequencies_mhz: SM clocks the planner may choose (MHz), descending; the first is the maximum.
        gamma: exponent of the dynamic power in the clock.
        beta: activity of memory-bound work relative to compute-bound work, in (0, 1].

    Raises:
        ValueError: on powers not ordered ``0 <= blocking_w, static_w < tdp_w``, frequencies not descending and
            positive, or ``gamma``/``beta`` out of range.
    """

    name: str
    device: DeviceSpec
    tdp_w: float
    static_w: float
    blocking_w: float
    frequencies_mhz: tuple[int, ...]
    gamma: float = 2.5
    beta: float = 0.6

    def __post_init__(self) -> None:
        if not (0 <= self.static_w < self.tdp_w and 0 <= self.blocking_w < self.tdp_w):
            raise ValueError(f"GpuPowerModel {self.name}: need 0 <= static_w, blocking_w < tdp_w, got "
                             f"{self.static_w}, {self.blocking_w}, {self.tdp_w}")
        freqs = list(self.frequencies_mhz)
        if not freqs or freqs != sorted(set(freqs), reverse=True) or freqs[-1] <= 0:
            raise ValueError(f"GpuPowerModel {self.name}: frequencies_mhz must be positive, distinct and "
                             f"descending, got {freqs}")
        if not (self.gamma > 0 and 0 < self.beta <= 1):
            raise ValueError(f"GpuPowerModel {self.name}: need gamma > 0 and 0 < beta <= 1, got {self.gamma}, "
                             f"{self.beta}")

    @property
    def max_frequency_mhz(self) -> int:
        """The top SM clock (MHz)."""
        return self.frequencies_mhz[0]

    def pass_time_energy(self, compute_s: float, memory_s: float, frequency_mhz: int) -> tuple[float, float]:
        """``(seconds, joules)`` of a pass whose roofline parts at the top clock are ``compute_s`` (FLOPs over
        peak) and ``memory_s`` (bytes over HBM bandwidth), run at ``frequency_mhz`` (module docstring)."""
        x = frequency_mhz / self.max_frequency_mhz
        compute = compute_s / x
        seconds = max(compute, memory_s)
        if seconds <= 0:
            return 0.0, 0.0
        share = compute / seconds
        power = self.static_w + (self.tdp_w - self.static_w) * (share + (1 - share) * self.beta) * x**self.gamma
        return seconds, power * seconds


@dataclass(frozen=True)
class UnitEnergy(JsonDataclass):
    """One unit's passes per frequency (index ``i`` of each tuple is ``EnergyProfile.frequencies_mhz[i]``).

    Attributes:
        name: the unit's name (``Unit.name``).
        forward_s, forward_j: forward seconds and joules.
        input_grad_s, input_grad_j: input-gradient (dX) seconds and joules.
        weight_grad_s, weight_grad_j: weight-gradient (dW) seconds and joules of all its parameters.

    Raises:
        ValueError: on tuples of different lengths or negative values.
    """

    name: str
    forward_s: tuple[float, ...]
    forward_j: tuple[float, ...]
    input_grad_s: tuple[float, ...]
    input_grad_j: tuple[float, ...]
    weight_grad_s: tuple[float, ...]
    weight_grad_j: tuple[float, ...]

    def __post_init__(self) -> None:
        values = [getattr(self, f"{p}_{q}") for p in PASSES for q in "sj"]
        if len({len(v) for v in values}) != 1:
            raise ValueError(f"UnitEnergy {self.name}: every tuple needs one entry per frequency, got lengths "
                             f"{[len(v) for v in values]}")
        if any(x < 0 for v in values for x in v):
            raise ValueError(f"UnitEnergy {self.name}: seconds and joules must be >= 0")

    def at(self, index: int, joules: bool, recompute: bool) -> UnitCost:
        """The unit's seconds (or, with ``joules``, its joules in the seconds fields) at frequency ``index`` as a
        ``UnitCost``, so the simulator's aggregation rules apply to both; ``recompute``: a checkpointed unit's
        backward pays its forward again."""
        q = "j" if joules else "s"
        forward = getattr(self, f"forward_{q}")[index]
        return UnitCost(forward, getattr(self, f"input_grad_{q}")[index], getattr(self, f"weight_grad_{q}")[index],
                        recompute_s=forward if recompute else 0.0)


@dataclass(frozen=True)
class EnergyProfile(JsonDataclass):
    """Per unit and frequency, time and energy of one microbatch shape's passes on one GPU type.

    Attributes:
        key: what the numbers depend on, as for time profiles (``ProfileKey``; its ``device`` names the GPU).
        gpu: GPU name (a preset name or the measured device's name).
        blocking_power_w: power while waiting within an iteration (W).
        frequencies_mhz: the SM clocks (MHz), descending; the first is the maximum.
        units: one ``UnitEnergy`` per unit.
        source: ``"analytic"`` (a preset) or ``"measured"``.

    Raises:
        ValueError: on frequencies not descending, a unit with another number of entries, a duplicate unit
            name or a negative blocking power.
    """

    key: ProfileKey
    gpu: str
    blocking_power_w: float
    frequencies_mhz: tuple[int, ...]
    units: tuple[UnitEnergy, ...]
    source: str = "analytic"

    def __post_init__(self) -> None:
        freqs = list(self.frequencies_mhz)
        if not freqs or freqs != sorted(set(freqs), reverse=True):
            raise ValueError(f"EnergyProfile.frequencies_mhz must be distinct and descending, got {freqs}")
        if self.blocking_power_w < 0:
            raise ValueError(f"EnergyProfile.blocking_power_w must be >= 0, got {self.blocking_power_w}")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"EnergyProfile lists a unit twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        for unit in self.units:
            if len(unit.forward_s) != len(freqs):
                raise ValueError(f"EnergyProfile unit {unit.name}: {len(unit.forward_s)} entries for "
                                 f"{len(freqs)} frequencies")

    @property
    def max_frequency_mhz(self) -> int:
        """The top SM clock (MHz)."""
        return self.frequencies_mhz[0]
