"""``parallel.plan = "auto"``: choose the pipeline layout of a job from measured unit costs (pure).

:func:`plan_auto_layout` searches layout, stages per module, cost-balanced partition, LLM stages per rank,
encoder placement and DP degree (``search.plan_layout``) among the plans the pipeline trainer can run on exactly
``world_size`` processes: ``dp x pipeline ranks = world_size``, with one stage per pipeline rank (1F1B), several
LLM stages per LLM rank (``virtual_stages``, interleaved 1F1B: Narayanan et al., SC'21, section 2.2.2) or the
encoders on the first LLM rank (``attach_encoders``). For each DP degree ``d`` dividing the world size, the best
plan of ``d`` replicas on ``world_size / d`` ranks each, with ``ceil(M / d)`` microbatches per replica and the DP
all-reduce of the trainable gradients over ``dp_link`` charged, is kept when it fills all of them (when it does
not, the best 1F1B plan with one stage per rank is tried as well); ``d = world_size``, plain DP, always fills
them. A DP degree above the microbatch count (replicas without a microbatch) is searched as one replica with one
microbatch and then timed with its all-reduce. Ties go to DP degrees that give every replica a microbatch, then to
fewer replicas. That search is :func:`plan_filling_layout`, and it runs inside ``plait plan``'s own search
(``search_parallel.plan_parallel`` with it as ``layout_search``): the plain plan, tensor parallelism, FSDP2
sharding (flat, every rank a DP rank, and staged, pipeline stages sharded over their DP ranks: the faster fitting
one) and activation checkpointing exactly as ``plait plan`` searches them, so for the same
job and costs both choose the same plan whenever ``plait plan``'s uses all the processes.
:func:`layout_pp_fields` gives the ``[parallel.pp]`` field values that run a choice (degree, layout,
stages, explicit ``splits`` where the partition is not the even split by unit count, ``virtual_stages``,
``attach_encoders``, the schedule, microbatches per replica); ``plait.train.apply_plan`` writes them into a job
config. Plain data in and out: nothing here reads a config, touches torch or the file system.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from plait.planner.cost.experts import ExpertLayer
from plait.planner.pipeline.plan import split_even, stage_ranks
from plait.planner.pipeline.schedules import IN_BUBBLE_SCHEDULES
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.search.layout import evaluate_plan, plan_layout, plan_layout_below
from plait.planner.search.model import Costs
from plait.planner.search.parallel import plan_parallel
from plait.planner.types import Unit, UnitCost

__all__ = ["AUTO_MACHINE", "AUTO_SPACE", "layout_pp_fields", "plan_auto_layout", "plan_filling_layout",
           "plan_splits"]


AUTO_MACHINE = Machine(dtype="float32")
"""``plan_auto_layout``'s default machine: no cap, free links, float32 parameters."""
AUTO_SPACE = SearchSpace(virtual_stages=(1, 2, 4), attach_encoders=True, in_bubble=True)
"""``plan_auto_layout``'s default search space: interleaved 1F1B with 2 or 4 LLM stages per rank and encoders on
the first LLM rank searched too (the pipeline trainer runs them)."""


