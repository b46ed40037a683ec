"""How a step's gradients become the global batch's: one strategy object per kind of data parallelism, chosen once
when the model is parallelized, called by the step runners at fixed points instead of branching on the layout.

A step runner calls, in order: :meth:`GradientSync.start` before the first backward, :meth:`~GradientSync.arm`
just before the backward that last reaches the LLM's parameters, :meth:`~GradientSync.finish` after the last
backward (the gradients are then the sum over every rank holding the same parameters), :meth:`~GradientSync.
reduce_loss` on the rank's loss sum, and the loop's optimizer step :meth:`~GradientSync.clip`.

- :class:`LocalSync`: one process, nothing to sum;
- :class:`BucketSync`: DP (and CP) buckets of a :class:`~plait.parallel.data_parallel.GradientReducer`, started
  during the last LLM backward (Li et al., "PyTorch Distributed", VLDB 2020);
- :class:`SumSync`: every gradient summed after the last backward (no overlap);
- :class:`TensorParallelSync`: TP without FSDP2: DTensor gradients' local shards summed over the TP rank's DP/CP
  peers;
- :class:`ShardedSync`: FSDP2 (HSDP), which reduce-scatters inside the backward; tied copies and CP summed after;
  the step must run the same collectives on every rank (``uniform``);
- :class:`PipelineSync`: a pipeline rank's stages, summed over DP x CP by the pipeline runtime (which calls
  ``finish`` and ``reduce_loss`` of the sync it is given);
- :class:`HeteroSync`: heterogeneous pipelines (``plait launch``), summed per parameter over its holders;
- :class:`ExpertSync`: expert parallelism around one of the above: the split experts' gradients summed over the
  ranks holding the same experts, every LLM microbatch run on every rank (the all-to-alls are collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from plait.parallel.data_parallel import GradientReducer
from plait.parallel.expert_parallel import ExpertParallel
from plait.parallel.fsdp import ShardedModel
from plait.parallel.hetero_dp import HeteroDP, clip_grad_norm_hetero
from plait.parallel.pipeline import PipelineComm, clip_grad_norm_pipeline
from plait.parallel.stages import RankStages
from plait.parallel.tensor_parallel import RankTensorParallel, clip_grad_norm_, sum_local_gradients

__all__ = ["BucketSync", "ExpertSync", "GradientSync", "HeteroSync", "LocalSync", "PipelineSync", "ShardedSync", "SumSync",
           "TensorParallelSync"]


def _no_clip(max_norm: float) -> float:
    """``train.grad_clip`` <= 0 means no clipping (the norm is still measured)."""
    return max_norm if max_norm > 0 else float("inf")


class GradientSync:
    """The gradient sum of a step (module docstring). The base class is one process: every hook does nothing.

    Attributes:
        uniform: whether every rank must run the same sequence of forwards and backwards whatever its share
            (FSDP2: :func:`plait.train.step_run.run_uniform_microbatches`).
        sharded: the FSDP2 groups, or None.
    """

    uniform = False
    sharded: ShardedModel | None = None

    def start(self) -> None:
        """Before the step's first backward."""

    def arm(self) -> None:
        """Just before the backward that last reaches the LLM's parameters (buckets may start during it)."""

    def finish(self) -> None:
        """After the step's last backward: the gradients are summed over their holders."""

    def reduce_loss(self, loss_sum: torch.Tensor) -> None:
        """Sum this rank's loss sum (float64 scalar) over the ranks that hold distinct tokens, in place."""

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm`` (<= 0: no clipping) in place; returns the norm before
        clipping (the same on every rank; collective when distributed)."""
        return float(torch.nn.utils.clip_grad_norm_(params, _no_clip(max_norm)))


class LocalSync(GradientSync):
    """One process: no sum (base class behaviour)."""


class _AllRanks(GradientSync):
    """A distributed job: the loss is summed over every rank of ``loss_group`` (None: all ranks)."""

    loss_group: Any = None

    def reduce_loss(self, loss_sum: torch.Tensor) -> None:
        dist.all_reduce(loss_sum, group=self.loss_group)


class BucketSync(_AllRanks):
    """DP (and CP) gradient buckets (:class:`~plait.parallel.data_parallel.GradientReducer`): the LLM's start during
    the last LLM backward, the encoders' in :meth:`finish`, after the deferred encoder backwards.

    Args:
        reducer: the buckets, made gradient views by :meth:`start`.
    """

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer

    def start(self) -> None:
        self.reducer.prepare()

    def arm(self) -> None:
        self.reducer.arm()

    def finish(self) -> None:
        self.reducer.finish()


class SumSync(_AllRanks):
    """Every gradient summed over ``group`` after the last backward (no overlap; DTensor gradients by their local
    shards, :func:`~plait.parallel.tensor_parallel.sum_local_gradients`), the loss over the same group.

    Args:
        params: the trainable parameters, the same on every rank of ``group``.
        group: the process group (None: all ranks).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any = None) -> None:
        self.params, self.loss_group = list(params), group

    def finish(self) -> None:
        sum_local_gradients(self.params, self.loss_group)


