"""Time a pipeline schedule: makespan, bubbles, peak memory and the predicted timeline.

The simulator executes a ``Schedule`` the way the runtime does (../shared/DESIGN.md, principle 2): each
rank runs its actions in order and an action starts once its rank is free and every action it depends on
(``schedules.action_dependencies``) has finished and, across ranks, its P2P transfer has arrived. Transfers
take ``latency_s + bytes / bandwidth`` and overlap with compute (asynchronous sends, no link contention);
between two stages on the same rank they are free. For this blocking in-order model the start times are
the longest paths of the schedule DAG (``schedules.schedule_dag``), which is what the code computes.

Each cross-rank message also occupies the host of both ends for a fixed time, LogP's *overhead* ``o``
(Culler et al., "LogP: towards a realistic model of parallel computation", PPoPP 1993, section 2):
``P2PModel.send_overhead_s`` per message an action sends (packing and posting it) and
``P2PModel.recv_overhead_s`` per message it receives (waiting on the posted receive and unpacking it) are
added to the action's duration. Both default to 0; on CPU with gloo they are a few hundred microseconds
per message, which the pipeline's ranks pay between their computations (bench/sim_vs_measured.py).

Memory per rank: the static bytes of its stages plus, per stage, ``activation_bytes`` for every microbatch
in flight (allocated when its ``F`` starts, freed when its last backward action ends: ``W`` for a
trainable stage with a split backward, else ``B``). A forward-only stage holds a microbatch's activations
only while its ``F`` runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from plait.planner.pipeline_plan import PipelinePlan
from plait.planner.schedules import (
    Action,
    Schedule,
    TimelineEvent,
    action_dependencies,
    check_schedule,
    frees_activations,
    summarize_timeline,
)
from plait.planner.types import Unit, UnitCost, dataclass_from_dict

__all__ = [
    "ActionCosts",
    "P2PModel",
    "SimResult",
    "StageMemory",
    "boundary_bytes_from_units",
    "simulate",
    "stage_costs_from_units",
]

CostValue = Union[float, Sequence[float], Callable[[int], float]]
ActionCosts = Union[
    Mapping[tuple[int, str], CostValue],
    Mapping[str, Sequence[Union[float, Sequence[float]]]],
    Callable[[int, str, int], float],
]
"""Seconds per action, in one of three forms:

- ``{(stage, kind): value}`` where value is seconds for every microbatch, a sequence indexed by microbatch,
  or a callable ``microbatch -> seconds``;
- ``{kind: costs}`` where ``costs[stage]`` is seconds for every microbatch or a sequence indexed by
  microbatch (an array ``[stage][mb]``);
- a callable ``(stage, kind, microbatch) -> seconds``.