def plan_auto_layout(units: Sequence[Unit], costs: Sequence[UnitCost], world_size: int, microbatches: int, *,
                     machine: Machine = AUTO_MACHINE, space: SearchSpace = AUTO_SPACE,
                     experts: Sequence[ExpertLayer] = ()) -> LayoutChoice:
    """The fastest runnable plan for ``world_size`` processes (module docstring): ``plait plan``'s search
    (``search_parallel.plan_parallel``) with :func:`plan_filling_layout` as its layout search.

    Args:
        units, costs: pipeline units (real flags) and their per-microbatch costs (e.g. a measured profile).
        world_size: processes of the job; microbatches: global microbatches per step.
        machine: memory cap (None: unchecked), the stage-to-stage ``p2p`` link (also the TP all-reduces'), the
            ``dp_link`` of the DP gradient all-reduce (ring, ``search.allreduce_s``, of each rank's trainable
            parameters after the flush; None: not charged; also FSDP2's collectives'), dtype, the runtime's fixed
            ``overheads`` (``search.plan_layout``).
        space: as ``plan_parallel``: ``virtual_stages``, ``attach_encoders``, the job's activation checkpointing
            (``base_checkpointing``, ``checkpoint_overrides``: ``costs`` are without it; when the plain plan does
            not fit, a job without checkpointing may get one), ``tp_degrees``, ``dp_shard_degrees``,
            ``fsdp_reshard``, ``prefer_plain`` and ``offload``.
        experts: a MoE LLM's layers (``cost.experts.expert_layers``): expert parallelism is searched as
            ``plan_parallel`` searches it (``space.ep_degrees``); ``()``: no EP.

    Returns:
        The chosen ``LayoutChoice`` (``dp * plan.num_ranks * tp == world_size``; ``schedule`` is ``"1f1b"`` or
        ``"interleaved_1f1b"``; ``dp_shard`` and ``ep`` divide ``dp``).

    Raises:
        ValueError: on a world size or microbatch count < 1; ``NoPlanFits`` when no plan fits memory.
    """
    if world_size < 1 or microbatches < 1:
        raise ValueError(f"world_size and microbatches must be >= 1, got {world_size} and {microbatches}")
    return plan_parallel(units, costs, world_size, microbatches=microbatches, machine=machine, space=space,
                         layout_search=plan_filling_layout, experts=experts)


def plan_filling_layout(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int,
                        machine: Machine = Machine(), space: SearchSpace = SearchSpace(),
                        beat: float = math.inf) -> LayoutChoice | None:
    """``search.plan_layout`` restricted to the plans that use all ``devices`` (module docstring): for each DP
    degree (default every divisor of ``devices``, above ``microbatches`` too) that divides ``devices`` and that
    ``machine.dp_shard`` divides, the best plan of that many replicas filling their ranks; the fastest of those,
    ties to every replica having a microbatch, then to fewer replicas. Same signature as ``plan_layout`` (the
    ``search_parallel.LayoutSearch`` of ``parallel.plan = "auto"``), plus ``beat``.

    Args:
        beat: a time to beat (seconds; 1F1B's schedules only, as ``layout.plan_layout_below``): each DP degree's
            searches stop at it, and the result is the same plan whenever it is faster than ``beat``, else None or
            a plan not faster (a plan filling its ranks is among its search's plans, so no faster than its best).

    Raises:
        ValueError: when no DP degree gives a runnable plan that fits memory (naming each degree's reason; with
            ``beat`` finite, None instead when some degree found nothing faster).
    """
    best: LayoutChoice | None = None
    errors, below = [], False
    candidates = space.dp_degrees if space.dp_degrees is not None else range(1, devices + 1)
    for dp in (d for d in candidates if devices % d == 0 and d % machine.dp_shard == 0):
        try:
            choice = _filling_choice(units, costs, (devices, microbatches, dp), machine, space, beat)
        except ValueError as exc:
            errors.append(f"dp {dp}: {exc}")
            continue
        if choice is not None and (best is None or _rank(choice) < _rank(best)):
            best = choice
        elif choice is None:
            below = below or beat < math.inf
            errors.append(f"dp {dp}: no plan uses all {devices // dp} ranks of a replica")
    if best is None and below:
        return None
    if best is None:
        raise ValueError(f"no runnable plan for {devices} processes: " + ("; ".join(errors) or "no DP degree"))
    return best