class TensorParallelSync(SumSync):
    """TP without FSDP2: each DTensor gradient's local shard summed over the TP rank's DP/CP peers
    (``tp.grad_group``), the loss over the same group (TP peers share their tokens), the norm over every rank.

    Args:
        tp: this rank's tensor parallelism.
        params: the trainable parameters, the same on every rank of ``tp.grad_group``.
        device: the backend's device (where the norm is all-reduced).
    """

    def __init__(self, tp: RankTensorParallel, params: Sequence[nn.Parameter], device: torch.device) -> None:
        super().__init__(params, tp.grad_group)
        self.tp, self.device = tp, device

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        return self.tp.clip_grad_norm_(params, max_norm, self.device)


class ShardedSync(_AllRanks):
    """FSDP2 (HSDP over ``dp`` x ``dp_shard``): reduce-scattered inside the backward; then the tied copies left
    replicated summed over the TP group (all ranks without TP) and, with CP, the sharded gradients over the CP
    group. The norm is summed over every rank (``world_size`` holders of a piece of each parameter).

    Args:
        sharded: the FSDP2 groups.
        params: the trainable parameters.
        tp: this rank's tensor parallelism, or None.
        cp_group: the CP group when ``parallel.cp`` > 1, else None.
        world_size: ranks of the job.
        device: the backend's device.
    """

    uniform = True

    def __init__(self, sharded: ShardedModel, params: Sequence[nn.Parameter], tp: RankTensorParallel | None,
                 cp_group: Any, world_size: int, device: torch.device) -> None:
        self.sharded, self.params, self.tp, self.cp_group = sharded, list(params), tp, cp_group
        self.world_size, self.device = world_size, device
        self.loss_group = tp.grad_group if tp is not None else None

    def finish(self) -> None:
        sum_local_gradients(self.sharded.replicated, self.loss_group)  # tied
        if self.cp_group is not None:
            sum_local_gradients([p for p in self.params if isinstance(p, DTensor)], self.cp_group)

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_(params, _no_clip(max_norm), self.world_size, None, self.device)


class PipelineSync(GradientSync):
    """A pipeline rank's stages: the pipeline runtime sums each stage's gradients over its DP x CP copies (FSDP2
    inside the backward) and the loss over the job; the norm is the whole pipeline's
    (:func:`~plait.parallel.pipeline.clip_grad_norm_pipeline`).

    Args:
        stages: this rank's stages.
        comm: this rank's pipeline coordinates.
        sharded: the FSDP2 groups of its stages, or None.
    """

    def __init__(self, stages: RankStages, comm: PipelineComm, sharded: ShardedModel | None = None) -> None:
        self.stages, self.comm, self.sharded = stages, comm, sharded

    def reduce_loss(self, loss_sum: torch.Tensor) -> None:
        if self.comm.distributed:  # the last-stage ranks hold the losses (per CP rank: its tokens'): the world sum
            dist.all_reduce(loss_sum)

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_pipeline(self.stages, _no_clip(max_norm), self.comm)


class HeteroSync(GradientSync):
    """Heterogeneous pipelines (``plait launch``): after the pipeline's step every held parameter's gradient is
    summed over its holders, one per pipeline (:class:`~plait.parallel.hetero_dp.HeteroDP`), the loss over every
    rank (a one-rank pipeline's too); the norm counts each parameter once
    (:func:`~plait.parallel.hetero_dp.clip_grad_norm_hetero`). Given to
    :func:`~plait.parallel.pipeline.run_pipeline_step` as its ``sync``.

    Args:
        hetero: this rank's per-parameter gradient groups.
    """

    def __init__(self, hetero: HeteroDP) -> None:
        self.hetero = hetero

    def reduce_loss(self, loss_sum: torch.Tensor) -> None:
        dist.all_reduce(loss_sum)

    def finish(self) -> None:
        self.hetero.reduce()

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm_hetero(self.hetero, _no_clip(max_norm))


class ExpertSync(GradientSync):
    """Expert parallelism (:mod:`plait.parallel.expert_parallel`) around the sync of the other parameters
    (``inner``: :class:`SumSync`, :class:`ShardedSync` or :class:`PipelineSync`, none of which reduces an expert
    weight): after ``inner``'s finish the experts' gradients are summed over their expert-data-parallel group; the
    norm counts each expert shard once (``grad_square_sum``). Without pipeline stages the step is ``uniform``: every
    LLM microbatch runs on every rank (``sharded`` marks the LLM collective).

    Args:
        inner: the sync of the non-expert parameters.
        experts: this rank's expert parallelism.
        sharded: ``inner``'s FSDP2 groups, or a group-less :class:`ShardedModel`, with the LLM ``collective``.
        world_size: ranks of the job.
        device: the backend's device.
    """

    def __init__(self, inner: GradientSync, experts: ExpertParallel, sharded: ShardedModel, world_size: int,
                 device: torch.device) -> None:
        self.inner, self.experts, self.sharded = inner, experts, sharded
        self.world_size, self.device = world_size, device
        self.uniform = not isinstance(inner, PipelineSync)

    def start(self) -> None:
        self.inner.start()

    def arm(self) -> None:
        self.inner.arm()

    def finish(self) -> None:
        self.inner.finish()
        self.experts.reduce_gradients()

    def reduce_loss(self, loss_sum: torch.Tensor) -> None:
        self.inner.reduce_loss(loss_sum)

    def clip(self, params: Sequence[nn.Parameter], max_norm: float) -> float:
        if isinstance(self.inner, PipelineSync):  # the pipeline's norm counts each stage's DTensor shards once
            return self.inner.clip(params, max_norm)
        return clip_grad_norm_(params, _no_clip(max_norm), self.world_size, None, self.device)
