"""Pipeline schedule IR: actions, per-rank schedules, their dependencies and the schedule checker.

One schedule, many readers: a ``Schedule`` is, per pipeline rank, the
ordered actions that rank executes. An ``Action`` is ``F`` (forward), ``B`` (backward: the input-gradient
part when the schedule splits the backward, the full backward otherwise) or ``W`` (weight-gradient part),
of one stage and one microbatch. Sends and receives are implied by the plan's edges: ``F`` of a stage
receives the activations of its predecessors and sends its output to its successor; ``B`` receives the
output gradient from the successor and sends input gradients to the predecessors that run backward. The
runtime executes the actions, the simulator times them, the energy planner turns them into a DAG and the
plots draw them, all from this one object. The generators live in ``schedules`` (GPipe, 1F1B,
memory-capped 1F1B, ``build_schedule``) and ``schedules_interleaved`` (interleaved 1F1B).

Dependencies (``action_dependencies``): ``F(s, m)`` needs ``F(p, m)`` of every predecessor ``p``;
``B(s, m)`` needs ``F(s, m)`` and ``B(t, m)`` of the successor ``t`` when ``t`` runs backward (the last
stage computes the loss, so its ``B`` only needs its ``F``); ``W(s, m)`` needs ``B(s, m)``. Forward-only
stages (``Stage.runs_backward`` False) get no ``B``/``W``; frozen stages that need an input gradient get a
``B`` but no ``W`` when the backward is split.

The 1F1B order of one stage (``one_f_one_b_order``: warm-up, one forward one backward, drain) is here too:
both generator modules and the layout search build their orders with it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.planner.pipeline.types import PipelinePlan
from plait.planner.serialize import dataclass_from_dict

__all__ = [
    "ACTION_KINDS",
    "Action",
    "Schedule",
    "action_dependencies",
    "check_schedule",
    "expected_actions",
    "frees_activations",
    "in_flight_peaks",
    "one_f_one_b_actions",
    "one_f_one_b_order",
    "resolve_microbatches",
    "run_blocking",
    "schedule_dag",
]

ACTION_KINDS = ("F", "B", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` of ``stage`` on ``microbatch``.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` backward (input gradient when the schedule splits the backward, else
            the full backward), ``"W"`` weight gradient.
        stage: stage index in the plan.
        microbatch: microbatch index, ``0..M-1``.

    Raises:
        ValueError: on an unknown kind or a negative stage/microbatch.
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action.kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"Action {self.kind}: stage and microbatch must be >= 0, got {self.stage}/{self.microbatch}"
            )

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"

    def to_list(self) -> list[Any]:
        """Compact JSON form ``[kind, stage, microbatch]``."""
        return [self.kind, self.stage, self.microbatch]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> "Action":
        """Inverse of ``to_list``.

        Raises:
            ValueError: when ``data`` is not ``[kind, stage, microbatch]``.
        """
        if len(data) != 3:
            raise ValueError(f"an action is [kind, stage, microbatch], got {data!r}")
        return cls(str(data[0]), int(data[1]), int(data[2]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions for one pipeline iteration.

    Attributes:
        plan: the pipeline plan the schedule runs.
        actions: ``actions[r]`` is the ordered tuple of actions pipeline rank ``r`` executes.
        num_microbatches: microbatches in the iteration (``M``).
        split_backward: ``B`` is the input-gradient backward and ``W`` the weight-gradient backward; when
            False, ``B`` is the full backward and there is no ``W``.
        name: the generator that made it (informative).

    Raises:
        ValueError: when ``actions`` does not have one entry per plan rank, an action names a stage that is
            not on its rank, a microbatch is out of range, or ``num_microbatches < 1``. Completeness, order
            and deadlock freedom are ``check_schedule``'s job.
    """

    plan: PipelinePlan
    actions: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    split_backward: bool = False
    name: str = ""
    checked: bool = field(default=False, compare=False, repr=False)
    """``check_schedule`` passed on these actions (set by it; ``schedule_cache`` hands it on to a plan of the same
    shape, whose check it would repeat step for step)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(rank) for rank in self.actions))
        if self.num_microbatches < 1:
            raise ValueError(f"Schedule.num_microbatches must be >= 1, got {self.num_microbatches}")
        if len(self.actions) != self.plan.num_ranks:
            raise ValueError(
                f"Schedule has {len(self.actions)} rank lists but the plan has {self.plan.num_ranks} ranks"
            )
        for rank, actions in enumerate(self.actions):
            for action in actions:
                self._check_placement(rank, action)

    def _check_placement(self, rank: int, action: Action) -> None:
        if action.stage >= self.plan.num_stages:
            raise ValueError(
                f"rank {rank}: {action} names a stage the plan does not have ({self.plan.num_stages} stages)"
            )
        if self.plan.stages[action.stage].rank != rank:
            raise ValueError(f"rank {rank}: {action} belongs to rank {self.plan.stages[action.stage].rank}")
        if action.microbatch >= self.num_microbatches:
            raise ValueError(f"rank {rank}: {action} is out of range for {self.num_microbatches} microbatches")

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return len(self.actions)

    def all_actions(self) -> Iterator[tuple[int, Action]]:
        """``(rank, action)`` pairs, rank by rank, each rank in execution order."""
        for rank, actions in enumerate(self.actions):
            for action in actions:
                yield rank, action

    def stage_actions(self, stage: int) -> tuple[Action, ...]:
        """The actions of ``stage`` in the order its rank executes them."""
        rank = self.plan.stages[stage].rank
        return tuple(a for a in self.actions[rank] if a.stage == stage)

    def format(self) -> str:
        """Human-readable grid: one line per rank, e.g. ``rank 0: F0.0 F0.1 B0.0 ...`` (kind stage.mb)."""
        lines = []
        for rank, actions in enumerate(self.actions):
            body = " ".join(f"{a.kind}{a.stage}.{a.microbatch}" for a in actions)
            lines.append(f"rank {rank}: {body}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "actions": [[a.to_list() for a in rank] for rank in self.actions],
            "num_microbatches": self.num_microbatches,
            "split_backward": self.split_backward,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Schedule":
        data = dict(data)
        data["plan"] = PipelinePlan.from_dict(data.get("plan", {}))
        data["actions"] = tuple(tuple(Action.from_list(a) for a in rank) for rank in data.get("actions", ()))
        return dataclass_from_dict(cls, data)

    def to_json(self, **kwargs: Any) -> str:
        """JSON text of ``to_dict()`` (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Inverse of ``to_json``."""
        return cls.from_dict(json.loads(text))


# ----- dependencies --------------------------------------------------------------------------------
def action_dependencies(plan: PipelinePlan, action: Action) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (data dependencies, not the rank order).

    ``F(s, m)``: ``F(p, m)`` for every predecessor ``p``. ``B(s, m)``: ``F(s, m)`` and ``B(t, m)`` for the
    successor ``t`` if it runs backward. ``W(s, m)``: ``B(s, m)``. Cross-rank dependencies are the P2P
    transfers of the plan's edges.
    """
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return tuple(Action("F", p, m) for p in plan.predecessors(s))
    if action.kind == "B":
        succ = tuple(Action("B", t, m) for t in plan.successors(s) if plan.stages[t].runs_backward)
        return (Action("F", s, m),) + succ
    return (Action("B", s, m),)


def schedule_dag(schedule: Schedule) -> dict[Action, tuple[Action, ...]]:
    """Every action's predecessors in the execution DAG: its data dependencies plus the action before it
    on its rank (ranks execute in order). The DAG the simulator times and the energy planner optimises.
    """
    dag: dict[Action, tuple[Action, ...]] = {}
    for actions in schedule.actions:
        previous: tuple[Action, ...] = ()
        for action in actions:
            dag[action] = action_dependencies(schedule.plan, action) + previous
            previous = (action,)
    return dag


def frees_activations(plan: PipelinePlan, action: Action, split_backward: bool) -> bool:
    """True when ``action`` is the last backward action of its microbatch on its stage (``W`` when the
    backward is split and the stage trains, else ``B``): the stage's activations for it are freed."""
    trains_split = split_backward and plan.stages[action.stage].trainable
    return action.kind == ("W" if trains_split else "B")


def expected_actions(plan: PipelinePlan, num_microbatches: int, split_backward: bool) -> list[Action]:
    """Every action a complete schedule has: ``F`` for each stage and microbatch, ``B`` for stages that run
    backward, ``W`` for trainable stages when the backward is split. Ordered by stage, microbatch, kind."""
    out = []
    for stage in plan.stages:
        kinds = "F"
        if stage.runs_backward:
            kinds += "B"
        if split_backward and stage.trainable:
            kinds += "W"
        out.extend(Action(k, stage.index, m) for m in range(num_microbatches) for k in kinds)
    return out


# ----- checker -------------------------------------------------------------------------------------
def check_schedule(schedule: Schedule) -> None:
    """Check that ``schedule`` is complete, ordered and deadlock-free.

    Checks, in order: every expected action (``expected_actions``) appears exactly once and nothing else
    does; no rank runs an action before a dependency that the same rank only runs later; and blocking
    execution (each rank runs its actions in order and waits for each action's dependencies, sends being
    buffered so that only receives block) finishes. The runtime must post its sends without waiting for
    the matching receive (``isend``/batched P2P) for this model to hold.

    Raises:
        ValueError: naming the rank and action: ``missing``, ``duplicate`` or ``unexpected`` actions, an
            action ordered before its own rank's dependency, or a deadlock with the cycle of waiting ranks
            and the action each waits for.
    """
    if schedule.checked:
        return
    _check_complete(schedule)
    _check_rank_order(schedule)
    _check_deadlock(schedule)
    object.__setattr__(schedule, "checked", True)


def _check_complete(schedule: Schedule) -> None:
    plan = schedule.plan
    counts = Counter(a for _, a in schedule.all_actions())
    expected = expected_actions(plan, schedule.num_microbatches, schedule.split_backward)
    expected_set = set(expected)
    for rank, action in schedule.all_actions():
        if counts[action] > 1:
            raise ValueError(f"rank {rank}: duplicate action {action} ({counts[action]} times)")
        if action not in expected_set:
            raise ValueError(f"rank {rank}: unexpected action {action}: {_why_unexpected(schedule, action)}")
    for action in expected:
        if counts[action] == 0:
            raise ValueError(f"rank {plan.stages[action.stage].rank}: missing action {action}")


def _why_unexpected(schedule: Schedule, action: Action) -> str:
    stage = schedule.plan.stages[action.stage]
    if action.kind == "W" and not schedule.split_backward:
        return "the schedule does not split the backward"
    if action.kind == "W":
        return f"stage {stage.index} has no trainable unit"
    return f"stage {stage.index} runs no backward (forward-only)"


def _check_rank_order(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.actions):
        position = {a: i for i, a in enumerate(actions)}
        for i, action in enumerate(actions):
            for dep in action_dependencies(schedule.plan, action):
                if position.get(dep, -1) > i:
                    raise ValueError(
                        f"rank {rank}: {action} at position {i} needs {dep}, which rank {rank} only runs later "
                        f"(position {position[dep]})"
                    )


def _check_deadlock(schedule: Schedule) -> None:
    heads = run_blocking(schedule)
    stuck = {r: schedule.actions[r][i] for r, i in enumerate(heads) if i < len(schedule.actions[r])}
    if stuck:
        raise ValueError(_deadlock_message(schedule, stuck, heads))


def run_blocking(schedule: Schedule) -> list[int]:
    """Execute ``schedule`` with blocking in-order ranks; return how far each rank got."""
    done: set[Action] = set()
    heads = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule.actions):
            while heads[rank] < len(actions) and all(
                d in done for d in action_dependencies(schedule.plan, actions[heads[rank]])
            ):
                done.add(actions[heads[rank]])
                heads[rank] += 1
                progress = True
    return heads