def _filling_choice(units: Sequence[Unit], costs: Costs, shape: tuple[int, int, int], machine: Machine,
                    space: SearchSpace, beat: float = math.inf) -> LayoutChoice | None:
    """The best plan of ``dp`` replicas (``shape``: world size, microbatches, dp) that uses all ``world_size / dp``
    ranks of each: the full search's, else (it leaves ranks idle) the best 1F1B plan with one stage per rank if
    that one fills them; else None (also when, ``beat`` finite, the full search finds nothing faster than it: the
    one-stage-per-rank plans are among its plans).

    Raises:
        ValueError: when no plan fits memory (``plan_layout``).
    """
    world_size, microbatches, dp = shape
    one_per_rank = dataclasses.replace(space, virtual_stages=(1,), attach_encoders=False, in_bubble=False)
    attempts = [space] if space == one_per_rank else [space, one_per_rank]
    for options in attempts:
        choice = _search_dp(units, costs, shape, machine, options, beat)
        if choice is None:
            return None
        if choice.plan.num_ranks * dp == world_size:
            return choice
    return None


def _search_dp(units: Sequence[Unit], costs: Costs, shape: tuple[int, int, int], machine: Machine,
               space: SearchSpace, beat: float = math.inf) -> LayoutChoice | None:
    """``plan_layout`` restricted to DP degree ``dp`` (``shape``: world size, microbatches, dp; all-reduce charged
    in the search; ``layout.plan_layout_below`` with ``beat`` finite: None when nothing is faster). ``plan_layout``
    takes DP degrees up to ``microbatches`` only: a larger ``dp`` is searched as one replica with one microbatch on
    ``world_size / dp`` devices, then timed as ``dp`` replicas with the all-reduce (``evaluate_plan``; not stopped
    at ``beat``)."""
    world_size, microbatches, dp = shape
    if dp <= microbatches:
        searched = dataclasses.replace(space, dp_degrees=(dp,))
        if beat < math.inf:
            return plan_layout_below(units, costs, world_size, microbatches=microbatches, machine=machine,
                                     space=searched, beat=beat)
        return plan_layout(units, costs, world_size, microbatches=microbatches, machine=machine, space=searched)
    one = plan_layout(units, costs, world_size // dp, microbatches=1, machine=dataclasses.replace(machine, dp_shard=1),
                      space=dataclasses.replace(space, dp_degrees=(1,)))
    timed = evaluate_plan(one.plan, units, costs, dp=dp, microbatches=microbatches, devices=world_size,
                          machine=machine, schedule=one.schedule)
    return dataclasses.replace(timed, method=one.method, candidates=one.candidates, simulated=one.simulated)


def _rank(choice: LayoutChoice) -> tuple:
    """Order of preference: faster, then no replica without a microbatch, then fewer replicas."""
    return (choice.iteration_s, choice.dp > choice.microbatches, choice.dp)


def plan_splits(plan: PipelinePlan) -> dict[str, list[str]]:
    """Per module with more than one stage, the first unit of each of its stages after the first (the
    ``splits`` of ``plan_pipeline``)."""
    out = {}
    for module in plan.modules:
        stages = [s for s in plan.module_stages(module) if plan.stages[s].replica == 0]  # one of each replica group
        if len(stages) > 1:
            out[module] = [plan.stages[s].module_units(module)[0] for s in stages[1:]]
    return out


def _even_splits(units: Sequence[Unit], module: str, count: int) -> list[str]:
    """Boundaries of ``plan_pipeline``'s even split by unit count (``pipeline_plan.split_even``)."""
    chunks = split_even(module, [u for u in units if u.module == module], count)
    return [chunk[0].name for chunk in chunks[1:]]


def _encoders_in_bubble(plan: PipelinePlan) -> bool:
    """True when the plan places its encoder stages on its LLM ranks as ``encoders_in_bubble`` does
    (``plan.stage_ranks(..., in_bubble=True)``) and some encoder stage is on another rank than the first LLM one."""
    encoders = [s.rank for s in plan.stages if not s.is_llm]
    llm = [plan.stages[s].rank for s in plan.llm_stages]
    if not encoders or plan.virtual_stages != 1 or llm != list(range(len(llm))):
        return False
    return tuple(encoders) + tuple(llm) == stage_ranks(len(encoders), len(llm), in_bubble=True) and max(encoders) > 0


