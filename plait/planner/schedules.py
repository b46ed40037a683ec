"""Pipeline schedule IR, schedule generators and the schedule checker.

One schedule, many readers (../shared/DESIGN.md, principle 2): a ``Schedule`` is, per pipeline rank, the
ordered actions that rank executes. An ``Action`` is ``F`` (forward), ``B`` (backward: the input-gradient
part when the schedule splits the backward, the full backward otherwise) or ``W`` (weight-gradient part),
of one stage and one microbatch. Sends and receives are implied by the plan's edges: ``F`` of a stage
receives the activations of its predecessors and sends its output to its successor; ``B`` receives the
output gradient from the successor and sends input gradients to the predecessors that run backward. The
runtime executes the actions, the simulator times them, the energy planner turns them into a DAG and the
plots draw them, all from this one object.

Dependencies (``action_dependencies``): ``F(s, m)`` needs ``F(p, m)`` of every predecessor ``p``;
``B(s, m)`` needs ``F(s, m)`` and ``B(t, m)`` of the successor ``t`` when ``t`` runs backward (the last
stage computes the loss, so its ``B`` only needs its ``F``); ``W(s, m)`` needs ``B(s, m)``. Forward-only
stages (``Stage.runs_backward`` False) get no ``B``/``W``; frozen stages that need an input gradient get a
``B`` but no ``W`` when the backward is split.

Generators (all deadlock-free by construction, and checked before they return):

- ``gpipe``: all forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019).
- ``one_f_one_b``: multimodal 1F1B (one-forward-one-backward with a flush per iteration: Narayanan et al.,
  "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush), ICML 2021, section 2; multimodal
  warm-up from Cornstarch, ../shared/REFERENCES.md section 1): a stage of depth ``d``
  (``PipelinePlan.depth``) warms up with ``d - 1`` forwards, then alternates forward and backward, then
  drains. For encoder stage ``i`` of a branch with ``S_enc`` stages, ``d - 1 = S_enc + S_llm - i - 1``;
  for LLM stage ``j``, ``S_llm - j - 1``.
- ``memory_capped_1f1b``: 1F1B with at most ``cap`` microbatches in flight per stage (warm-up
  ``min(d, cap) - 1``); forward-only stages keep no activations and are not capped.
- ``interleaved_1f1b``: interleaved 1F1B with virtual pipeline stages (Narayanan et al., "Efficient
  large-scale language model training on GPU clusters using Megatron-LM", SC'21, section 2.2.2): each LLM
  rank holds ``v`` LLM chunks (stages ``i, i + p, ...``), cutting the bubble about ``v`` times; encoder
  stages sit on their own ranks (1F1B with the warm-up their successor needs) or on the first LLM stage's
  rank (run right before / after it). ``interleaved_ranks`` (pipeline_plan) places the stages.

With ``split_backward=True`` each ``B`` is followed by its ``W``; with ``defer_weight_grad=True`` as well,
``W`` actions are held back: a rank runs a ready ``F``/``B`` first and a held ``W`` only when it would
otherwise wait (the bubbles), as in the zero-bubble schedules of Qi et al., "Zero Bubble Pipeline
Parallelism" (ICLR 2024, section 3, ZB-H1). A stage then holds at most as many microbatches as the deepest
stage of the undeferred schedule (the 1F1B peak, or the cap), so the peak stays that of the undeferred
schedule when stages keep equal activations. On a uniform chain with ``F = B = W`` this gives ZB-H1's
``M (F + B + W) + (S - 1)(F + B - W)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.planner.pipeline_plan import PipelinePlan
from plait.planner.serialize import dataclass_from_dict

__all__ = [
    "ACTION_KINDS",
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "TimelineEvent",
    "TimelineSummary",
    "action_dependencies",
    "build_schedule",
    "check_schedule",
    "expected_actions",
    "frees_activations",
    "gpipe",
    "in_flight_peaks",
    "interleaved_1f1b",
    "interleaved_chunk_order",
    "interleaved_orders",
    "runs_interleaved",
    "interleaved_warmups",
    "memory_capped_1f1b",
    "one_f_one_b",
    "one_f_one_b_order",
    "schedule_dag",
    "summarize_timeline",
]

ACTION_KINDS = ("F", "B", "W")
SCHEDULE_NAMES = ("gpipe", "1f1b", "memory_capped_1f1b", "interleaved_1f1b")


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
    _check_complete(schedule)
    _check_rank_order(schedule)
    _check_deadlock(schedule)


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
    heads = _run_blocking(schedule)
    stuck = {r: schedule.actions[r][i] for r, i in enumerate(heads) if i < len(schedule.actions[r])}
    if stuck:
        raise ValueError(_deadlock_message(schedule, stuck, heads))


def _run_blocking(schedule: Schedule) -> list[int]:
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


# ----- generators ----------------------------------------------------------------------------------
def gpipe(
    plan: PipelinePlan,
    num_microbatches: int | None = None,
    *,
    split_backward: bool = False,
    defer_weight_grad: bool = False,
) -> Schedule:
    """GPipe: every stage runs all its forwards, then all its backwards (microbatch order).

    Peak in-flight microbatches per backward stage: ``M``.

    Args:
        plan: the pipeline plan.
        num_microbatches: ``M`` (default ``plan.num_microbatches``).
        split_backward: emit ``B`` (input gradient) and ``W`` (weight gradient) separately.
        defer_weight_grad: with ``split_backward``, run ``W`` in the bubbles (module docstring).

    Raises:
        ValueError: on ``M < 1`` or ``defer_weight_grad`` without ``split_backward``.
    """
    m = _microbatches(plan, num_microbatches)
    limits = [m] * plan.num_stages
    return _generate(plan, m, limits, split_backward, defer_weight_grad, "gpipe")


def one_f_one_b(
    plan: PipelinePlan,
    num_microbatches: int | None = None,
    *,
    split_backward: bool = False,
    defer_weight_grad: bool = False,
) -> Schedule:
    """Multimodal 1F1B: a stage of depth ``d`` warms up with ``min(d - 1, M)`` forwards, then alternates one
    forward and one backward, then drains its backwards (module docstring for the sources).

    Peak in-flight microbatches of a backward stage: ``min(d, M)``; forward-only stages run their forwards
    back to back.

    Args and Raises: as ``gpipe``.
    """
    m = _microbatches(plan, num_microbatches)
    limits = [plan.depth(s) for s in range(plan.num_stages)]
    return _generate(plan, m, limits, split_backward, defer_weight_grad, "1f1b")


def memory_capped_1f1b(
    plan: PipelinePlan,
    num_microbatches: int | None = None,
    cap: int | Mapping[int, int] = 1,
    *,
    split_backward: bool = False,
    defer_weight_grad: bool = False,
) -> Schedule:
    """1F1B with at most ``cap`` microbatches in flight (forwarded, activations not yet freed) per stage.

    A stage of depth ``d`` warms up with ``min(d, cap) - 1`` forwards (Cornstarch's memory-aware schedule,
    ../shared/REFERENCES.md section 1). Forward-only stages keep no activations and are not capped. Since
    warm-up depth never grows along an edge, the result stays deadlock-free.

    Args:
        cap: one cap for every stage, or ``{stage: cap}`` (stages not named are uncapped, i.e. 1F1B).
        Others: as ``gpipe``.

    Raises:
        ValueError: on a cap < 1, an unknown stage in ``cap``, and as ``gpipe``.
    """
    m = _microbatches(plan, num_microbatches)
    caps = _stage_caps(plan, cap)
    limits = [min(plan.depth(s), caps.get(s, plan.depth(s))) for s in range(plan.num_stages)]
    # Deadlock freedom needs warm-up never to grow along an edge: a stage inherits the caps upstream of it.
    for s in range(plan.num_stages):
        for t in plan.successors(s):
            if plan.stages[s].runs_backward:
                limits[t] = min(limits[t], limits[s])
    deepest = max((limits[s.index] for s in plan.stages if s.runs_backward), default=1)
    hold = [max(limits[s], caps.get(s, deepest)) for s in range(plan.num_stages)]
    return _generate(plan, m, limits, split_backward, defer_weight_grad, "memory_capped_1f1b", hold)


# ----- interleaved 1F1B (virtual pipeline stages) ---------------------------------------------------
def interleaved_1f1b(
    plan: PipelinePlan,
    num_microbatches: int | None = None,
    *,
    split_backward: bool = False,
    group_size: int | None = None,
) -> Schedule:
    """Interleaved 1F1B: each LLM rank holds ``v`` model chunks (virtual stages) of the LLM chain.

    Source: Narayanan et al., "Efficient large-scale language model training on GPU clusters using
    Megatron-LM", SC'21, section 2.2.2 (our own formulation). The ``v * p`` LLM stages must sit on ``p``
    ranks cyclically (LLM stage ``j`` on the rank of LLM stage ``j mod p``; ``interleaved_ranks`` makes
    such plans), so chunk ``c`` of LLM rank ``i`` is LLM stage ``c * p + i``. Per LLM rank, forwards run
    in groups of ``g`` microbatches (``group_size``, default ``p``): chunk 0 of the group's microbatches,
    then chunk 1, ..., and backwards in the same order with the chunks reversed. LLM rank ``i`` warms up
    with ``min(2 (p - i - 1) + (v - 1) g, all its forwards)`` forwards, then alternates one forward and one
    backward, then drains its backwards; the bubble shrinks about ``v`` times against 1F1B on ``p`` ranks,
    for ``v`` times the P2P messages and about ``(1 + 1/v)`` times the activation peak of the first rank.
    Where ``M`` is not a multiple of ``g`` (the last group is shorter) or chunks are forward-only, a rank
    whose warm-up is too short to be deadlock-free gets more warm-up until the checker passes.

    Multimodal stage graph: an encoder stage on the first LLM stage's rank runs ``F`` of microbatch ``m``
    just before that stage's ``F`` and its ``B`` just after that stage's ``B``; an encoder stage alone on
    its own rank runs 1F1B with the least warm-up its successor's order needs (forward-only stages run
    their forwards back to back). With ``split_backward`` each ``B`` of a trainable stage is followed by
    its ``W``. With ``v = 1`` this is plain 1F1B on the LLM ranks.

    Args:
        plan: the pipeline plan; num_microbatches: ``M`` (default ``plan.num_microbatches``).
        split_backward: emit ``B`` (input gradient) and ``W`` (weight gradient) separately.
        group_size: microbatches per forward group (default ``p``), ``>= 1``.

    Raises:
        ValueError: on ``M < 1``, a bad ``group_size``, LLM stages not cyclic over their ranks, a rank
            holding LLM stages and encoder stages other than on the first LLM stage's rank, or an encoder
            rank holding several stages.
    """
    m = _microbatches(plan, num_microbatches)
    layout, g, warmups = _interleaved_setup(plan, m, group_size)
    while True:
        schedule = Schedule(plan=plan, actions=_interleaved_actions(plan, layout, m, g, warmups, split_backward),
                            num_microbatches=m, split_backward=split_backward, name="interleaved_1f1b")
        heads = _run_blocking(schedule)
        grow = [i for i, r in enumerate(layout.llm_ranks)
                if heads[r] < len(schedule.actions[r]) and warmups[i] < layout.v * m]
        if not grow:
            break
        for i in grow:  # a safety net: no case is known where interleaved_warmups is too short
            warmups[i] += 1
    check_schedule(schedule)
    return schedule


def runs_interleaved(plan: PipelinePlan) -> bool:
    """True when ``plan`` suits ``interleaved_1f1b`` with more than one LLM chunk per rank (its LLM stages
    are cyclic over their ranks and its encoder stages placed as that generator needs)."""
    if plan.virtual_stages < 2:
        return False
    try:
        _interleaved_layout(plan)
    except ValueError:
        return False
    return True


def interleaved_orders(
    plan: PipelinePlan, num_microbatches: int | None = None, *, split_backward: bool = False,
    group_size: int | None = None,
) -> list[list[Action]]:
    """Per-rank action lists of ``interleaved_1f1b`` with the warm-ups of ``interleaved_warmups``, *not*
    checked (no safety net): for planners that time many candidates and detect a stall themselves.

    Raises:
        ValueError: as ``interleaved_1f1b``.
    """
    m = _microbatches(plan, num_microbatches)
    layout, g, warmups = _interleaved_setup(plan, m, group_size)
    return _interleaved_actions(plan, layout, m, g, warmups, split_backward)


def _interleaved_setup(plan: PipelinePlan, m: int, group_size: int | None) -> tuple["_Interleaving", int, list[int]]:
    layout = _interleaved_layout(plan)
    g = layout.p if group_size is None else int(group_size)
    if g < layout.p:
        raise ValueError(f"group_size must be >= the {layout.p} LLM ranks, got {group_size}")
    return layout, g, interleaved_warmups(layout.p, layout.v, m, g)


def interleaved_warmups(p: int, v: int, m: int, group_size: int | None = None) -> list[int]:
    """Warm-up forwards of LLM rank ``i = 0..p-1`` in ``interleaved_1f1b``: ``p - i - 1`` for ``v = 1`` (1F1B),
    else ``2 (p - i - 1) + (v - 1) G``
    (at most ``v M``), ``G`` the widest microbatch group (``group_size``, default ``p``, plus the remainder
    ``M mod group_size``; ``M`` when ``M < group_size``). Megatron-LM's warm-up (SC'21, section 2.2.2) with
    ``G = p`` when ``p`` divides ``M``. Rank ``i``'s peak: ``warm-up + 1`` chunk activations in flight."""
    if v == 1:  # plain 1F1B
        return [min(p - i - 1, m) for i in range(p)]
    g = p if group_size is None else group_size
    widest = max(len(group) for group in _groups(m, g))
    return [min(2 * (p - i - 1) + (v - 1) * widest, v * m) for i in range(p)]


