"""Timelines: timed actions per rank, the one format of predicted (simulator) and measured (runtime)
timelines, and their makespan / busy / bubble summary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from plait.planner.serialize import JsonDataclass

__all__ = ["TimelineEvent", "TimelineSummary", "summarize_timeline"]


@dataclass(frozen=True)
class TimelineEvent(JsonDataclass):
    """One timed action on one rank: the format of predicted (simulator) and measured (runtime) timelines.

    Attributes:
        rank: pipeline rank that ran it.
        kind: ``"F"``, ``"B"``, ``"W"``, or another label for measured non-pipeline work (e.g. ``"optim"``).
        stage: stage index (-1 when not applicable).
        microbatch: microbatch index (-1 when not applicable).
        start_s: start time (seconds; any common origin).
        end_s: end time (seconds), ``>= start_s``.
        frequency_mhz: the GPU SM frequency (MHz) an energy plan set (on GPU) or would set (on CPU, recorded)
            before the action (``plait.parallel.energy``); 0 when no plan applies.

    Raises:
        ValueError: on an empty kind, a negative rank or ``end_s < start_s``.
    """

    rank: int
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    frequency_mhz: int = 0

    def __post_init__(self) -> None:
        if not self.kind or self.rank < 0:
            raise ValueError(f"TimelineEvent needs a kind and a rank >= 0, got {self.kind!r}/{self.rank}")
        if self.end_s < self.start_s:
            raise ValueError(f"TimelineEvent {self.kind} on rank {self.rank}: end {self.end_s} < start {self.start_s}")

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` (seconds)."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class TimelineSummary:
    """Makespan and per-rank utilisation of a timeline.

    Attributes:
        makespan_s: last end minus first start (seconds).
        busy_s: per rank, the summed event durations (seconds).
        bubble_fraction: per rank, ``1 - busy_s / makespan_s`` (0 for an empty timeline).
    """

    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]

    @property
    def mean_bubble_fraction(self) -> float:
        """Bubble fraction averaged over ranks."""
        return sum(self.bubble_fraction) / len(self.bubble_fraction) if self.bubble_fraction else 0.0


def summarize_timeline(events: Iterable[TimelineEvent], num_ranks: int | None = None) -> TimelineSummary:
    """Makespan, busy time and bubble fraction per rank of ``events``.

    Args:
        events: the timeline (ranks execute one event at a time; overlapping events double count).
        num_ranks: number of ranks (default ``1 + max rank``); ranks without events are fully idle.
    """
    events = list(events)
    ranks = num_ranks if num_ranks is not None else 1 + max((e.rank for e in events), default=-1)
    busy = [0.0] * ranks
    for event in events:
        busy[event.rank] += event.duration_s
    span = max((e.end_s for e in events), default=0.0) - min((e.start_s for e in events), default=0.0)
    bubbles = tuple((1.0 - b / span) if span > 0 else 0.0 for b in busy)
    return TimelineSummary(makespan_s=span, busy_s=tuple(busy), bubble_fraction=bubbles)
