"""Time a pipeline schedule: makespan, bubbles, peak memory and the predicted timeline.

The simulator executes a ``Schedule`` the way the runtime does: each
rank runs its actions in order and an action starts once its rank is free and every action it depends on
(``schedule_ir.action_dependencies``) has finished and, across ranks, its P2P transfer has arrived. Transfers
take ``latency_s + bytes / bandwidth`` and overlap with compute (asynchronous sends, no link contention);
between two stages on the same rank they are free. For this blocking in-order model the start times are
the longest paths of the schedule DAG (``schedule_ir.schedule_dag``), which is what the code computes.

``time_actions`` is the one implementation of these rules: a small pure core on plain lists (per-rank
``(kind, stage, microbatch)`` orders, ``[stage][microbatch]`` durations, per-stage transfer seconds) that
returns every action's start and end; ``activation_peaks`` turns those times into per-rank activation peaks.
``simulate`` calls both, and so does the layout search (``search``) when it times thousands of candidates.

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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Union

from plait.planner.pipeline.types import P2PModel, PipelinePlan, SimResult, StageMemory, TimelineEvent
from plait.planner.pipeline.schedule_ir import Action, Schedule, action_dependencies, check_schedule, frees_activations
from plait.planner.pipeline.timeline import summarize_timeline
from plait.planner.types import Unit, UnitCost

__all__ = [
    "ActionCosts",
    "ActionDurations",
    "ActionTimes",
    "StageGraph",
    "activation_peaks",
    "boundary_bytes_from_units",
    "simulate",
    "stage_costs_from_units",
    "stage_graph",
    "time_actions",
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


# ----- the timing core: one implementation of "time a schedule" ---------------------------------
class StageGraph(NamedTuple):
    """The plan's stage edges as the timing core reads them: plain lists indexed by stage.

    Attributes:
        rank: per stage, the pipeline rank that runs it.
        predecessors: per stage, the stages whose outputs its ``F`` receives.
        successor: per stage, the stage receiving its output (-1 for the last stage).
        runs_backward: per stage, whether it has ``B`` actions (``Stage.runs_backward``).
    """

    rank: Sequence[int]
    predecessors: Sequence[Sequence[int]]
    successor: Sequence[int]
    runs_backward: Sequence[bool]


def stage_graph(plan: PipelinePlan) -> StageGraph:
    """The ``StageGraph`` of ``plan`` (a stage has one successor or none: ``PipelinePlan.successors``)."""
    stages = range(plan.num_stages)
    return StageGraph(
        rank=[plan.stages[s].rank for s in stages],
        predecessors=[plan.predecessors(s) for s in stages],
        successor=[(plan.successors(s) or (-1,))[0] for s in stages],
        runs_backward=[plan.stages[s].runs_backward for s in stages],
    )


class ActionDurations(NamedTuple):
    """Seconds of every action, ``[stage][microbatch]`` per kind (entries of absent actions are unread).

    Attributes:
        forward: ``F`` seconds.
        backward: ``B`` seconds (the full backward, or its input-gradient part when split).
        weight: ``W`` seconds (empty lists when the schedule has no ``W``).
    """

    forward: Sequence[Sequence[float]]
    backward: Sequence[Sequence[float]]
    weight: Sequence[Sequence[float]]


class ActionTimes(NamedTuple):
    """Start and end (seconds from 0) of every action, ``[stage][microbatch]`` per kind; -1.0 marks an end of
    an action that did not run (absent from the orders). ``rank_end``: per rank, when its last action ends."""

    forward_start: list[list[float]]
    forward_end: list[list[float]]
    backward_start: list[list[float]]
    backward_end: list[list[float]]
    weight_start: list[list[float]]
    weight_end: list[list[float]]
    rank_end: list[float]

    @property
    def makespan_s(self) -> float:
        """The iteration time: the latest end over ranks (0 for no actions)."""
        return max(self.rank_end, default=0.0)

    def of(self, kind: str, stage: int, microbatch: int) -> tuple[float, float]:
        """``(start, end)`` of one action."""
        index = "FBW".index(kind)
        return self[2 * index][stage][microbatch], self[2 * index + 1][stage][microbatch]


Order = Sequence[tuple[str, int, int]]
"""One rank's actions in execution order, as ``(kind, stage, microbatch)`` tuples."""