``B`` is the full backward when the schedule does not split the backward, the input-gradient part when it
does.
"""


@dataclass(frozen=True)
class P2PModel:
    """Point-to-point transfer time ``latency_s + nbytes / bandwidth_Bps``, plus the host time each end
    spends per message (LogP's overhead ``o``, module docstring).

    Attributes:
        latency_s: per-transfer latency (seconds).
        bandwidth_Bps: link bandwidth (bytes per second); ``None`` means unlimited.
        send_overhead_s: seconds the sending rank is busy per cross-rank message it sends.
        recv_overhead_s: seconds the receiving rank is busy per cross-rank message it receives.

    Raises:
        ValueError: on a negative latency or overhead, or a non-positive bandwidth.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float | None = None
    send_overhead_s: float = 0.0
    recv_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency_s", "send_overhead_s", "recv_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"P2PModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.bandwidth_Bps is not None and not self.bandwidth_Bps > 0:
            raise ValueError(f"P2PModel.bandwidth_Bps must be > 0 or None, got {self.bandwidth_Bps}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes between two ranks."""
        return self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "P2PModel":
        return dataclass_from_dict(cls, dict(data))


@dataclass(frozen=True)
class StageMemory:
    """Memory of one stage on its rank.

    Attributes:
        static_bytes: parameters, gradients and optimizer state (bytes), held for the whole iteration.
        activation_bytes: activations kept per in-flight microbatch (bytes): one number for every
            microbatch, or a tuple indexed by microbatch.

    Raises:
        ValueError: on negative bytes.
    """

    static_bytes: int = 0
    activation_bytes: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        if isinstance(self.activation_bytes, (list, tuple)):
            object.__setattr__(self, "activation_bytes", tuple(int(b) for b in self.activation_bytes))
        values = self.activation_bytes if isinstance(self.activation_bytes, tuple) else (self.activation_bytes,)
        if self.static_bytes < 0 or any(v < 0 for v in values):
            raise ValueError(f"StageMemory bytes must be >= 0, got {self.static_bytes}/{self.activation_bytes}")

    def activation_of(self, microbatch: int) -> int:
        """Activation bytes of ``microbatch``.

        Raises:
            ValueError: when a per-microbatch tuple has no entry for it.
        """
        if not isinstance(self.activation_bytes, tuple):
            return self.activation_bytes
        if microbatch >= len(self.activation_bytes):
            raise ValueError(f"StageMemory.activation_bytes has no entry for microbatch {microbatch}")
        return self.activation_bytes[microbatch]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(self.activation_bytes, tuple):
            data["activation_bytes"] = list(self.activation_bytes)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageMemory":
        return dataclass_from_dict(cls, dict(data))


@dataclass(frozen=True)
class SimResult:
    """What one simulated iteration costs.

    Attributes:
        makespan_s: iteration time (seconds), first start (0) to last end.
        busy_s: per rank, seconds spent in actions.
        bubble_fraction: per rank, ``1 - busy_s / makespan_s``.
        peak_memory_bytes: per rank, the most bytes held at once (module docstring).
        events: the timed actions, sorted by rank then start time.
    """

    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]
    events: tuple[TimelineEvent, ...]

    @property
    def mean_bubble_fraction(self) -> float:
        """Bubble fraction averaged over ranks."""
        return sum(self.bubble_fraction) / len(self.bubble_fraction)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["events"] = [e.to_dict() for e in self.events]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SimResult":
        data = dict(data)
        for key in ("busy_s", "bubble_fraction", "peak_memory_bytes"):
            data[key] = tuple(data.get(key, ()))
        data["events"] = tuple(TimelineEvent.from_dict(e) for e in data.get("events", ()))
        return dataclass_from_dict(cls, data)


def simulate(
    schedule: Schedule,
    costs: ActionCosts,
    *,
    p2p: P2PModel | None = None,
    boundary_bytes: Mapping[int, float] | None = None,
    memory: Mapping[int, StageMemory] | None = None,
) -> SimResult:
    """Simulate one iteration of ``schedule`` (module docstring for the execution and memory model).

    Args:
        schedule: the schedule; it is checked first (``check_schedule``).
        costs: seconds per action (``ActionCosts``).
        p2p: transfer model between ranks (default: free and instant).
        boundary_bytes: ``{stage: bytes}``, the size of ``stage``'s output per microbatch; its gradient,
            sent back, has the same size. Stages not named send 0 bytes (latency only).
        memory: ``{stage: StageMemory}``; stages not named hold nothing.

    Returns:
        A ``SimResult``.

    Raises:
        ValueError: when the schedule fails ``check_schedule``, a cost is missing or negative, or a
            per-microbatch memory tuple is too short.
    """
    check_schedule(schedule)
    p2p = p2p or P2PModel()
    cost_of = _with_message_overheads(schedule, _cost_function(costs), p2p)
    comm = _comm_function(schedule.plan, p2p, boundary_bytes or {})
    start, end = _timing(schedule, cost_of, comm)
    events = tuple(
        TimelineEvent(rank, a.kind, a.stage, a.microbatch, start[a], end[a]) for rank, a in schedule.all_actions()
    )
    summary = summarize_timeline(events, schedule.num_ranks)
    makespan = max((e.end_s for e in events), default=0.0)
    bubbles = tuple((1.0 - b / makespan) if makespan > 0 else 0.0 for b in summary.busy_s)
    peaks = _peak_memory(schedule, events, memory or {})
    return SimResult(makespan, summary.busy_s, bubbles, peaks, events)


def _timing(
    schedule: Schedule, cost_of: Callable[[Action], float], comm: Callable[[Action, Action], float]
) -> tuple[dict[Action, float], dict[Action, float]]:
    """Start and end time of every action: in-order ranks, start = max(rank free, dependency arrivals)."""
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    heads = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        for rank, actions in enumerate(schedule.actions):
            while heads[rank] < len(actions):
                action = actions[heads[rank]]
                deps = action_dependencies(schedule.plan, action)
                if any(d not in end for d in deps):
                    break
                start[action] = max([free[rank]] + [end[d] + comm(d, action) for d in deps])
                end[action] = free[rank] = start[action] + cost_of(action)
                heads[rank] += 1
                remaining -= 1
    return start, end


def _with_message_overheads(
    schedule: Schedule, cost_of: Callable[[Action], float], p2p: P2PModel
) -> Callable[[Action], float]:
    """``cost_of`` plus the LogP overheads of the cross-rank messages each action receives and sends."""
    if not (p2p.send_overhead_s or p2p.recv_overhead_s):
        return cost_of
    plan = schedule.plan
    sends: dict[Action, int] = {}
    receives: dict[Action, int] = {}
    for _, action in schedule.all_actions():
        for dep in action_dependencies(plan, action):
            if plan.stages[dep.stage].rank != plan.stages[action.stage].rank:
                sends[dep] = sends.get(dep, 0) + 1
                receives[action] = receives.get(action, 0) + 1

    def cost(action: Action) -> float:
        return (cost_of(action) + sends.get(action, 0) * p2p.send_overhead_s
                + receives.get(action, 0) * p2p.recv_overhead_s)

    return cost


def _cost_function(costs: ActionCosts) -> Callable[[Action], float]:
    """Normalise the three ``ActionCosts`` forms to ``action -> seconds`` (validated >= 0)."""

    def lookup(action: Action) -> float:
        value = _raw_cost(costs, action)
        if _indexable(value):
            if action.microbatch >= len(value):
                raise ValueError(
                    f"costs for {action.kind} of stage {action.stage} have no microbatch {action.microbatch}"
                )
            value = value[action.microbatch]
        elif callable(value):
            value = value(action.microbatch)
        seconds = float(value)
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"cost of {action} must be a finite number >= 0, got {value}")
        return seconds

    return lookup