def _deadlock_message(schedule: Schedule, stuck: Mapping[int, Action], heads: Sequence[int]) -> str:
    plan = schedule.plan
    done = {a for r, i in enumerate(heads) for a in schedule.actions[r][:i]}
    waits: dict[int, tuple[Action, int]] = {}
    for rank, action in stuck.items():
        dep = next(d for d in action_dependencies(plan, action) if d not in done)
        waits[rank] = (dep, plan.stages[dep.stage].rank)
    rank, cycle = next(iter(stuck)), []
    while rank not in cycle:
        cycle.append(rank)
        rank = waits[rank][1]
    cycle = cycle[cycle.index(rank) :]
    parts = [f"rank {r} waits at {stuck[r]} for {waits[r][0]} on rank {waits[r][1]}" for r in cycle]
    return f"deadlock: {'; '.join(parts)} (stuck ranks: {sorted(stuck)})"


def in_flight_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once (forwarded, last backward action
    not yet run), following the rank order. Forward-only stages hold none (0)."""
    peaks = []
    for stage in schedule.plan.stages:
        current = peak = 0
        if stage.runs_backward:
            for action in schedule.stage_actions(stage.index):
                if action.kind == "F":
                    current += 1
                    peak = max(peak, current)
                elif frees_activations(schedule.plan, action, schedule.split_backward):
                    current -= 1
        peaks.append(peak)
    return tuple(peaks)


# ----- the 1F1B order of one stage ----------------------------------------------------------------
def one_f_one_b_actions(plan: PipelinePlan, s: int, m: int, limit: int, inline_w: bool) -> list[Action]:
    """One stage's F/B order with in-flight limit ``limit``: warm-up, one-forward-one-backward, drain.

    ``W`` follows each ``B`` when ``inline_w`` and the stage trains.
    """
    stage = plan.stages[s]
    backward = ("B", "W") if inline_w and stage.trainable else ("B",)
    order = []
    for kind, i in one_f_one_b_order(m, limit, stage.runs_backward):
        order.extend([Action("F", s, i)] if kind == "F" else [Action(k, s, i) for k in backward])
    return order


def one_f_one_b_order(num_microbatches: int, limit: int, runs_backward: bool) -> list[tuple[str, int]]:
    """One stage's 1F1B order as ``(kind, microbatch)`` pairs, ``kind`` ``"F"`` or ``"B"``: with in-flight limit
    ``limit`` (the stage's depth for plain 1F1B), ``min(limit - 1, M)`` warm-up forwards, then one forward and
    one backward, then the remaining backwards; a forward-only stage runs its ``M`` forwards back to back.
    The rule every 1F1B order here is built with (the generators and the layout search's timing)."""
    m = num_microbatches
    if not runs_backward:
        return [("F", i) for i in range(m)]
    warmup = min(limit - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i))
        order.append(("B", i))
    return order


def resolve_microbatches(plan: PipelinePlan, num_microbatches: int | None) -> int:
    """``num_microbatches``, or the plan's when None.

    Raises:
        ValueError: when it is < 1.
    """
    m = plan.num_microbatches if num_microbatches is None else int(num_microbatches)
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    return m