@dataclass(frozen=True)
class _Interleaving:
    """Where the LLM chunks and encoder stages of a plan sit, for ``interleaved_1f1b``."""

    llm_ranks: tuple[int, ...]  # LLM rank i -> pipeline rank
    v: int
    attached: tuple[int, ...]  # encoder stages on the first LLM stage's rank, index order
    alone: tuple[int, ...]  # encoder stages alone on their own rank, index order

    @property
    def p(self) -> int:
        return len(self.llm_ranks)


def _interleaved_layout(plan: PipelinePlan) -> _Interleaving:
    llm = plan.llm_stages
    ranks: list[int] = []
    for s in llm:
        if plan.stages[s].rank in ranks:
            break
        ranks.append(plan.stages[s].rank)
    p = len(ranks)
    if len(llm) % p or any(plan.stages[s].rank != ranks[j % p] for j, s in enumerate(llm)):
        got = [plan.stages[s].rank for s in llm]
        raise ValueError(f"interleaved_1f1b: LLM stage j must be on the rank of LLM stage j mod p, got ranks {got}")
    attached, alone = [], []
    for stage in plan.stages[: llm[0]]:
        if stage.rank == ranks[0]:
            if not all(t == llm[0] or plan.stages[t].rank == ranks[0] for t in plan.successors(stage.index)):
                raise ValueError(f"interleaved_1f1b: encoder stage {stage.index} is on the first LLM rank "
                                 "but feeds a stage on another rank")
            attached.append(stage.index)
        elif stage.rank in ranks:
            raise ValueError(f"interleaved_1f1b: encoder stage {stage.index} shares LLM rank {stage.rank}; "
                             "only the first LLM stage's rank may hold encoder stages")
        elif len(plan.stages_on_rank(stage.rank)) > 1:
            raise ValueError(f"interleaved_1f1b: rank {stage.rank} holds several encoder stages "
                             f"{plan.stages_on_rank(stage.rank)}; give each its own rank")
        else:
            alone.append(stage.index)
    return _Interleaving(tuple(ranks), len(llm) // p, tuple(attached), tuple(alone))


def _groups(m: int, g: int) -> list[range]:
    """Microbatch groups of ``g`` (the remainder ``m mod g`` joins the last group; one group when
    ``m < g``): a group shorter than ``p`` would make chunk ``c + 1`` wait on chunk ``c`` of the same
    microbatches too soon for the warm-up."""
    starts = list(range(0, max(m - g + 1, 1), g))
    return [range(a, starts[k + 1] if k + 1 < len(starts) else m) for k, a in enumerate(starts)]


def interleaved_chunk_order(m: int, v: int, g: int, reverse: bool = False) -> list[tuple[int, int]]:
    """``(chunk, microbatch)`` in the order an LLM rank of ``interleaved_1f1b`` runs its forwards (``reverse``:
    its backwards): per microbatch group of ``g`` (the remainder joins the last group), chunk by chunk
    (chunks reversed for the backward)."""
    out = []
    for mbs in _groups(m, g):
        for c in range(v):
            out.extend((v - 1 - c if reverse else c, mb) for mb in mbs)
    return out


def _interleaved_actions(plan: PipelinePlan, lay: _Interleaving, m: int, g: int, warmups: Sequence[int],
                         split: bool) -> list[list[Action]]:
    llm = plan.llm_stages
    out: list[list[Action]] = [[] for _ in range(plan.num_ranks)]
    for i, rank in enumerate(lay.llm_ranks):
        stage_of = [llm[c * lay.p + i] for c in range(lay.v)]
        fwd = [Action("F", stage_of[c], mb) for c, mb in interleaved_chunk_order(m, lay.v, g, False)]
        bwd = [Action("B", stage_of[c], mb) for c, mb in interleaved_chunk_order(m, lay.v, g, True)
               if plan.stages[stage_of[c]].runs_backward]
        order = fwd[: warmups[i]]
        rest_f, rest_b = fwd[warmups[i]:], list(bwd)
        while rest_f or rest_b:
            if rest_f:
                order.append(rest_f.pop(0))
            if rest_b and (not rest_f or len(order) > warmups[i]):
                order.append(rest_b.pop(0))
        out[rank] = _with_attached(plan, order, lay.attached, split)
    for s in reversed(lay.alone):
        out[plan.stages[s].rank] = _alone_order(plan, s, m, out, split)
    return out


def _backward_kinds(plan: PipelinePlan, s: int, split: bool) -> tuple[str, ...]:
    return ("B", "W") if split and plan.stages[s].trainable else ("B",)


def _with_attached(plan: PipelinePlan, order: list[Action], attached: Sequence[int], split: bool) -> list[Action]:
    """``order`` with ``W`` after each trainable ``B`` (when split) and the attached encoder stages' ``F``
    before the first LLM stage's ``F`` and their backwards after its ``B``."""
    first = plan.llm_stages[0]
    out: list[Action] = []
    for action in order:
        if action.kind == "F" and action.stage == first:
            out.extend(Action("F", s, action.microbatch) for s in attached)
        out.extend(Action(k, action.stage, action.microbatch) for k in
                   (("F",) if action.kind == "F" else _backward_kinds(plan, action.stage, split)))
        if action.kind == "B" and action.stage == first:
            for s in reversed(attached):
                if plan.stages[s].runs_backward:
                    out.extend(Action(k, s, action.microbatch) for k in _backward_kinds(plan, s, split))
    return out


def _alone_order(plan: PipelinePlan, s: int, m: int, out: Sequence[list[Action]], split: bool) -> list[Action]:
    """1F1B order of an encoder stage alone on its rank, with the least warm-up its successor needs: before
    ``B(s, i)`` it has run as many forwards as its successor ran before ``B(t, i)``."""
    if not plan.stages[s].runs_backward:
        return [Action("F", s, i) for i in range(m)]
    t = plan.successors(s)[0]
    forwards, need = 0, 1
    for action in out[plan.stages[t].rank]:
        if action.stage == t and action.kind == "F":
            forwards += 1
        elif action.stage == t and action.kind == "B":
            need = max(need, forwards - action.microbatch)
    return _stage_order(plan, s, m, need, split)


def build_schedule(plan: PipelinePlan, name: str, num_microbatches: int | None = None, **options: Any) -> Schedule:
    """The schedule generator called ``name`` (one of ``SCHEDULE_NAMES``), e.g. from a config.

    Raises:
        ValueError: on an unknown name, and whatever the generator raises.
    """
    generators = {"gpipe": gpipe, "1f1b": one_f_one_b, "memory_capped_1f1b": memory_capped_1f1b,
                  "interleaved_1f1b": interleaved_1f1b}
    if name not in generators:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULE_NAMES}")
    return generators[name](plan, num_microbatches, **options)