def _indexable(value: Any) -> bool:
    """A per-microbatch sequence (list, tuple, 1-D array), as opposed to a number or a callable."""
    return not isinstance(value, str) and hasattr(value, "__getitem__") and hasattr(value, "__len__")


def _raw_cost(costs: ActionCosts, action: Action) -> Any:
    if callable(costs) and not isinstance(costs, Mapping):
        return costs(action.stage, action.kind, action.microbatch)
    if (action.stage, action.kind) in costs:
        return costs[(action.stage, action.kind)]
    if action.kind in costs:
        per_stage = costs[action.kind]
        if _indexable(per_stage) and action.stage < len(per_stage):
            return per_stage[action.stage]
    raise ValueError(f"costs give no time for {action.kind} of stage {action.stage}")


def _comm_function(
    plan: PipelinePlan, p2p: P2PModel, boundary_bytes: Mapping[int, float]
) -> Callable[[Action, Action], float]:
    """Seconds between ``dep`` ending and ``action`` being able to use its result."""

    def comm(dep: Action, action: Action) -> float:
        if dep.stage == action.stage or plan.stages[dep.stage].rank == plan.stages[action.stage].rank:
            return 0.0
        sender = dep.stage if action.kind == "F" else action.stage  # the boundary is the upstream output
        return p2p.transfer_s(boundary_bytes.get(sender, 0))

    return comm