def time_actions(orders: Sequence[Order], graph: StageGraph, durations: ActionDurations,
                 send_s: Sequence[float], num_microbatches: int) -> ActionTimes | None:
    """Time per-rank action ``orders`` by the module's execution model: each rank runs its actions in order;
    an action starts once its rank is free and every action it depends on (``schedule_ir.action_dependencies``:
    ``F(s, m)`` on ``F(p, m)`` of each predecessor, ``B(s, m)`` on ``F(s, m)`` and on ``B(t, m)`` of its
    successor when that runs backward, ``W(s, m)`` on ``B(s, m)``) has ended, plus ``send_s[s]`` when it
    crosses ranks (stage ``s``'s output forward, its gradient back). Transfers overlap with compute (no link
    contention); ``durations`` hold all the host time of an action (``simulate`` adds the LogP overheads of
    its messages there). The start times are the longest paths of the schedule DAG
    (``schedule_ir.schedule_dag``); the order in which ranks are swept does not change them (forward and
    backward sweeps alternate only to need fewer of them).

    The one implementation of "time a schedule": ``simulate`` and the layout search both call it.

    Args:
        orders: per rank, its ``(kind, stage, microbatch)`` actions in order.
        graph: the stage edges (``stage_graph``).
        durations: seconds per action (``ActionDurations``).
        send_s: per stage, seconds to move its output (or the gradient of it) to another rank.
        num_microbatches: microbatches ``M`` (actions name microbatches ``0..M-1``).

    Returns:
        ``ActionTimes``, or None when the orders stall (a rank waits on an action that cannot run).
    """
    rank, preds, succ, back = graph
    fwd, bwd, wgt = durations
    n, m = len(rank), num_microbatches
    f_start = [[0.0] * m for _ in range(n)]
    f_end = [[-1.0] * m for _ in range(n)]
    b_start = [[0.0] * m for _ in range(n)]
    b_end = [[-1.0] * m for _ in range(n)]
    w_start = [[0.0] * m for _ in range(n)]
    w_end = [[-1.0] * m for _ in range(n)]
    heads, free = [0] * len(orders), [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    forward_sweep, backward_sweep = range(len(orders)), range(len(orders) - 1, -1, -1)
    sweep = 0
    while remaining:
        progressed = False
        for r in forward_sweep if sweep % 2 == 0 else backward_sweep:
            actions = orders[r]
            h, clock, last = heads[r], free[r], len(actions)
            while h < last:
                kind, s, i = actions[h]
                if kind == "F":
                    ready = clock
                    for q in preds[s]:
                        arrival = f_end[q][i]
                        if arrival < 0:
                            break
                        if rank[q] != r:
                            arrival += send_s[q]
                        if arrival > ready:
                            ready = arrival
                    else:
                        f_start[s][i] = ready
                        clock = f_end[s][i] = ready + fwd[s][i]
                        h += 1
                        continue
                    break
                if kind == "B":
                    ready = f_end[s][i]
                    if ready < 0:
                        break
                    if clock > ready:
                        ready = clock
                    t = succ[s]
                    if t >= 0 and back[t]:
                        arrival = b_end[t][i]
                        if arrival < 0:
                            break
                        if rank[t] != r:
                            arrival += send_s[s]
                        if arrival > ready:
                            ready = arrival
                    b_start[s][i] = ready
                    clock = b_end[s][i] = ready + bwd[s][i]
                else:
                    ready = b_end[s][i]
                    if ready < 0:
                        break
                    if clock > ready:
                        ready = clock
                    w_start[s][i] = ready
                    clock = w_end[s][i] = ready + wgt[s][i]
                h += 1
            remaining -= h - heads[r]
            progressed |= h > heads[r]
            heads[r], free[r] = h, clock
        sweep += 1
        if not progressed:
            return None
    return ActionTimes(f_start, f_end, b_start, b_end, w_start, w_end, free)


def activation_peaks(rank_of: Sequence[int], num_ranks: int, allocated: Sequence[Sequence[float]],
                     freed: Sequence[Sequence[float]], nbytes: Sequence[Sequence[float]]) -> list[float]:
    """Per rank, the most activation bytes live at once: stage ``s`` holds ``nbytes[s][i]`` for microbatch
    ``i`` from ``allocated[s][i]`` (its ``F``'s start) to ``freed[s][i]`` (the end of its last backward action,
    or of its ``F`` for a forward-only stage). Frees come before allocations at equal times, since a rank's
    actions run one after another.
    """
    deltas: list[list[tuple[float, int, float]]] = [[] for _ in range(num_ranks)]
    for s, r in enumerate(rank_of):
        for start, end, size in zip(allocated[s], freed[s], nbytes[s]):
            deltas[r].append((start, 1, size))
            deltas[r].append((end, 0, -size))
    peaks = []
    for rank_deltas in deltas:
        live = peak = 0
        for _, _, delta in sorted(rank_deltas):
            live += delta
            if live > peak:
                peak = live
        peaks.append(peak)
    return peaks


# ----- simulate(): a checked schedule, its costs and messages, through the core -----------------
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
    plan, m = schedule.plan, schedule.num_microbatches
    durations = _durations(schedule, _with_message_overheads(schedule, _cost_function(costs), p2p))
    send = [p2p.transfer_s((boundary_bytes or {}).get(s, 0)) for s in range(plan.num_stages)]
    orders = [[(a.kind, a.stage, a.microbatch) for a in actions] for actions in schedule.actions]
    times = time_actions(orders, stage_graph(plan), durations, send, m)
    if times is None:  # check_schedule proved the schedule deadlock-free
        raise RuntimeError("the timing core stalled on a checked schedule (a plait bug)")
    events = tuple(TimelineEvent(rank, a.kind, a.stage, a.microbatch, *times.of(a.kind, a.stage, a.microbatch))
                   for rank, a in schedule.all_actions())
    summary = summarize_timeline(events, schedule.num_ranks)
    makespan = max((e.end_s for e in events), default=0.0)
    bubbles = tuple((1.0 - b / makespan) if makespan > 0 else 0.0 for b in summary.busy_s)
    peaks = _peak_memory(schedule, times, memory or {})
    return SimResult(makespan, summary.busy_s, bubbles, peaks, events)


def _durations(schedule: Schedule, cost_of: Callable[[Action], float]) -> ActionDurations:
    """``cost_of`` every action of ``schedule``, as ``[stage][microbatch]`` lists per kind."""
    n, m = schedule.plan.num_stages, schedule.num_microbatches
    table = {kind: [[0.0] * m for _ in range(n)] for kind in "FBW"}
    for _, action in schedule.all_actions():
        table[action.kind][action.stage][action.microbatch] = cost_of(action)
    return ActionDurations(table["F"], table["B"], table["W"])


def _with_message_overheads(
    schedule: Schedule, cost_of: Callable[[Action], float], p2p: P2PModel
) -> Callable[[Action], float]:
    """``cost_of`` plus the LogP overheads (Culler et al., PPoPP 1993, section 2; module docstring) of the
    cross-rank messages each action receives (``recv_overhead_s`` each) and sends (``send_overhead_s`` each):
    one per data dependency between stages on different ranks."""
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


def _peak_memory(schedule: Schedule, times: ActionTimes, memory: Mapping[int, StageMemory]) -> tuple[int, ...]:
    """Per rank, static bytes plus the highest sum of live activations over time (``activation_peaks``):
    a microbatch's activations live from its ``F``'s start to the end of the action that frees them
    (``schedule_ir.frees_activations``; its ``F`` for a forward-only stage)."""
    plan, m = schedule.plan, schedule.num_microbatches
    freed, nbytes = [], []
    for stage in plan.stages:
        mem = memory.get(stage.index, StageMemory())
        nbytes.append([mem.activation_of(i) for i in range(m)])
        if not stage.runs_backward:
            freed.append(times.forward_end[stage.index])
        elif frees_activations(plan, Action("W", stage.index, 0), schedule.split_backward):  # W frees them
            freed.append(times.weight_end[stage.index])
        else:
            freed.append(times.backward_end[stage.index])
    live = activation_peaks([s.rank for s in plan.stages], schedule.num_ranks, times.forward_start, freed, nbytes)
    return tuple(
        sum(memory.get(s, StageMemory()).static_bytes for s in plan.stages_on_rank(rank)) + live[rank]
        for rank in range(schedule.num_ranks)
    )


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
    Cornstarch). Split, ``B`` is the dX part and ``W`` the dW part (``UnitCost.split_backward_s``: the runtime's
    measured split backward where the cost has it), except on a stage whose input needs no
    gradient (the first of its branch, or after frozen stages): there ``B`` has nothing to send and the runtime's
    ``W`` runs the whole backward (``plait.parallel.pipeline.split_backward``), so ``B`` is 0 and ``W`` all of it.
    A checkpointed unit (``UnitCost.recompute_s``, ``planner.recompute``) adds its recomputation to ``B``, and split
    also to ``W`` (once, where ``W`` is the whole backward). A replica of a replicated encoder stage
    (``Stage.replicas`` ``r``) runs ``1/r`` of the branch's rows, so its costs are divided by ``r``; a copy of a
    tensor-parallel encoder stage runs every row (``Stage.row_share`` 1) at the per-rank costs the caller gives
    (``cost.sharding.tensor_parallel_unit_costs``: its layers divided by ``t``, their all-reduces added).

    Raises:
        ValueError: when a unit of the plan has no cost or is not in ``units``.
    """
    by_name = {u.name: u for u in units}
    out: dict[tuple[int, str], float] = {}
    for stage in plan.stages:
        f = dx = dw = again = 0.0
        split = split_backward and stage.needs_input_grad
        for name in stage.units:
            if name not in by_name or name not in unit_costs:
                raise ValueError(f"stage {stage.index}: unit {name!r} has no Unit or no UnitCost")
            unit, cost = by_name[name], unit_costs[name]
            f += cost.forward_s
            if split:  # the runtime's split B and W where measured (UnitCost.split_backward_s)
                b, w = cost.split_backward_s(unit)
            else:  # LoRA: the adapters' share of dW
                b, w = (cost.input_grad_s if unit.needs_input_grad else 0.0), cost.weight_grad_s * unit.trained_fraction
            dx += b + (cost.recompute_s if unit.runs_backward else 0.0)  # checkpointed: forward again (recompute)
            dw += w if unit.trainable else 0.0
            again += cost.recompute_s if unit.trainable else 0.0
        f, dx, dw, again = (x / stage.row_share for x in (f, dx, dw, again))
        out[(stage.index, "F")] = f
        if not split_backward:
            out[(stage.index, "B")], out[(stage.index, "W")] = dx + dw, dw
        elif stage.needs_input_grad:
            out[(stage.index, "B")], out[(stage.index, "W")] = dx, dw + again
        else:  # no input gradient to send: B has nothing to do, W runs the whole backward (split_backward.py)
            out[(stage.index, "B")], out[(stage.index, "W")] = 0.0, dx + dw
    return out


def boundary_bytes_from_units(plan: PipelinePlan, unit_costs: Mapping[str, UnitCost]) -> dict[int, int]:
    """``{stage: bytes}`` sent across each stage boundary: the ``output_bytes`` of the stage's last unit
    (of each module chunk, summed, for a colocated encoder stage); a replica of a replicated encoder stage sends
    its ``1/replicas`` share of the rows (rounded up); a copy of a tensor-parallel stage all of them (its output
    gradient comes back whole; a follower's features into the LLM are an empty message, sent beside the
    leader's, so timing them as the leader's changes no arrival).

    Raises:
        ValueError: when a boundary unit has no cost.
    """
    out = {}
    for stage in plan.stages:
        lasts = [stage.module_units(m)[-1] for m in stage.modules]
        missing = [n for n in lasts if n not in unit_costs]
        if missing:
            raise ValueError(f"stage {stage.index}: no UnitCost for boundary unit(s) {missing}")
        out[stage.index] = -(-sum(unit_costs[n].output_bytes for n in lasts) // stage.row_share)
    return out
