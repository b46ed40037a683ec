"""Apply a job's parallelism to a model, or to a pipeline rank's stages of it, in one fixed order for every
trainer (:func:`parallelize`):

1. materialise (a pipeline rank only: the model was built on the meta device; its stages' units get their weights,
   :func:`plait.models.init.materialize`, before pruning so tied copies agree);
2. activation checkpointing (:mod:`plait.parallel.activation_checkpointing`), with the whole model's unit specs: it wraps
   forwards and leaves the module tree alone, so TP's hooks and FSDP2's groups see the same names;
3. prune to this rank's stages (a pipeline rank only, :func:`~plait.parallel.stages.build_rank_stages`);
4. tensor parallelism (:func:`~plait.parallel.tensor_parallel.apply_job_tensor_parallel`): DTensor parameters;
   a pipeline's tensor-parallel encoder stages (``parallel.pp.encoder_tp``) over their own TP groups
   (:func:`~plait.parallel.pipeline.encoder_tp.apply_encoder_tensor_parallel`);
   expert parallelism (:func:`~plait.parallel.expert_parallel.apply_expert_parallel`): the MoE experts split over
   the EP group, DTensors FSDP2 then leaves alone;
5. FSDP2 over ``dp x dp_shard`` (:func:`~plait.parallel.fsdp.apply_fsdp`; HSDP when ``dp`` > 1): after
   checkpointing, so the recomputation runs inside the gathered group, and after TP (a 2-D layout);
6. the gradient sum of a step (:mod:`plait.parallel.grad_sync`): FSDP2, TP, DP buckets (the DDP wrapper made
   only to broadcast rank 0's parameters), the pipeline runtime's, or none in one process; under expert
   parallelism that of the other parameters (DP: summed after the step's last backward) inside an ``ExpertSync``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from plait.config.schema import JobConfig
from plait.models.init import materialize, rank_prefixes, weight_source
from plait.models.multimodal import MultimodalModel
from plait.models.units import unit_specs
from plait.parallel.activation_checkpointing import apply_activation_checkpointing, checkpoint_policy
from plait.parallel.data_parallel import OVERLAP_BUCKET_ELEMENTS, GradientReducer, apply_data_parallel
from plait.parallel.dims import ParallelDims
from plait.parallel.expert_parallel import ExpertParallel, apply_expert_parallel, is_expert_parameter
from plait.parallel.fsdp import ShardedModel, apply_fsdp
from plait.parallel.grad_sync import (BucketSync, ExpertSync, GradientSync, LocalSync, PipelineSync, ShardedSync,
                                      SumSync, TensorParallelSync)
from plait.parallel.process_group import DistInfo
from plait.parallel.pipeline import PipelineComm
from plait.parallel.pipeline.encoder_tp import apply_encoder_tensor_parallel
from plait.parallel.stages import RankStages, build_rank_stages
from plait.parallel.tensor_parallel import RankTensorParallel, apply_job_tensor_parallel
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.types import LLM_MODULE

__all__ = ["Parallelized", "PipelinePlace", "parallelize"]


@dataclass(frozen=True)
class PipelinePlace:
    """A pipeline rank's place: the job's pipeline plan and this rank's coordinates (``comm.pp_rank``)."""

    plan: PipelinePlan
    comm: PipelineComm


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` made of a model.

    Attributes:
        tp: this rank's tensor parallelism, or None.
        sharded: the FSDP2 groups, or None.
        stages: this pipeline rank's stages (``model`` pruned to them), or None without pipeline.
        sync: the step's gradient sum.
        ddp_model: the DDP wrapper (plain DP only, for its broadcast; the forwards run ``model``), else ``model``.
        experts: this rank's expert parallelism (``parallel.ep`` > 1), or None.
    """

    tp: RankTensorParallel | None
    sharded: ShardedModel | None
    stages: RankStages | None
    sync: GradientSync
    ddp_model: nn.Module
    experts: ExpertParallel | None = None


def parallelize(model: MultimodalModel, cfg: JobConfig, dims: ParallelDims, mesh: Any, info: DistInfo,
                pipeline: PipelinePlace | None = None) -> Parallelized:
    """Apply ``cfg``'s parallelism to ``model`` in place, in the module docstring's order.

    Args:
        model: the whole composite, freezing applied; on the meta device for a pipeline rank.
        cfg: the job (activation checkpointing, FSDP2 options, seed, weights).
        dims: the job's layout.
        mesh: the job's named DeviceMesh (None: one process, or a pipeline job without FSDP2 or TP).
        info: this process's rank and device.
        pipeline: a pipeline rank's plan and coordinates; None for a model trained whole on every rank.

    Returns:
        The parts made (:class:`Parallelized`). Collective (TP and FSDP2 groups, the DDP broadcast).

    Raises:
        ValueError: as the steps' functions (a degree or plan the model cannot take).
    """
    if pipeline is not None:
        plan = pipeline.plan
        units = {u for s in plan.stages_on_rank(pipeline.comm.pp_rank) for u in plan.stages[s].units}
        materialize(model, info.device, cfg.train.seed, keep=rank_prefixes(model, units),
                    source=weight_source(cfg.model, model))
    specs = unit_specs(model)  # of the whole model, kept for the pruned one (parameter names stay the same)
    apply_activation_checkpointing(model, *checkpoint_policy(cfg), specs=specs)
    stages = None
    if pipeline is not None:
        stages = build_rank_stages(model, pipeline.plan, pipeline.comm.pp_rank, info.device)
        apply_encoder_tensor_parallel(stages, pipeline.comm, info.device.type)  # parallel.pp.encoder_tp
    tp = apply_job_tensor_parallel(model, dims, mesh, info.rank, info.device.type)
    experts = apply_expert_parallel(model, dims, info.rank, info.device)
    sharded = None
    if dims.dp_shard > 1:
        par = cfg.parallel
        shard_mesh = mesh["dp", "dp_shard"] if dims.dp > 1 else mesh["dp_shard"]
        tied = [stages.tied.param] if stages is not None and stages.tied is not None else []  # summed with its peer
        sharded = apply_fsdp(model, specs, shard_mesh, info.device.type, replicate=tied,
                             offload=par.offload == "cpu", reduce_each_microbatch=par.fsdp_reduce == "microbatch",
                             reshard_after_forward=par.fsdp_reshard != "after_backward",
                             ignored=experts.params if experts is not None else ())
    params = [p for _, p in model.trainable_parameters()]
    if experts is not None:
        cp_group = mesh.get_group("cp") if sharded is not None and dims.cp > 1 else None
        return _expert_parallel(model, experts, tp, sharded, stages, pipeline, dims, info, params, cp_group)
    ddp_model: nn.Module = model
    if stages is not None:
        sync: GradientSync = PipelineSync(stages, pipeline.comm, sharded)
    elif sharded is not None:
        sync = ShardedSync(sharded, params, tp, mesh.get_group("cp") if dims.cp > 1 else None, info.world_size,
                           info.device)
    elif tp is not None:
        sync = TensorParallelSync(tp, params, info.device)
    else:
        ddp_model = apply_data_parallel(model, info)
        sync = LocalSync() if info.world_size == 1 else BucketSync(_buckets(model, params))
    return Parallelized(tp, sharded, stages, sync, ddp_model)


def _expert_parallel(model: MultimodalModel, experts: ExpertParallel, tp: RankTensorParallel | None,
                     sharded: ShardedModel | None, stages: RankStages | None, pipeline: PipelinePlace | None,
                     dims: ParallelDims, info: DistInfo, params: list[nn.Parameter], cp_group: Any = None
                     ) -> Parallelized:
    """The parts of an expert-parallel job: the other parameters' sync (the pipeline runtime's, FSDP2's, or a DP sum
    after the last backward over every rank) inside an :class:`ExpertSync`; ``cp_group``: the CP group FSDP2's
    gradients are summed over too (None without CP). No DDP broadcast: every rank materialised the same weights
    from the seed."""
    if stages is not None:
        inner: GradientSync = PipelineSync(stages, pipeline.comm, sharded)  # type: ignore[union-attr]
    elif sharded is not None:
        inner = ShardedSync(sharded, [p for p in params if not is_expert_parameter(p)], tp, cp_group, info.world_size,
                            info.device)
    else:
        inner = SumSync([p for p in params if not is_expert_parameter(p)])
    groups = sharded if sharded is not None else ShardedModel()
    groups.collective = frozenset({LLM_MODULE})
    return Parallelized(tp, sharded, stages, ExpertSync(inner, experts, groups, dims.world_size, info.device), model,
                        experts)


def _buckets(model: MultimodalModel, params: list[nn.Parameter]) -> GradientReducer:
    """The DP (and CP) buckets of a model trained whole: the LLM's parameters start during the last LLM backward of
    the step, the encoders' after the deferred encoder backwards (:class:`BucketSync`)."""
    llm = [p for p in model.language_model.parameters() if p.requires_grad]
    return GradientReducer(params, bucket_elements=OVERLAP_BUCKET_ELEMENTS, early=llm, views=True)
