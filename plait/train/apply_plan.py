"""A chosen layout written into a job config: the config side of ``parallel.plan = "auto"`` and of the
``[parallel.pp]`` table ``plait plan`` prints.

:func:`apply_layout_choice` writes a ``LayoutChoice`` (``plait.planner.search.auto_layout.layout_pp_fields``) into a copy
of a ``JobConfig`` and checks that the ``[parallel.pp]`` it wrote rebuilds the chosen plan as the trainer builds
it; :func:`resolve_auto_plan` searches (``plait.planner.search.auto_layout.plan_auto_layout``) and applies. The search
itself is pure planner code; this module is where it meets the config (no torch, no files).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from plait.config.loader import pipeline_plan_kwargs
from plait.config.schema import JobConfig, PipelineConfig
from plait.parallel.activation_checkpointing import checkpoint_policy
from plait.planner.cost.experts import ExpertLayer
from plait.planner.search.auto_layout import AUTO_MACHINE, AUTO_SPACE, layout_pp_fields, plan_auto_layout
from plait.planner.search.encoder_dp import encoder_dp_bounds
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["apply_layout_choice", "auto_encoder_dp", "auto_microbatches", "kept_degrees", "resolve_auto_plan"]


def auto_microbatches(cfg: JobConfig) -> int:
    """Global microbatches per step: ``train.global_batch_size / train.microbatch_size`` (rounded up)."""
    return max(1, -(-cfg.train.global_batch_size // cfg.train.microbatch_size))


def kept_degrees(cfg: JobConfig, devices: int, named: str = "") -> dict[str, Any]:
    """The ``SearchSpace`` fields (``search_parallel.plan_parallel``, ``plan_auto_layout``) that keep the job's
    own ``parallel.tp`` / ``parallel.dp_shard`` when either is above 1: exactly those degrees, searched even when
    the plain plan fits (``prefer_plain=False``), its ``parallel.fsdp_reshard`` when not ``"auto"`` and its
    ``parallel.offload = "cpu"`` (offloaded plans only); ``{}`` when both are 1 (every TP and shard degree is then
    weighed, whether or not the plain plan fits; the loader refuses FSDP2 options without ``dp_shard`` > 1). The one rule of
    ``plait plan`` and ``parallel.plan = "auto"``.

    Raises:
        ValueError: when ``tp x dp_shard`` does not divide ``devices`` (named).
    """
    tp, shard = cfg.parallel.tp, cfg.parallel.dp_shard
    if tp == 1 and shard == 1:
        return {}
    if devices % (tp * shard):
        raise ValueError(f"the job's parallel.tp = {tp} x parallel.dp_shard = {shard} does not divide "
                         f"{named or f'the {devices} processes'}: change it or set them to 1 to let the plan choose")
    kept: dict[str, Any] = dict(tp_degrees=[tp], dp_shard_degrees=[shard], prefer_plain=False)
    if cfg.parallel.fsdp_reshard != "auto":  # the job's own FSDP2 resharding too (it needs dp_shard > 1)
        kept["fsdp_reshard"] = [cfg.parallel.fsdp_reshard]
    if cfg.parallel.offload == "cpu":  # the job's own CPU offload: the plan offloads too, whether or not it must
        kept["offload"] = "cpu"
    return kept


def auto_encoder_dp(cfg: JobConfig, units: Sequence[Unit]) -> tuple[tuple[str, int], ...]:
    """``SearchSpace.encoder_dp`` of ``parallel.plan = "auto"``: every encoder branch of ``units`` up to
    ``train.microbatch_size`` replicas (``search.encoder_dp.encoder_dp_bounds``, as ``plait plan`` searches them by
    default), each branch the job names in ``parallel.pp.encoder_dp`` at most that degree (``{vision = 1}``: its
    stages not replicated; a table of 1s for every branch turns the search off); ``()``: nothing to search."""
    limits = cfg.parallel.pp.encoder_dp
    bounds = encoder_dp_bounds(units, cfg.train.microbatch_size)
    capped = ((m, min(d, limits.get(m.split(".")[0], d))) for m, d in bounds)
    return tuple((m, d) for m, d in capped if d > 1)


def apply_layout_choice(cfg: JobConfig, choice: LayoutChoice, units: Sequence[Unit]) -> JobConfig:
    """A copy of ``cfg`` running ``choice``: ``parallel.dp`` = its replicas (``choice.dp / choice.dp_shard``),
    ``parallel.dp_shard``, ``parallel.tp`` and ``parallel.ep`` = its FSDP2, TP and expert-parallel degrees, ``parallel.offload`` = its FSDP2 CPU
    offload (``"none"`` or ``"cpu"``), ``parallel.fsdp_reduce`` = its gradient reduction, ``parallel.fsdp_reshard``
    = its FSDP2 resharding (``"auto"`` with pipeline stages or without FSDP2), ``[parallel.pp]`` = its plan
    (``layout_pp_fields``: degree 1 when it is a single rank), ``parallel.rank_order`` = its rank order when that
    is not the default (a search with nodes, ``Machine.topology``), ``parallel.plan = "manual"`` (resolved), and
    ``train.activation_checkpointing`` = its policy when it has one (a choice without checkpointing leaves the
    job's policy: its costs were the job's).

    Raises:
        ValueError: when ``[parallel.pp]`` cannot express the plan (the plan it describes, built with
            ``pipeline_plan_kwargs`` as the trainer does, would differ from ``choice.plan`` in units or ranks),
            or ``choice.schedule`` is not the one such a plan runs with.
    """
    out = copy.deepcopy(cfg)
    out.parallel.plan = "manual"
    out.parallel.dp = choice.dp // choice.dp_shard
    out.parallel.dp_shard = choice.dp_shard
    out.parallel.tp = choice.tp
    out.parallel.ep = choice.ep
    out.parallel.offload = choice.offload
    out.parallel.fsdp_reduce = choice.fsdp_reduce
    out.parallel.fsdp_reshard = choice.fsdp_reshard if choice.dp_shard > 1 and choice.plan.num_ranks == 1 else "auto"
    if choice.rank_order != "dp_outer":  # the order its links were charged for, whatever the node size at run time
        out.parallel.rank_order = choice.rank_order
    if choice.checkpointing != "none":
        out.train.activation_checkpointing = choice.checkpointing
    out.parallel.pp = PipelineConfig(**layout_pp_fields(choice, units))
    if choice.plan.num_ranks > 1:
        _check_expressed(out.parallel.pp, choice.plan, units)
    return out


def _check_expressed(pp: PipelineConfig, plan: PipelinePlan, units: Sequence[Unit]) -> None:
    """``pp`` describes ``plan``: the plan built from it as the trainer builds it has the same stages (units,
    modules, replicas of a replicated encoder stage) on the same ranks.

    Raises:
        ValueError: naming the first stage that differs.
    """
    encoders = list(dict.fromkeys(u.module for u in units if u.module != LLM_MODULE))
    rebuilt = plan_pipeline(units, pp.layout, **pipeline_plan_kwargs(pp, encoders))
    got = [(s.modules, s.units, s.rank, s.replica, s.replicas, s.tensor_parallel) for s in rebuilt.stages]
    want = [(s.modules, s.units, s.rank, s.replica, s.replicas, s.tensor_parallel) for s in plan.stages]
    if got != want:
        where = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise ValueError(f"[parallel.pp] cannot express the chosen plan: stage {where} would be "
                         f"{got[where] if where < len(got) else None}, the plan has "
                         f"{want[where] if where < len(want) else None}")


def resolve_auto_plan(cfg: JobConfig, world_size: int, units: Sequence[Unit], costs: Sequence[UnitCost], *,
                      machine: Machine = AUTO_MACHINE, space: SearchSpace = AUTO_SPACE,
                      experts: Sequence[ExpertLayer] = ()) -> tuple[JobConfig, LayoutChoice]:
    """``cfg`` with ``parallel.plan = "auto"`` resolved for ``world_size`` processes from unit costs: the
    config to train with and the chosen plan (``plan_auto_layout`` on ``machine``, e.g. ``dp_link`` for the DP
    all-reduce and ``overheads`` for the runtime's fixed costs (``plait plan``'s ``measure.host_costs.runtime_costs``), and
    ``space`` with the job's activation checkpointing, whose recomputation it charges; when nothing fits the memory
    cap it searches TP, FSDP2 and checkpointing too, and a job's own ``parallel.tp`` / ``parallel.dp_shard`` above 1
    are kept as ``plait plan`` keeps them (:func:`kept_degrees`); a MoE LLM's ``experts``
    (``plan_search.job_expert_layers``) let it choose expert parallelism; per-encoder data-parallel degrees are
    searched as ``plait plan`` searches them (:func:`auto_encoder_dp`); :func:`apply_layout_choice`).

    Raises:
        ValueError: when ``parallel.plan`` is not ``"auto"``, the units are not the model's (no LLM unit), the
            job's ``tp x dp_shard`` does not divide ``world_size``; ``NoPlanFits`` when no plan fits.
    """
    if cfg.parallel.plan != "auto":
        raise ValueError(f"parallel.plan is {cfg.parallel.plan!r}; only 'auto' is resolved")
    if not any(u.module == LLM_MODULE for u in units):
        raise ValueError("units have no LLM unit: they are not a plait model's pipeline units")
    policy, overrides = checkpoint_policy(cfg)  # recomputation charged (planner.sharding.shard_costs)
    space = dataclasses.replace(space, base_checkpointing=policy, checkpoint_overrides=overrides,
                                encoder_dp=auto_encoder_dp(cfg, units), **kept_degrees(cfg, world_size))
    choice = plan_auto_layout(units, costs, world_size, auto_microbatches(cfg), machine=machine, space=space,
                              experts=experts)
    return apply_layout_choice(cfg, choice, units), choice