def _microbatches(plan: PipelinePlan, num_microbatches: int | None) -> int:
    m = plan.num_microbatches if num_microbatches is None else int(num_microbatches)
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    return m


def _stage_caps(plan: PipelinePlan, cap: int | Mapping[int, int]) -> dict[int, int]:
    caps = dict(cap) if isinstance(cap, Mapping) else {s: cap for s in range(plan.num_stages)}
    for stage, value in caps.items():
        if not 0 <= stage < plan.num_stages:
            raise ValueError(f"cap names stage {stage}, but the plan has stages 0..{plan.num_stages - 1}")
        if int(value) < 1:
            raise ValueError(f"cap for stage {stage} must be >= 1, got {value}")
    return {s: int(v) for s, v in caps.items() if plan.stages[s].runs_backward}


def _generate(
    plan: PipelinePlan,
    m: int,
    limits: Sequence[int],
    split: bool,
    defer: bool,
    name: str,
    hold: Sequence[int] | None = None,
) -> Schedule:
    """Per-stage orders with in-flight ``limits``, merged per rank, checked. ``hold[s]`` bounds the
    microbatches stage ``s`` may hold while ``W`` is deferred (default: the largest limit, i.e. the peak of
    the undeferred schedule, as in ZB-H1)."""
    if defer and not split:
        raise ValueError("defer_weight_grad needs split_backward=True (there is no W to defer otherwise)")
    orders = [_stage_order(plan, s, m, limits[s], split and not defer) for s in range(plan.num_stages)]
    if hold is None:
        deepest = max((limits[s.index] for s in plan.stages if s.runs_backward), default=1)
        hold = [deepest] * plan.num_stages
    actions = _merge_ranks(plan, orders, hold, split, defer, m)
    schedule = Schedule(plan=plan, actions=actions, num_microbatches=m, split_backward=split, name=name)
    check_schedule(schedule)
    return schedule