def _peak_memory(
    schedule: Schedule, events: Sequence[TimelineEvent], memory: Mapping[int, StageMemory]
) -> tuple[int, ...]:
    """Per rank, static bytes plus the highest sum of live activations over time (frees before allocations
    at equal times, since a rank's actions run one after another)."""
    plan = schedule.plan
    deltas: list[list[tuple[float, int, int]]] = [[] for _ in range(schedule.num_ranks)]
    for e in events:
        stage = plan.stages[e.stage]
        mem = memory.get(e.stage, StageMemory())
        nbytes = mem.activation_of(e.microbatch)
        if e.kind == "F":
            deltas[e.rank].append((e.start_s, 1, nbytes))
            if not stage.runs_backward:
                deltas[e.rank].append((e.end_s, 0, -nbytes))
        elif frees_activations(plan, Action(e.kind, e.stage, e.microbatch), schedule.split_backward):
            deltas[e.rank].append((e.end_s, 0, -nbytes))
    peaks = []
    for rank in range(schedule.num_ranks):
        static = sum(memory.get(s, StageMemory()).static_bytes for s in plan.stages_on_rank(rank))
        live = peak = 0
        for _, _, delta in sorted(deltas[rank]):
            live += delta
            peak = max(peak, live)
        peaks.append(static + peak)
    return tuple(peaks)


# ----- bridges from unit costs ------------------------------------------------------------------
def stage_costs_from_units(
    plan: PipelinePlan,
    units: Sequence[Unit],
    unit_costs: Mapping[str, UnitCost],
    *,
    split_backward: bool = False,
) -> dict[tuple[int, str], float]:
    """Per-stage action costs (seconds, ``{(stage, kind): s}``) summed from per-unit costs.

    ``F`` is the sum of forwards. Unsplit, ``B`` is the sum of ``UnitCost.backward_s`` (dX where the unit
    needs an input gradient, plus dW where it trains: the frozen-aware model of
    ../shared/REFERENCES.md section 1). Split, ``B`` is the dX part and ``W`` the dW part.

    Raises:
        ValueError: when a unit of the plan has no cost or is not in ``units``.
    """
    by_name = {u.name: u for u in units}
    out: dict[tuple[int, str], float] = {}
    for stage in plan.stages:
        f = dx = dw = 0.0
        for name in stage.units:
            if name not in by_name or name not in unit_costs:
                raise ValueError(f"stage {stage.index}: unit {name!r} has no Unit or no UnitCost")
            unit, cost = by_name[name], unit_costs[name]
            f += cost.forward_s
            dx += cost.input_grad_s if unit.needs_input_grad else 0.0
            dw += cost.weight_grad_s if unit.trainable else 0.0
        out[(stage.index, "F")] = f
        out[(stage.index, "B")] = dx if split_backward else dx + dw
        out[(stage.index, "W")] = dw
    return out


def boundary_bytes_from_units(plan: PipelinePlan, unit_costs: Mapping[str, UnitCost]) -> dict[int, int]:
    """``{stage: bytes}`` sent across each stage boundary: the ``output_bytes`` of the stage's last unit
    (of each module chunk, summed, for a colocated encoder stage).

    Raises:
        ValueError: when a boundary unit has no cost.
    """
    out = {}
    for stage in plan.stages:
        lasts = [stage.module_units(m)[-1] for m in stage.modules]
        missing = [n for n in lasts if n not in unit_costs]
        if missing:
            raise ValueError(f"stage {stage.index}: no UnitCost for boundary unit(s) {missing}")
        out[stage.index] = sum(unit_costs[n].output_bytes for n in lasts)
    return out
