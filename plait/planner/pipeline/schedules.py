"""Pipeline schedule generators: GPipe, 1F1B, memory-capped 1F1B, forward-only, and ``build_schedule`` by name.

The schedule itself (``Action``, ``Schedule``, dependencies, checker) is ``schedule_ir``; a generator
returns a checked ``Schedule`` for a ``PipelinePlan``; ``build_schedule`` picks one by name (a config's
``parallel.pp.schedule``).

Generators (all deadlock-free by construction, and checked before they return):

- ``gpipe``: all forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019).
- ``one_f_one_b``: multimodal 1F1B (one-forward-one-backward with a flush per iteration: Narayanan et al.,
  "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush), ICML 2021, section 2; multimodal
  warm-up from Cornstarch): a stage of depth ``d``
  (``PipelinePlan.depth``) warms up with ``d - 1`` forwards, then alternates forward and backward, then
  drains. For encoder stage ``i`` of a branch with ``S_enc`` stages, ``d - 1 = S_enc + S_llm - i - 1``;
  for LLM stage ``j``, ``S_llm - j - 1``.
- ``memory_capped_1f1b``: 1F1B with at most ``cap`` microbatches in flight per stage (warm-up
  ``min(d, cap) - 1``); forward-only stages keep no activations and are not capped.
- ``interleaved_1f1b`` (``schedules_interleaved``): interleaved 1F1B with virtual pipeline stages (Narayanan et al., "Efficient
  large-scale language model training on GPU clusters using Megatron-LM", SC'21, section 2.2.2): each LLM
  rank holds ``v`` LLM chunks (stages ``i, i + p, ...``), cutting the bubble about ``v`` times; encoder
  stages sit on their own ranks (1F1B with the warm-up their successor needs) or on the first LLM stage's
  rank (run right before / after it). ``interleaved_ranks`` (pipeline_plan) places the stages.

- ``zb_h1``, ``zb_h2``: the zero-bubble schedules of Qi et al. (ICLR 2024): 1F1B with the backward split and the
  weight gradients run in the bubbles, at 1F1B's activation memory (H1) or about twice it with a longer warm-up (H2);
  the runtime runs ``W`` from the gradients ``B`` kept (``plait.parallel.pipeline.split_backward``).
- ``zb_v``: the V-shape zero-bubble schedule (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS
  2024, ZB-V): two LLM chunks per rank placed in a V (``plan.v_shape_ranks``), backward split, ``W`` in the bubbles,
  at 1F1B's activation memory; its bubble is one chunk forward per rank instead of ZB-H1's ``F + B - W``.

- ``forward_only``: forwards only, for evaluation (no backward actions; not a training schedule).

With ``split_backward=True`` each ``B`` is followed by its ``W``; with ``defer_weight_grad=True`` as well,
``W`` actions are held back: a rank runs a ready ``F``/``B`` first and a held ``W`` only when it would
otherwise wait (the bubbles), as in the zero-bubble schedules of Qi et al., "Zero Bubble Pipeline
Parallelism" (ICLR 2024, section 3, ZB-H1). A stage then holds at most as many microbatches as the deepest
stage of the undeferred schedule (the 1F1B peak, or the cap), so the peak stays that of the undeferred
schedule when stages keep equal activations. On a uniform chain with ``F = B = W`` this gives ZB-H1's
``M (F + B + W) + (S - 1)(F + B - W)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.pipeline.types import PipelinePlan
from plait.planner.pipeline.schedule_ir import (
    Action,
    Schedule,
    action_dependencies,
    check_schedule,
    expected_actions,
    frees_activations,
    one_f_one_b_actions,
    resolve_microbatches,
    run_blocking,
)
from plait.planner.pipeline.interleaved import interleaved_1f1b
from plait.planner.pipeline.schedule_cache import memoized_schedule

__all__ = [
    "IN_BUBBLE_SCHEDULES",
    "SCHEDULE_NAMES",
    "build_schedule",
    "forward_only",
    "gpipe",
    "memory_capped_1f1b",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
    "zb_v",
]

SCHEDULE_NAMES = ("gpipe", "1f1b", "memory_capped_1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_v")

IN_BUBBLE_SCHEDULES = ("gpipe", "1f1b", "memory_capped_1f1b", "zb_h1", "zb_h2")
"""The schedules that run encoder stages placed on LLM ranks (``plan.stage_ranks(..., in_bubble=True)``): they merge
the per-stage orders of a rank by list scheduling (``_merge_ranks``), so an encoder action runs where its rank would
otherwise wait: the warm-up and drain bubbles of the LLM stage it shares the rank with."""


# ----- generators ----------------------------------------------------------------------------------
@memoized_schedule
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
    m = resolve_microbatches(plan, num_microbatches)
    limits = [m] * plan.num_stages
    return _generate(plan, m, limits, split_backward, defer_weight_grad, "gpipe")


@memoized_schedule
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
    m = resolve_microbatches(plan, num_microbatches)
    limits = [plan.depth(s) for s in range(plan.num_stages)]
    return _generate(plan, m, limits, split_backward, defer_weight_grad, "1f1b")


@memoized_schedule
def memory_capped_1f1b(
    plan: PipelinePlan,
    num_microbatches: int | None = None,
    cap: int | Mapping[int, int] = 1,
    *,
    split_backward: bool = False,
    defer_weight_grad: bool = False,
) -> Schedule:
    """1F1B with at most ``cap`` microbatches in flight (forwarded, activations not yet freed) per stage.

    A stage of depth ``d`` warms up with ``min(d, cap) - 1`` forwards (Cornstarch's memory-aware schedule).
    Forward-only stages keep no activations and are not capped. Since
    warm-up depth never grows along an edge, the result stays deadlock-free.

    Args:
        cap: one cap for every stage, or ``{stage: cap}`` (stages not named are uncapped, i.e. 1F1B).
        Others: as ``gpipe``.

    Raises:
        ValueError: on a cap < 1, an unknown stage in ``cap``, and as ``gpipe``.
    """
    m = resolve_microbatches(plan, num_microbatches)
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


@memoized_schedule
def zb_h1(plan: PipelinePlan, num_microbatches: int | None = None) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B's warm-up and activation
    memory with the backward split into ``B`` (input gradient) and ``W`` (weight gradient) and each ``W`` held back
    into the rank's bubbles (module docstring). On a uniform chain with ``F = B = W``:
    ``M (F + B + W) + (S - 1)(F + B - W)``, a third of 1F1B's bubble. Frozen-aware: a stage whose units train no
    weight has no ``W`` (its bubbles take other stages' ``W`` on a shared rank), a forward-only stage no ``B``.

    Raises:
        ValueError: on ``M < 1``.
    """
    m = resolve_microbatches(plan, num_microbatches)
    return _generate(plan, m, [plan.depth(s) for s in range(plan.num_stages)], True, True, "zb_h1")


@memoized_schedule
def zb_h2(plan: PipelinePlan, num_microbatches: int | None = None) -> Schedule:
    """ZB-H2 (Qi et al., ICLR 2024, section 3.1): as :func:`zb_h1` with a warm-up of up to ``2 d - 1`` forwards on
    a stage of depth ``d`` (at most ``M``), so the ``W`` held back fill the drain as the extra forwards fill the
    warm-up; a stage holds up to twice 1F1B's microbatches (activation memory).

    Raises:
        ValueError: on ``M < 1``.
    """
    m = resolve_microbatches(plan, num_microbatches)
    return _generate(plan, m, [min(2 * plan.depth(s) - 1, m) for s in range(plan.num_stages)], True, True, "zb_h2")


@memoized_schedule
def zb_v(plan: PipelinePlan, num_microbatches: int | None = None) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024, section 3; our own
    formulation): the LLM is cut into ``2 p`` stages placed in a V over its ``p`` ranks (``plan.v_shape_ranks``:
    LLM rank ``i`` holds chunk 0 = LLM stage ``i`` and chunk 1 = LLM stage ``2p - 1 - i``), the backward is split
    and each ``W`` is held back into the rank's bubbles. Chunk-0 stages warm up with one forward fewer than their
    depth's 1F1B and chunk-1 stages with their depth's (``d - 2`` and ``d - 1``), so rank ``i`` holds at most
    ``(2p - i - 1) + (i + 1) = 2p`` chunk activations: 1F1B's ``p`` stage activations. On a uniform chain with
    chunk costs ``F/2, B/2, W/2`` (``F = B = W``) the iteration takes ``M (F + B + W) + (p - 1) F / 2``: the last
    LLM rank's first forward waits for ``p - 1`` chunk forwards, and nothing else idles (1F1B:
    ``(p - 1)(F + B + W)`` more). Multimodal: encoder stages on ranks of their own, or on the first LLM rank
    (``attach_encoders``), warm up as chunk 0 (one forward fewer than their depth). Frozen-aware as
    :func:`zb_h1`.

    Raises:
        ValueError: on ``M < 1``, an odd number of LLM stages, LLM stages not in a V over consecutive ranks, or an
            encoder stage on an LLM rank other than the first.
    """
    m = resolve_microbatches(plan, num_microbatches)
    _check_v_shape(plan)
    llm = plan.llm_stages
    second_chunk = set(llm[len(llm) // 2:])
    limits = [plan.depth(s) if s in second_chunk else max(plan.depth(s) - 1, 1) for s in range(plan.num_stages)]
    return _generate(plan, m, limits, True, True, "zb_v", hold=limits)


def _check_v_shape(plan: PipelinePlan) -> None:
    """The placement :func:`zb_v` runs (``plan.v_shape_ranks``).

    Raises:
        ValueError: naming the stage whose rank breaks it.
    """
    llm = plan.llm_stages
    if len(llm) % 2:
        raise ValueError(f"zb_v needs an even number of LLM stages (2 per LLM rank, in a V), got {len(llm)}")
    p, first = len(llm) // 2, plan.stages[llm[0]].rank
    for j, s in enumerate(llm):
        want = first + min(j, 2 * p - 1 - j)
        if plan.stages[s].rank != want:
            raise ValueError(f"zb_v: LLM stage {j} (plan stage {s}) is on rank {plan.stages[s].rank}, but a V over "
                             f"ranks {first}..{first + p - 1} puts it on rank {want} (plan.v_shape_ranks)")
    for stage in plan.stages:
        if not stage.is_llm and first < stage.rank < first + p:
            raise ValueError(f"zb_v: encoder stage {stage.index} is on LLM rank {stage.rank}; encoder stages go on "
                             f"ranks of their own or on the first LLM rank {first}")


def build_schedule(plan: PipelinePlan, name: str, num_microbatches: int | None = None, **options: Any) -> Schedule:
    """The schedule generator called ``name`` (one of ``SCHEDULE_NAMES``), e.g. from a config.

    Raises:
        ValueError: on an unknown name, and whatever the generator raises.
    """
    generators = {"gpipe": gpipe, "1f1b": one_f_one_b, "memory_capped_1f1b": memory_capped_1f1b,
                  "interleaved_1f1b": interleaved_1f1b, "zb_h1": zb_h1, "zb_h2": zb_h2, "zb_v": zb_v}
    if name not in generators:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULE_NAMES}")
    return generators[name](plan, num_microbatches, **options)


def forward_only(plan: PipelinePlan, num_microbatches: int | None = None) -> Schedule:
    """Forward passes only, for evaluation (validation loss, decoding): ``F(s, m)`` of every stage and
    microbatch and no ``B``/``W``, so the runtime keeps no activations (``Executor`` runs such a schedule without
    autograd). A rank runs its stages' forwards by microbatch, and within one microbatch from the input side
    (larger ``PipelinePlan.depth`` first): that is one global order consistent with every dependency, so the
    schedule cannot deadlock (checked by ``run_blocking``). Not a training schedule: ``check_schedule``, which
    wants the backward actions, does not apply.

    Raises:
        ValueError: when ``num_microbatches`` < 1.
    """
    m = resolve_microbatches(plan, num_microbatches)
    order = sorted(((mb, -plan.depth(s.index), s.index) for s in plan.stages for mb in range(m)))
    actions: list[list[Action]] = [[] for _ in range(plan.num_ranks)]
    for mb, _, s in order:
        actions[plan.stages[s].rank].append(Action("F", s, mb))
    schedule = Schedule(plan=plan, actions=actions, num_microbatches=m, name="forward_only")
    heads = run_blocking(schedule)
    if any(h < len(a) for h, a in zip(heads, schedule.actions)):  # cannot happen for a valid plan
        raise RuntimeError(f"forward_only schedule blocks at {heads} (a plait bug)")
    return schedule


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
    orders = [one_f_one_b_actions(plan, s, m, limits[s], split and not defer) for s in range(plan.num_stages)]
    if hold is None:
        deepest = max((limits[s.index] for s in plan.stages if s.runs_backward), default=1)
        hold = [deepest] * plan.num_stages
    actions = _merge_ranks(plan, orders, hold, split, defer, m)
    schedule = Schedule(plan=plan, actions=actions, num_microbatches=m, split_backward=split, name=name)
    check_schedule(schedule)
    return schedule


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
