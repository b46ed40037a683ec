"""Tensor-parallel encoder stages (``Stage.tensor_parallel``: an encoder branch with its own TP degree inside a
pipeline, ``[parallel.pp] encoder_tp``): the copies of each such stage form one TP group of their pipeline, a 1-D
DeviceMesh over their global ranks, and the branch's modules this rank holds are split over it with the family's
encoder TP plan (:func:`plait.parallel.tensor_parallel.apply_tensor_parallel` with ``branch``; Megatron-LM's
column/row split, Shoeybi et al. 2019, section 3).

Between the split modules activations are replicated, so every copy computes the whole stage output; the leader's
features reach the first LLM stage and the leader's feature gradient reaches every copy
(:mod:`plait.parallel.encoder_rows`). A split parameter's gradient is a shard (a DTensor), a replicated one's the
same on every copy: they are summed over the pipelines' DP x CP copies like any stage's, never over the TP group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plait.parallel.dims import new_groups
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.stages import RankStages
from plait.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["apply_encoder_tensor_parallel"]


def apply_encoder_tensor_parallel(stages: RankStages, comm: PipelineComm, device_type: str = "cpu") -> dict[str, str]:
    """Split this rank's tensor-parallel encoder stages over their TP groups (module docstring). Call after
    :func:`~plait.parallel.stages.build_rank_stages` on weights identical on every copy (the same seed or
    checkpoint), before the optimizer is built. Collective over the job when the plan has such stages: every rank
    creates every group (one per TP stage and pipeline), in the same order. Returns the applied plan (concrete
    module name -> style name; empty on ranks without a TP stage).

    Raises:
        ValueError: with the job's own TP degree above 1 (``parallel.tp``), when a rank holds copies of TP stages
            of one branch whose groups differ, or as :func:`~plait.parallel.tensor_parallel.apply_tensor_parallel` (a family
            without an encoder TP plan, a degree that does not divide the heads, naming
            ``parallel.pp.encoder_tp.<branch>``).
    """
    plan = stages.plan
    firsts = sorted({s.first_replica for s in plan.stages if s.tensor_parallel})
    if not firsts:
        return {}
    if comm.tp_size > 1:
        raise ValueError(f"parallel.pp.encoder_tp does not combine with parallel.tp = {comm.tp_size}")
    lines = [tuple(comm.pp_ranks)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, tuple(comm.pp_ranks))
        lines = list(dict.fromkeys(tuple(r) for r in gathered))  # one entry per pipeline, in rank order
    me = dist.get_rank() if dist.is_initialized() else 0
    groups = list(dict.fromkeys(  # (branch, its copies' pipeline ranks), in stage order
        (plan.stages[f].modules[0], tuple(sorted(plan.stages[i].rank for i in plan.replica_group(f)))) for f in firsts))
    applied: dict[str, str] = {}
    held: dict[str, tuple[int, ...]] = {}
    for branch, copies in groups:
        group = new_groups([[line[r] for r in copies] for line in lines], me, True)
        if comm.pp_rank not in copies:
            continue
        if branch in held:
            raise ValueError(f"pipeline rank {comm.pp_rank} holds copies of tensor-parallel stages of encoder "
                             f"{branch!r} on pipeline ranks {held[branch]} and {copies} (parallel.pp.encoder_tp): "
                             "the stages of a branch a rank holds need the same TP group")
        held[branch] = copies
        applied.update(apply_tensor_parallel(stages.model, DeviceMesh.from_group(group, device_type), branch))
    return applied
