"""The frequency plan: per pipeline action, the GPU SM frequency to run it at (Perseus).

One JSON file, written by the energy planner (``plait energy``: the time-energy frontier of a schedule's DAG,
``planner.energy_frontier``) and read by the pipeline runtime, which sets each action's frequency before running
it (``[energy] plan = "path"``) and, on a straggler, switches to the frontier point at the straggler's iteration
time (``EnergyPlan.point_for``). Pure data: no torch, no files (callers read and write the JSON text).

An action is named by its rank and its timeline label (``action_label``: ``"F s1 m3"`` is the forward of stage 1
on microbatch 3), the label the measured and predicted timelines use for the same action.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from plait.planner.serialize import JsonDataclass

__all__ = ["ActionFrequency", "EnergyPlan", "FrontierPoint", "action_label", "parse_action_label"]

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
