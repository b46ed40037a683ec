"""Gradients of replicated encoder stages (``Stage.replicas`` > 1: an encoder branch with its own data-parallel
degree inside a pipeline; rows are split in :mod:`plait.parallel.encoder_rows`).
 a trainable replicated stage's parameters are held by its ``r`` replica ranks in each of the job's
DP x CP pipelines (per TP coordinate): :func:`reduce_replica_gradients` sums them over one process group per
replicated stage (created once per plan, collectively, on the first step that needs it).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from plait.parallel.dims import new_groups
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.tensor_parallel import sum_local_gradients
from plait.planner.pipeline.types import PipelinePlan

__all__ = ["reduce_replica_gradients", "replica_copies", "replicated_parameters"]


def replicated_parameters(stages: Any) -> dict[int, list[nn.Parameter]]:
    """Per replicated stage this rank runs (by the index of its replica 0): its trainable parameters (not those of a
    tensor-parallel stage's copies: each holds its own shards, summed over the DP x CP copies like any stage's)."""
    out: dict[int, list[nn.Parameter]] = {}
    for index, stage in stages.stages.items():
        if stage.stage.replicas > 1 and not stage.stage.tensor_parallel:  # a TP group holds shards, not copies
            params = [p for p in stage.params if p.requires_grad]
            if params:
                out[stage.stage.first_replica] = params
    return out


def replica_copies(stages: Any) -> set[int]:
    """``id`` of every trainable parameter of this rank's replicated stages."""
    return {id(p) for params in replicated_parameters(stages).values() for p in params}


def _replica_groups(plan: PipelinePlan, comm: PipelineComm) -> dict[int, Any]:
    """One process group per replicated stage: its replicas' ranks in every pipeline of this TP coordinate
    (the DP x CP copies). Collective over the job; kept in ``comm.replica_groups`` for the plan."""
    key = plan.to_json()
    if key in comm.replica_groups:
        return comm.replica_groups[key]
    pipelines: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pipelines, (comm.tp_rank, comm.pp_ranks))
    by_tp: dict[int, list[tuple[int, ...]]] = {}
    for tp, ranks in pipelines:
        if tuple(ranks) not in by_tp.setdefault(tp, []):
            by_tp[tp].append(tuple(ranks))
    firsts = sorted({s.first_replica for s in plan.stages if s.replicas > 1 and not s.tensor_parallel})
    me, mine = dist.get_rank(), {}
    for first in firsts:
        pp = [plan.stages[i].rank for i in plan.replica_group(first)]
        grid = [sorted({line[r] for line in lines for r in pp}) for _, lines in sorted(by_tp.items())]
        group = new_groups(grid, me, True)
        if comm.pp_rank in pp:
            mine[first] = group
    comm.replica_groups[key] = mine
    return mine


def reduce_replica_gradients(stages: Any, comm: PipelineComm) -> None:
    """Sum the gradients of this rank's replicated stages over their replicas and DP x CP copies (module
    docstring). Collective over the job the first time a plan needs groups (every rank calls it with the same
    plan), then over each stage's group."""
    if not comm.distributed or not any(s.replicas > 1 and not s.tensor_parallel for s in stages.plan.stages):
        return
    groups = _replica_groups(stages.plan, comm)
    for first, params in replicated_parameters(stages).items():
        sum_local_gradients(params, groups[first])