def _encoders_attached(plan: PipelinePlan) -> bool:
    """True when the plan's encoder stages share the first LLM stage's rank (``attach_encoders``)."""
    first = plan.stages[plan.llm_stages[0]].rank
    return not _encoders_in_bubble(plan) and any(s.rank == first for s in plan.stages if not s.is_llm)


def layout_pp_fields(choice: LayoutChoice, units: Sequence[Unit]) -> dict[str, Any]:
    """The ``[parallel.pp]`` field values (``PipelineConfig`` field names) that run ``choice``'s plan, one replica.

    ``{"degree": 1}`` when the plan is a single rank; else the degree, layout, stage counts for every module (the
    LLM's: all its stages), ``splits`` only for modules whose boundaries differ from the even split by count,
    ``virtual_stages`` = the plan's LLM stages per rank, ``encoders_in_bubble`` when its encoder stages sit on its
    LLM ranks from the last (``_encoders_in_bubble``), ``attach_encoders`` when they share the
    first LLM rank (with one encoder stage, layout ``encoders_colocated``: the search's attached plans are
    colocated, and a one-encoder-stage plan is the same in both layouts), the schedule (``choice.schedule``:
    ``interleaved_1f1b`` or the V's ``zb_v`` exactly for those plans) and the microbatches per replica; ``encoder_dp``
    (the replicas of each replicated encoder branch's stages, ``LayoutChoice.encoder_dp``) and ``encoder_tp`` (the TP
    degree of each tensor-parallel branch's stages, ``LayoutChoice.encoder_tp``) when it has any.
    The DP degree is ``choice.dp``.

    Raises:
        ValueError: when ``choice.schedule`` is not the one such a plan runs with.
    """
    plan = choice.plan
    if plan.num_ranks == 1:
        return {"degree": 1}
    counts = {m: sum(plan.stages[s].replica == 0 for s in plan.module_stages(m)) for m in plan.modules}
    splits = {m: names for m, names in plan_splits(plan).items()
              if names != _even_splits(units, m, counts[m])}
    attached, in_bubble = _encoders_attached(plan), _encoders_in_bubble(plan)
    shared = plan.virtual_stages > 1 or attached
    schedule = choice.schedule
    if (schedule in ("interleaved_1f1b", "zb_v")) != shared:
        need = "interleaved_1f1b or zb_v" if shared else "a schedule of one stage per rank"
        raise ValueError(f"LayoutChoice.schedule is {choice.schedule!r}, but [parallel.pp] runs its plan "
                         f"(virtual_stages={plan.virtual_stages}, attach_encoders={attached}) with {need}")
    if in_bubble and schedule not in IN_BUBBLE_SCHEDULES:
        raise ValueError(f"LayoutChoice.schedule is {choice.schedule!r}, but [parallel.pp] runs encoders in the "
                         f"bubbles with one of {IN_BUBBLE_SCHEDULES}")
    layout = plan.layout
    if (attached or in_bubble) and sum(not s.is_llm for s in plan.stages) == 1:
        layout = "encoders_colocated"  # one encoder stage: the same plan either way, named as the search's are
    fields = {"degree": plan.num_ranks, "layout": layout, "stages": counts, "virtual_stages": plan.virtual_stages,
              "attach_encoders": attached, "encoders_in_bubble": in_bubble, "schedule": schedule,
              "microbatches": choice.microbatches_per_replica, "splits": splits}
    if choice.encoder_dp:  # replicated encoder stages: each of the branch's stages on that many ranks
        fields["encoder_dp"] = dict(choice.encoder_dp)
    if choice.encoder_tp:  # tensor-parallel encoder stages: each of the branch's stages a TP group of that many
        fields["encoder_tp"] = dict(choice.encoder_tp)
    return fields
