"""Interleaved 1F1B: pipeline schedules with several LLM chunks (virtual stages) per rank.

Source: Narayanan et al., "Efficient large-scale language model training on GPU clusters using Megatron-LM",
SC'21, section 2.2.2 (our own formulation; ``interleaved_1f1b`` for the rules). Each LLM rank holds ``v``
LLM chunks (stages ``i, i + p, ...``), cutting the bubble about ``v`` times; encoder stages sit on their own
ranks (1F1B with the warm-up their successor needs) or on the first LLM stage's rank (run right before /
after it). ``pipeline_plan.interleaved_ranks`` places the stages. The layout search reads the warm-ups and
chunk orders (``interleaved_warmups``, ``interleaved_chunk_order``) for its bounds and times the unchecked
orders (``interleaved_orders``) of many candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.planner.pipeline.types import PipelinePlan
from plait.planner.pipeline.schedule_cache import memoized_schedule
from plait.planner.pipeline.schedule_ir import (
    Action,
    Schedule,
    check_schedule,
    one_f_one_b_actions,
    resolve_microbatches,
    run_blocking,
)

__all__ = [
    "interleaved_1f1b",
    "interleaved_chunk_order",
    "interleaved_orders",
    "interleaved_warmups",
    "runs_interleaved",
]


@memoized_schedule
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
    m = resolve_microbatches(plan, num_microbatches)
    layout, g, warmups = _interleaved_setup(plan, m, group_size)
    while True:
        schedule = Schedule(plan=plan, actions=_interleaved_actions(plan, layout, m, g, warmups, split_backward),
                            num_microbatches=m, split_backward=split_backward, name="interleaved_1f1b")
        heads = run_blocking(schedule)
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


@memoized_schedule
def interleaved_orders(
    plan: PipelinePlan, num_microbatches: int | None = None, *, split_backward: bool = False,
    group_size: int | None = None,
) -> list[list[Action]]:
    """Per-rank action lists of ``interleaved_1f1b`` with the warm-ups of ``interleaved_warmups``, *not*
    checked (no safety net): for planners that time many candidates and detect a stall themselves.

    Raises:
        ValueError: as ``interleaved_1f1b``.
    """
    m = resolve_microbatches(plan, num_microbatches)
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
        """LLM ranks."""
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
    return one_f_one_b_actions(plan, s, m, need, split)