def _stage_order(plan: PipelinePlan, s: int, m: int, limit: int, inline_w: bool) -> list[Action]:
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


def _merge_ranks(
    plan: PipelinePlan, orders: Sequence[list[Action]], hold: Sequence[int], split: bool, defer: bool, m: int
) -> list[list[Action]]:
    """Interleave the per-stage orders of each rank by list scheduling on nominal unit costs.

    Time is counted in ticks (``F`` 1, ``B`` 1 split / 2 full, ``W`` 1). A free rank starts the ready head
    action of one of its stages (backwards first, then lower microbatch, then deeper stage); with ``defer``
    it runs a held-back ``W`` when no head is ready, or when a stage's next ``F`` would make it hold more
    than ``hold`` microbatches. With one stage per rank and no deferral this reproduces the stage orders exactly.
    """
    state = _MergeState(plan, orders, hold, split, defer, m)
    t = 0
    while not state.finished():
        for rank in range(plan.num_ranks):
            if state.rank_free[rank] <= t:
                state.start_next(rank, t)
        later = [f for f in state.rank_free if f > t]
        if not later:
            raise RuntimeError(f"schedule generator stalled at tick {t}: per-stage orders deadlock (a plait bug)")
        t = min(later)
    return state.out


class _MergeState:
    """Mutable bookkeeping of ``_merge_ranks`` (one instance per generator call)."""

    def __init__(
        self, plan: PipelinePlan, orders: Sequence[list[Action]], hold: Sequence[int], split: bool, defer: bool, m: int
    ) -> None:
        self.plan, self.orders, self.hold, self.split, self.defer = plan, orders, hold, split, defer
        self.pos = [0] * plan.num_stages
        self.pending_w: list[list[Action]] = [[] for _ in range(plan.num_stages)]
        self.in_flight = [0] * plan.num_stages
        self.end: dict[Action, int] = {}
        self.rank_free = [0] * plan.num_ranks
        self.out: list[list[Action]] = [[] for _ in range(plan.num_ranks)]
        self.total = len(expected_actions(plan, m, split))

    def finished(self) -> bool:
        """Every expected action has been placed."""
        return sum(len(o) for o in self.out) == self.total

    def _ready(self, action: Action, t: int) -> bool:
        return all(self.end.get(d, t + 1) <= t for d in action_dependencies(self.plan, action))

    def _head(self, s: int) -> Action | None:
        return self.orders[s][self.pos[s]] if self.pos[s] < len(self.orders[s]) else None

    def _blocked_by_limit(self, action: Action) -> bool:
        """A forward that would make its stage hold more than ``hold`` microbatches while Ws are deferred."""
        if not self.defer or action.kind != "F" or not self.plan.stages[action.stage].runs_backward:
            return False
        return self.in_flight[action.stage] >= self.hold[action.stage]

    def start_next(self, rank: int, t: int) -> None:
        """Start the best action ``rank`` can run at tick ``t``, if any (``_merge_ranks`` rules)."""
        stages = self.plan.stages_on_rank(rank)
        heads = [self._head(s) for s in stages]
        ready = [a for a in heads if a is not None and self._ready(a, t) and not self._blocked_by_limit(a)]
        if ready:
            action = min(ready, key=lambda a: (a.kind == "F", a.microbatch, -a.stage))
            self.pos[action.stage] += 1
        else:
            waiting = [self.pending_w[s][0] for s in stages if self.pending_w[s]]
            if not waiting:
                return
            blocked = {a.stage for a in heads if a is not None and self._blocked_by_limit(a)}
            action = min(waiting, key=lambda a: (a.stage not in blocked, a.microbatch, -a.stage))
            self.pending_w[action.stage].pop(0)
        self._record(rank, action, t)

    def _record(self, rank: int, action: Action, t: int) -> None:
        cost = {"F": 1, "B": 1 if self.split else 2, "W": 1}[action.kind]
        self.end[action] = t + cost
        self.rank_free[rank] = t + cost
        self.out[rank].append(action)
        stage = self.plan.stages[action.stage]
        if action.kind == "F" and stage.runs_backward:
            self.in_flight[action.stage] += 1
        if action.kind == "B" and self.defer and stage.trainable:
            self.pending_w[action.stage].append(Action("W", action.stage, action.microbatch))
        if frees_activations(self.plan, action, self.split):
            self.in_flight[action.stage] -= 1


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


# ----- timelines ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimelineEvent:
    """One timed action on one rank: the format of predicted (simulator) and measured (runtime) timelines.

    Attributes:
        rank: pipeline rank that ran it.
        kind: ``"F"``, ``"B"``, ``"W"``, or another label for measured non-pipeline work (e.g. ``"optim"``).
        stage: stage index (-1 when not applicable).
        microbatch: microbatch index (-1 when not applicable).
        start_s: start time (seconds; any common origin).
        end_s: end time (seconds), ``>= start_s``.

    Raises:
        ValueError: on an empty kind, a negative rank or ``end_s < start_s``.
    """

    rank: int
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not self.kind or self.rank < 0:
            raise ValueError(f"TimelineEvent needs a kind and a rank >= 0, got {self.kind!r}/{self.rank}")
        if self.end_s < self.start_s:
            raise ValueError(f"TimelineEvent {self.kind} on rank {self.rank}: end {self.end_s} < start {self.start_s}")

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` (seconds)."""
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TimelineEvent":
        return dataclass_from_dict(cls, dict(data))


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
