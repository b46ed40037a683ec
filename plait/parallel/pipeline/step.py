"""One pipeline step on this rank: execute the planned microbatches (:class:`~.executor.Executor`), then reduce
gradients over the DP x CP copies of each stage and over tied embedding copies; gradient clipping over the whole
pipeline; the measured timeline gathered on rank 0.

Loss: the last stage's sum of token cross-entropies (the caller's ``loss_fn``), each microbatch's backward scaled
by ``1 / global target tokens`` (the whole global batch, all DP replicas), and gradients summed over the DP group,
so the result equals one process on the global batch.

Context parallelism (CP): each stage is replicated over a CP group (the innermost rank
axis, :class:`~.comm.PipelineComm`); a pipeline is the stages with one CP index, and its messages carry only that
CP rank's LLM tokens. Encoder stages run on every CP rank (redundantly, as the non-pipeline trainer does); the
input-gradient of the features that reaches an encoder stage covers only its CP rank's tokens, so every stage's
parameter gradients are partial per CP rank and are summed over the DP x CP copies (like DP). Each CP rank's last
stage holds the loss of its tokens; the world sum of the losses is the global one. The CP ranks of a stage run the
same actions in the same order, so the K/V all-gathers (forward) and reduce-scatters (backward, in ``B`` and again
in ``W``) inside the LLM stages match up.

FSDP2 (``parallel.dp_shard``, :mod:`plait.parallel.fsdp`): every shard rank runs its own pipeline on its own share of
the batch; its stages' trainable units are gathered once at the start of the step, each stage's gradients are
reduce-scattered (HSDP: then all-reduced over the replicas) once, right after the stage's last backward action of
the schedule (the executor), summed over CP as local shards; tied copies and other replicated parameters are summed
over the DP x shard x CP copies as without sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.data.collate import Batch
from plait.parallel.energy import FrequencyController
from plait.parallel.expert_parallel import is_expert_parameter
from plait.parallel.fsdp import ShardedModel
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.pipeline.executor import Executor, StepInputs
from plait.parallel.pipeline.replicas import reduce_replica_gradients, replica_copies
from plait.parallel.stages import RankStages
from plait.parallel.tensor_parallel import (align_gradients, check_max_norm, clip_by_square_sum_, grad_square_sum,
                                             sum_local_gradients)
from plait.planner.microbatch.routing import FeatureRouting
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.types import TimelineEvent

__all__ = ["PipelineStepResult", "clip_grad_norm_pipeline", "gather_timeline", "run_pipeline_forward",
           "run_pipeline_step"]


@dataclass(frozen=True)
class PipelineStepResult:
    """One pipeline step (forward/backward of all microbatches, gradients reduced).

    Attributes:
        loss: global loss (sum of token cross-entropies / global target tokens), the same on every rank.
        loss_sum: the global sum of token cross-entropies.
        events: this rank's timed actions (``rank`` = pipeline rank; seconds since the epoch), compute only:
            waiting for a message is not inside an event.
        saved_tensors: per stage of this rank, tensors saved for backward by its forwards (with
            ``instrument=True``, else empty).
        backward_actions: per stage of this rank, ``B``/``W`` actions that ran a backward pass.
        buffered_peak_bytes: with a :class:`FeatureRouting`, the most bytes of encoder features this rank's first
            LLM stage held across a microbatch boundary for later LLM microbatches (deferred samples' encoder
            microbatches); 0 on other ranks and without routing.
    """

    loss: float
    loss_sum: float
    events: tuple[TimelineEvent, ...]
    saved_tensors: Mapping[int, int]
    backward_actions: Mapping[int, int]
    buffered_peak_bytes: int = 0


def run_pipeline_step(
    stages: RankStages,
    schedule: Schedule,
    microbatches: Sequence[Batch | None],
    global_targets: int,
    comm: PipelineComm | None = None,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    llm_kwargs: Sequence[Mapping[str, Any]] | None = None,
    instrument: bool = False,
    routing: FeatureRouting | None = None,
    encoder_batches: Sequence[Batch | None] | None = None,
    frequency: FrequencyController | None = None,
    sharded: ShardedModel | None = None,
    sync: Any = None,
) -> PipelineStepResult:
    """Forward and backward of this pipeline's ``M`` microbatches of a global batch, then gradient reduction.

    Gradients accumulate into ``.grad`` of this rank's parameters: summed over the DP x CP copies of its
    stages, and over the two copies of tied embeddings split across ranks; the caller then steps its optimizer
    (if the rank trains) and zeroes them. Collective: every rank of the job calls it with the same schedule.
    Everything the step runs is planned before it (the runtime only executes it): microbatches, per-microbatch
    LLM keyword arguments, feature routing.

    Context parallelism (``comm.cp_size`` > 1): every CP rank of a pipeline runs the same schedule on the same
    microbatches; ``llm_kwargs`` must give each microbatch this rank's ``plait_cp`` shard (a
    :class:`~plait.parallel.context.CPShard` over ``comm.cp_group``, the same token assignment on every rank)
    with its ``plait_mask``. Encoder stages run whole; the LLM stages keep only the shard's tokens (see
    :class:`~plait.parallel.stages.PipelineStage`), so LLM messages carry ``[B, n_local, H]``.

    Args:
        stages: this rank's stages (``build_rank_stages``); their plan must be ``schedule.plan``.
        schedule: the pipeline schedule (e.g. ``one_f_one_b(plan, M)``).
        microbatches: this pipeline's ``M`` microbatches (the DP replica's share of the global batch), the
            same list on every rank of the pipeline; tensors on ``comm.device``.
        global_targets: target tokens of the whole global batch (all microbatches of all DP replicas).
        comm: PP/DP coordinates (default: single process, every stage on pipeline rank 0).
        loss_fn: ``(logits [B, N, V], labels [B, N]) -> scalar`` sum of token losses (e.g.
            ``plait.train.loss.token_loss_sum``).
        autocast: context factory wrapped around every action (e.g. bf16 autocast).
        llm_kwargs: per microbatch, extra keyword arguments for the LLM stages (attention metadata:
            ``plait_mask``, and ``plait_cp`` with context parallelism); None: none.
        instrument: count tensors saved for backward per stage (``saved_tensors_hooks``).
        routing: deferred encoder outputs (:class:`FeatureRouting`): encoder stages then run microbatch ``i`` on
            ``encoder_batches[i]`` and ``microbatches`` is the LLM view (``None`` for an LLM microbatch
            without samples). The schedule and its messages are unchanged (:mod:`.executor`).
            ``None``: both views are ``microbatches``.
        encoder_batches: with ``routing``, per microbatch the batch of the encoder view (None: no sample).
        frequency: this rank's frequency controller (``[energy] plan``, :mod:`plait.parallel.energy`), called
            before each action; the frequency goes into each event's ``frequency_mhz``. None: no energy plan.
        sharded: this rank's FSDP2 groups (``parallel.dp_shard`` > 1; :func:`plait.parallel.fsdp.apply_fsdp` over
            the ``dp`` x ``dp_shard`` ranks of each stage): gathered once at the start of the step, each stage's
            gradients reduce-scattered once after its last backward action (:mod:`plait.parallel.fsdp`), then
            summed over the CP ranks; the replicated (tied) parameters summed over the DP x CP copies.
        sync: the step's gradient sync (a :class:`plait.parallel.grad_sync.GradientSync`), or None: after the
            reductions above its ``finish`` (e.g. the sums across heterogeneous pipelines), then its
            ``reduce_loss`` on the loss sum instead of the all-reduce over the job of a distributed ``comm``.

    Returns:
        :class:`PipelineStepResult` (loss the same on every rank).

    Raises:
        ValueError: on a wrong microbatch count (in ``microbatches``, ``llm_kwargs``, ``routing`` or
            ``encoder_batches``), a ``None`` microbatch without ``routing``, features that do not match
            ``routing.features``, a schedule for another plan, a negative target count, or (at an LLM stage's
            first forward) ``llm_kwargs`` without this CP rank's ``plait_cp`` shard when ``comm.cp_size`` > 1
            (or with a shard when it is 1).
    """
    comm = comm or PipelineComm()
    _check_step_inputs(stages, schedule, microbatches, global_targets, comm)
    _check_routing(routing, encoder_batches, microbatches)
    _check_replicas(stages, routing, sharded)
    kwargs = list(llm_kwargs) if llm_kwargs is not None else [{} for _ in microbatches]
    if len(kwargs) != len(microbatches):
        raise ValueError(f"llm_kwargs has {len(kwargs)} entries for {len(microbatches)} microbatches")
    inputs = StepInputs(microbatches, kwargs, 1.0 / max(1, global_targets), loss_fn, autocast, instrument, routing,
                        tuple(encoder_batches or ()), frequency, sharded)
    executor = Executor(stages, schedule, comm, inputs)
    if sharded is not None:
        sharded.begin_step()
    executor.run()
    if sharded is None:  # expert weights split by EP: summed by their own group (grad_sync.ExpertSync)
        replicated = replica_copies(stages)  # summed over their replicas too (parallel.pipeline.replicas)
        _reduce_dp([p for _, p in stages.trainable_parameters()
                    if not is_expert_parameter(p) and id(p) not in replicated], comm)
        reduce_replica_gradients(stages, comm)
    else:  # FSDP2 reduced its groups over dp x dp_shard; CP ranks hold partial sums of the same shards
        _reduce_dp(sharded.replicated, comm)
        if comm.cp_size > 1:
            sum_local_gradients([p for p in sharded.parameters() if not is_expert_parameter(p)], comm.cp_group)
    if comm.distributed:
        _sum_tied(stages, comm)
    loss_sum = torch.zeros((), dtype=torch.float64, device=comm.device)
    for loss in executor.losses if comm.tp_rank == 0 else ():  # TP ranks hold the same losses: count one
        loss_sum += loss.double().to(comm.device)
    if sync is not None:
        sync.finish()
        sync.reduce_loss(loss_sum)
    elif comm.distributed:
        dist.all_reduce(loss_sum)  # last-stage ranks hold losses (per CP rank: its tokens'): the world sum
    total = float(loss_sum)
    return PipelineStepResult(total / max(1, global_targets), total, tuple(executor.events),
                              executor.saved if instrument else {}, executor.backwards,
                              executor.buffer.peak if executor.buffer is not None else 0)


def run_pipeline_forward(
    stages: RankStages,
    schedule: Schedule,
    microbatches: Sequence[Batch],
    comm: PipelineComm | None = None,
    *,
    output_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    llm_kwargs: Sequence[Mapping[str, Any]] | None = None,
) -> list[torch.Tensor]:
    """Forward passes only of this pipeline's ``M`` microbatches (evaluation: validation loss, greedy decoding),
    through the same executor and transport as training, with no autograd and nothing kept for backward.

    Collective over this pipeline (its P2P messages; with CP the K/V gathers of its CP group): every rank of the
    pipeline calls it with the same schedule and microbatches; no DP collective, so DP replicas may run
    different microbatches.

    Args:
        stages, comm: as :func:`run_pipeline_step`.
        schedule: a forward-only schedule (``plait.planner.pipeline.schedules.forward_only``) of ``stages.plan``.
        microbatches: the ``M`` batches, on ``comm.device``.
        output_fn: ``(logits [B, N, V], labels [B, N]) -> tensor`` run by the last stage on each microbatch
            (with CP on this rank's tokens only), e.g. ``plait.train.loss.token_loss_sum``.
        autocast: context factory wrapped around every forward.
        llm_kwargs: per microbatch, extra keyword arguments of the LLM stages (``plait_mask``, ``plait_cp``).

    Returns:
        on a rank holding the last stage, ``output_fn``'s result per microbatch, in microbatch order; ``[]``
        elsewhere.

    Raises:
        ValueError: when the schedule has backward actions, or as :func:`run_pipeline_step`'s input checks.
    """
    comm = comm or PipelineComm()
    if any(a.kind != "F" for _, a in schedule.all_actions()):
        raise ValueError(f"run_pipeline_forward needs a forward-only schedule, got {schedule.name or 'one'} with "
                         "backward actions")
    _check_step_inputs(stages, schedule, microbatches, 0, comm)
    _check_routing(None, None, microbatches)
    kwargs = list(llm_kwargs) if llm_kwargs is not None else [{} for _ in microbatches]
    if len(kwargs) != len(microbatches):
        raise ValueError(f"llm_kwargs has {len(kwargs)} entries for {len(microbatches)} microbatches")
    executor = Executor(stages, schedule, comm, StepInputs(microbatches, kwargs, 0.0, output_fn, autocast))
    with torch.no_grad():
        executor.run()
    return list(executor.losses)


def _check_routing(routing: FeatureRouting | None, encoder_batches: Sequence[Batch | None] | None,
                   microbatches: Sequence[Batch | None]) -> None:
    if routing is None:
        missing = [j for j, b in enumerate(microbatches) if b is None]
        if missing:
            raise ValueError(f"microbatches {missing} are None: only a FeatureRouting allows empty LLM microbatches")
        if encoder_batches is not None:
            raise ValueError("encoder_batches are the encoder view of a FeatureRouting: give routing too")
    elif routing.num_microbatches != len(microbatches):
        raise ValueError(f"the routing has {routing.num_microbatches} microbatches, {len(microbatches)} were given")
    elif encoder_batches is None or len(encoder_batches) != len(microbatches):
        got = "none" if encoder_batches is None else len(encoder_batches)
        raise ValueError(f"a FeatureRouting needs one encoder batch per microbatch ({len(microbatches)}), got {got}")


def _check_replicas(stages: RankStages, routing: FeatureRouting | None, sharded: ShardedModel | None) -> None:
    """Replicated encoder stages run without deferred features and without FSDP2."""
    if stages.plan.replicated and (routing is not None or sharded is not None):
        what = "deferred encoder outputs" if routing is not None else "FSDP2 (parallel.dp_shard > 1)"
        raise ValueError(f"replicated encoder stages (parallel.pp.encoder_dp) do not run with {what}")


def _check_step_inputs(stages: RankStages, schedule: Schedule, microbatches: Sequence[Batch | None],
                       global_targets: int, comm: PipelineComm) -> None:
    if schedule.plan != stages.plan:
        raise ValueError("the schedule was made for another pipeline plan than the stages")
    if len(microbatches) != schedule.num_microbatches:
        raise ValueError(
            f"the schedule runs {schedule.num_microbatches} microbatches but {len(microbatches)} were given"
        )
    if global_targets < 0:
        raise ValueError(f"global_targets must be >= 0, got {global_targets}")
    if comm.pp_rank != stages.pp_rank or len(comm.pp_ranks) != schedule.num_ranks:
        raise ValueError(
            f"comm has pipeline rank {comm.pp_rank} of {len(comm.pp_ranks)} but the stages are for rank "
            f"{stages.pp_rank} of a {schedule.num_ranks}-rank schedule"
        )


def _reduce_dp(params: Sequence[torch.nn.Parameter], comm: PipelineComm) -> None:
    """Sum gradients over every copy of this rank's stages: the DP replicas and, with context parallelism, the
    CP ranks (each CP rank's gradients come from its own tokens only: the LLM's queries, the K/V it holds, and
    the features the encoders produced for its tokens; their sum is the whole microbatch's gradient). A
    parameter without a gradient on every copy keeps ``None`` (as in one process: the optimizer skips it); one
    used on some copy gets zeros where it was unused."""
    if comm.stage_replicas == 1 or not params:
        return
    sum_local_gradients(params, comm.reduce_group)  # DTensor gradients (TP): their local shards


def _sum_tied(stages: RankStages, comm: PipelineComm) -> None:
    """Sum the gradients of tied input/output embedding copies held by two pipeline ranks."""
    tied = stages.tied
    if tied is None:
        return
    param = tied.param
    mine = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
    other = torch.empty_like(mine)
    peer = comm.pp_ranks[tied.peer]
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    param.grad = mine + other if tied.mirror else other + mine  # same operand order on both ranks


def clip_grad_norm_pipeline(stages: RankStages, max_norm: float, comm: PipelineComm | None = None) -> float:
    """Clip the gradients of the whole pipeline to a global L2 norm of ``max_norm``; returns the norm before
    clipping (the same on every rank). Call after :func:`run_pipeline_step` (gradients already summed over the
    DP x CP copies of each stage (and a replicated encoder stage's replicas), so every copy holds the same ones and
    the world sum of squares is divided by their number; a tied embedding copy counts once; a TP-split gradient counts its local shard,
    :func:`~plait.parallel.tensor_parallel.grad_square_sum`). Collective.

    Raises:
        ValueError: on a negative ``max_norm``.
    """
    check_max_norm(max_norm)
    comm = comm or PipelineComm()
    mirror = stages.tied.param if stages.tied is not None and stages.tied.mirror else None
    align_gradients([p for _, p in stages.trainable_parameters()])  # TP: DTensor grads in their params' layout
    grads = [p.grad for _, p in stages.trainable_parameters() if p.grad is not None]
    # a replicated encoder stage's parameters have a copy on each of its replica ranks too
    replicated = {id(p): st.stage.replicas for st in stages.stages.values() for p in st.params}
    copies = comm.stage_replicas * comm.tp_size if comm.distributed else 1
    sumsq = torch.zeros((), dtype=torch.float64)
    for r in sorted({replicated.get(id(p), 1) for _, p in stages.trainable_parameters()}):
        counted = [p.grad for _, p in stages.trainable_parameters()
                   if p.grad is not None and p is not mirror and replicated.get(id(p), 1) == r]
        sumsq = sumsq + grad_square_sum(counted, copies * (r if comm.distributed else 1))
    sumsq = sumsq.to(comm.device)
    return clip_by_square_sum_(grads, sumsq, max_norm, reduce=comm.distributed)


def gather_timeline(events: Sequence[TimelineEvent], comm: PipelineComm | None = None) -> list[TimelineEvent]:
    """The events of every pipeline rank of DP replica 0 and CP rank 0 on global rank 0 (other ranks get
    ``[]``), for ``plait.train.plots.write_chrome_trace``/``plot_timeline``. Collective."""
    comm = comm or PipelineComm()
    if not comm.distributed:
        return list(events)
    mine = [e.to_dict() for e in events] if comm.dp_rank == 0 and comm.cp_rank == 0 else []
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return []
    return [TimelineEvent.from_dict(e) for part in gathered for e in part]
