"""Timelines: timed actions per rank, the one format of predicted (simulator) and measured (runtime)
timelines, and their makespan / busy / bubble summary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from plait.planner.pipeline.types import TimelineEvent

__all__ = ["TimelineSummary", "summarize_timeline"]


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
