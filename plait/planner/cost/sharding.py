"""Sharded data parallelism (FSDP2), tensor parallelism (TP) and activation checkpointing (AC) as cost transforms.

The layout search (``search.plan_layout``) plans pipeline stages over "devices" whose unit costs it is given. This
module turns one rank's unit costs into the costs of the same units under a choice of ``ParallelDegrees``
(``tp``, ``dp_shard``, ``checkpointing``), so the unchanged search plans with them; ``search_parallel`` chooses
the degrees. The formulas, per pipeline unit ``u`` with ``P_u`` parameter bytes, ``f``, ``dX``, ``dW`` seconds and
``O_u`` output bytes (``T x H x b`` for a layer: the hidden states of the microbatch):

- **TP** (Megatron-style: Shoeybi et al., "Megatron-LM", arXiv 1909.08053, section 3; the plans transformers ships
  with each model family: attention heads and MLP column/row-parallel): only ``layer`` units are split (attention
  and MLP hold almost all of a layer's parameters and FLOPs; embeddings, norms, projectors and the head stay whole
  on every TP rank). A layer's ``f``, ``dX``, ``dW`` and ``P_u`` are divided by ``tp``; its forward pays two
  all-reduces of ``O_u`` bytes over the ``tp`` ranks (after the attention output projection and after the MLP
  down projection, the ``g`` operator) and its input gradient two more (the ``f`` operator), on the critical path
  (``tp_link``, ring all-reduce ``search_model.allreduce_s``). Saved activations: the per-token terms of the full
  hidden size stay whole (each norm's input and the normed inputs of attention and MLP, 4 ``O_u`` for the usual two
  norms: ``cost_model._decoder_layer_saved``), the rest (q, k, v, attention output, MLP intermediates, the
  log-sum-exp per head) is divided by ``tp``. A MoE layer's routed experts (``UnitCost.expert_param_bytes``) are in
  no family's TP plan (transformers keeps them for its expert-parallel plan; plait's TP splits ``nn.Linear``
  modules, not the fused 3-D expert weights): they stay whole on every TP rank, only the rest of ``P_u`` is divided,
  and so does each pass's time but for its routed experts' part (``experts.ExpertLayer.routed_s`` at ``ep = 1``,
  when ``shard_costs`` is given the MoE layers).
- **AC** (``recompute.plan_checkpointing``, ``recompute.checkpointed_costs``, applied after TP so a recomputed
  forward repeats its TP all-reduces): a checkpointed layer keeps only its input and its backward first runs its
  forward again.
- **FSDP2** (``dp_shard``; Zhao et al., "PyTorch FSDP", VLDB 2023, and FSDP2's ``fully_shard`` per unit, as
  ``parallel.fsdp`` wraps them): every trainable unit's parameters, gradients and optimizer state are divided by
  ``dp_shard`` (a LoRA unit's frozen base too: the unit is one group), i.e. ``param_bytes / dp_shard`` in the costs
  the search reads, which also makes the optimizer step (``overheads.ActionOverheads.update_s``) the shard's. Frozen
  units stay whole on every rank, outside FSDP2 (no gradient or optimizer state to shard, no all-gathers). Each unit's
  parameters are all-gathered before its forward and again before its backward (resharded after the forward):
  ``(s - 1) / s x P_u`` bytes on ``shard_link`` per microbatch each time, overlapped with compute by FSDP2's
  prefetch, so only the excess ``max(0, gather - compute)`` is charged. Gradients are reduce-scattered once per
  step at the flush (``search_model.grad_sync_s``). While a unit runs, FSDP2 holds its unsharded parameters,
  those of the next unit (prefetch) and, in the backward, its unsharded gradient before the reduce-scatter:
  ``shard_buffer_bytes``, kept free below the memory cap. With several microbatches per rank the runtime either
  accumulates every trainable unit's gradient unsharded until the last microbatch's backward reduce-scatters it
  (``parallel.fsdp_reduce = "step"``: the buffer then holds all of them, ``accumulated_grad_bytes``, not one
  unit's) or reduce-scatters after every microbatch (``"microbatch"``, like CPU offload: one unit's unsharded
  gradient, the shards accumulate; the reduction, ``search_model.grad_sync_s``, paid once per microbatch).
  ``search_parallel`` keeps the faster fitting of the two. With ``parallel.fsdp_reshard = "after_backward"``
  (``ParallelDegrees.fsdp_reshard``; FSDP2's ``reshard_after_forward=False``, torchtitan's default without PP) a
  unit's parameters stay gathered from its forward to its backward: no all-gather before the backward (its excess
  over compute is not charged), but the whole parameters of every trainable unit are held at the end of the
  forward (``kept_param_bytes``), which ``shard_buffer_bytes`` charges; ``search_parallel`` chooses it when the
  memory cap allows and it is faster. Tied parameters (an LLM's embedding and head): the
  cost model holds the tied matrix in the embedding unit only (``cost_model.UnitEstimate.tied_params``) and FSDP2
  shards it once (``parallel.fsdp`` puts the embedding and head in one group), so dividing the embedding unit's
  bytes is exactly what a rank keeps. Not charged: that group stays unsharded from the embedding's forward to the
  head's, and again through the backward (units carry no tie flag to charge it by).
- **FSDP2 under pipeline stages** (``pp`` > 1; ``parallel.fsdp``, "Under pipeline parallelism", the pattern of
  ``torch.distributed.pipelining`` and torchtitan): a rank all-gathers its stage's trainable units once at the
  start of the step and keeps them whole through it, the microbatches' gradients accumulate whole, and each stage's
  gradients are reduce-scattered once after its last backward. So within a step a rank holds the stage's
  parameters and gradients whole and only the optimizer state (with the fp32 master copy) is divided:
  ``pipelined_shard_costs`` keeps ``param_bytes`` whole (TP and AC applied, no per-microbatch all-gather) and
  ``pipelined_optimizer`` divides ``state_bytes_per_param`` by ``dp_shard``. The step's communication, an all-gather
  of the parameters plus a reduce-scatter of the gradients over ``dp_shard`` (then the all-reduce of the shards over
  the ``r`` replicas), moves ``2 (s - 1) / s + 2 (r - 1) / (r s) = 2 (rs - 1) / (rs)`` times the gradient bytes:
  exactly the ring all-reduce over the ``rs`` data-parallel ranks the search charges with ``dp_shard = 1`` (its
  ``2 (rs - 1)`` latencies bound the ``2 (s - 1) + 2 (r - 1)`` of the sharded collectives); the optimizer step
  updates one shard (``pipelined_overheads``).
- **EP** (``ParallelDegrees.ep``, ``cost.experts``): applied after TP (EP is searched with ``tp = 1``) and before AC,
  so a recomputed forward repeats its all-to-alls (``experts.expert_parallel_costs``, given an
  ``experts.ExpertDispatch``). A unit's routed experts (``UnitCost.expert_param_bytes`` of its ``P_u``) are divided
  over the ``ep`` ranks, whether it trains or not; under FSDP2 a trainable unit's experts are sharded further over
  ``e = max(1, dp_shard / ep)`` ranks (the ranks holding the same experts) and all-gathered over them, its other
  parameters over ``dp_shard`` as before: a rank holds ``(P_u - X_u) / dp_shard + X_u / max(ep, dp_shard)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.cost.analytic import trained_params, unit_activation_bytes, unit_static_bytes
from plait.planner.cost.experts import ExpertDispatch, expert_parallel_costs
from plait.planner.cost.types import ActionOverheads, GradAccumulation, OptimizerSpec, ParallelDegrees, RankMemory
from plait.planner.cost.recompute import checkpointed_costs, plan_checkpointing
from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.types import Unit, UnitCost

__all__ = [
    "TP_KINDS",
    "accumulated_grad_bytes",
    "gather_s",
    "kept_param_bytes",
    "pipelined_optimizer",
    "pipelined_overheads",
    "pipelined_shard_costs",
    "rank_memory",
    "shard_buffer_bytes",
    "shard_costs",
    "tensor_parallel_unit_costs",
    "tp_allreduce_s",
    "tp_unit_cost",
    "unsharded_grad_bytes",
]

TP_KINDS = ("layer",)
"""Unit kinds tensor parallelism splits (module docstring); the others are replicated on every TP rank."""
_TP_WHOLE_OUTPUTS = 4
"""Saved activations of a layer that keep the full hidden size under TP, in multiples of its output bytes."""


def tp_allreduce_s(num_bytes: float, tp: int, link: P2PModel | None) -> float:
    """Ring all-reduce seconds of ``num_bytes`` over ``tp`` ranks on ``link``: ``2 (tp - 1)`` latencies plus
    ``2 (tp - 1) / tp x num_bytes / bandwidth`` (Patarasuk & Yuan, JPDC 2009); 0 for ``tp == 1`` or no link."""
    if link is None or tp <= 1:
        return 0.0
    volume = 2.0 * (tp - 1) / tp * num_bytes
    return 2 * (tp - 1) * link.latency_s + (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


def gather_s(num_bytes: float, shards: int, link: P2PModel | None) -> float:
    """Ring all-gather (or reduce-scatter) seconds of a ``num_bytes`` tensor over ``shards`` ranks:
    ``(shards - 1)`` latencies plus ``(shards - 1) / shards x num_bytes / bandwidth``; 0 for one shard or no link."""
    if link is None or shards <= 1:
        return 0.0
    volume = (shards - 1) / shards * num_bytes
    return (shards - 1) * link.latency_s + (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


def _tp_cost(unit: Unit, cost: UnitCost, tp: int, link: P2PModel | None, routed: float = 0.0) -> UnitCost:
    """One unit's cost on each of ``tp`` ranks (module docstring); unchanged for kinds TP does not split.
    ``routed``: seconds of one pass of the unit's routed experts (``experts.ExpertLayer.routed_s(1)``), which every
    TP rank runs whole."""
    if tp == 1 or unit.kind not in TP_KINDS:
        return cost

    def split(seconds: float) -> float:  # the routed part (at most the pass) whole, the rest divided
        kept = min(seconds, routed)
        return kept + (seconds - kept) / tp

    comm = 2 * tp_allreduce_s(cost.output_bytes, tp, link)
    whole = min(cost.activation_bytes, _TP_WHOLE_OUTPUTS * cost.output_bytes)
    experts = cost.expert_param_bytes  # not in any TP plan: whole on every TP rank
    return dataclasses.replace(
        cost, forward_s=split(cost.forward_s) + comm,
        input_grad_s=split(cost.input_grad_s) + comm,
        weight_grad_s=split(cost.weight_grad_s), param_bytes=math.ceil((cost.param_bytes - experts) / tp) + experts,
        activation_bytes=int(round(whole + (cost.activation_bytes - whole) / tp)),
        recompute_s=split(cost.recompute_s), **cost.split_mapped(lambda b: split(b) + comm, split))


def tp_unit_cost(unit: Unit, cost: UnitCost, tp: int, link: P2PModel | None) -> UnitCost:
    """One unit's cost on each of ``tp`` ranks by the TP rule of the module docstring (a ``layer``'s passes,
    parameters and split activations divided, its all-reduces on ``link`` added; other kinds unchanged)."""
    return _tp_cost(unit, cost, tp, link)


def tensor_parallel_unit_costs(plan: PipelinePlan, units: Sequence[Unit], costs: Mapping[str, UnitCost],
                               link: P2PModel | None) -> dict[str, UnitCost]:
    """``costs`` (unit name -> one rank's whole-unit cost) with the units of every tensor-parallel encoder stage of
    ``plan`` (``Stage.tensor_parallel``: ``[parallel.pp] encoder_tp``, ``t = Stage.replicas`` ranks) as each of its
    ``t`` ranks runs them, by the TP rule of the module docstring: a layer's passes, parameters and split
    activations divided by ``t``, two all-reduces of its output bytes on ``link`` added to its forward and two to
    its input gradient (ring all-reduce, :func:`tp_allreduce_s`); embeddings, norms and the projector whole. Every
    rank of the group runs every row, so the simulator does not divide these costs by ``t`` again
    (``Stage.row_share``). Units of other stages keep their costs.

    Raises:
        ValueError: when a unit of a TP stage has no cost.
    """
    by_name = {u.name: u for u in units}
    out = dict(costs)
    for stage in plan.stages:
        if stage.tensor_parallel and not stage.replica:
            for name in stage.units:
                if name not in costs or name not in by_name:
                    raise ValueError(f"stage {stage.index}: unit {name!r} has no Unit or no UnitCost")
                out[name] = tp_unit_cost(by_name[name], costs[name], stage.replicas, link)
    return out


def _ep_cost(cost: UnitCost, ep: int) -> UnitCost:
    """``cost`` with its routed experts divided over ``ep`` ranks (module docstring, EP)."""
    if ep == 1 or not cost.expert_param_bytes:
        return cost
    local = math.ceil(cost.expert_param_bytes / ep)
    return dataclasses.replace(cost, param_bytes=cost.param_bytes - cost.expert_param_bytes + local,
                               expert_param_bytes=local)


def _shard_cost(unit: Unit, cost: UnitCost, shards: int, link: P2PModel | None, kept: bool = False,
                ep: int = 1) -> UnitCost:
    """One unit's cost with its state sharded over ``shards`` ranks: parameter bytes divided, the all-gathers'
    excess over compute added (forward; backward on its dX, else its dW; none in the backward when the parameters
    are ``kept`` from the forward, ``fsdp_reshard = "after_backward"``); its routed experts divided over ``ep``
    ranks first, then sharded over ``max(1, shards / ep)`` (module docstring, EP)."""
    cost = _ep_cost(cost, ep)
    if shards == 1 or not unit.trainable:  # frozen units stay whole, outside FSDP2
        return cost
    expert_shards = max(1, shards // ep)
    dense = cost.param_bytes - cost.expert_param_bytes
    gather = gather_s(dense, shards, link) + gather_s(cost.expert_param_bytes, expert_shards, link)
    forward = max(cost.forward_s, gather)
    backward = cost.backward_s(unit)
    extra = max(0.0, gather - backward) if unit.runs_backward and not kept else 0.0
    dx, dw = cost.input_grad_s, cost.weight_grad_s
    on_dx = unit.needs_input_grad or not unit.trainable
    if on_dx:
        dx += extra
    else:
        dw += extra / unit.trained_fraction
    experts = math.ceil(cost.expert_param_bytes / expert_shards)
    return dataclasses.replace(cost, forward_s=forward, input_grad_s=dx, weight_grad_s=dw,
                               param_bytes=math.ceil(dense / shards) + experts, expert_param_bytes=experts,
                               **cost.split_mapped(lambda b: b + extra if on_dx else b, lambda w: w))


def shard_costs(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees, *,
                tp_link: P2PModel | None = None, shard_link: P2PModel | None = None,
                checkpoint_overrides: dict[str, str] | None = None,
                experts: ExpertDispatch | None = None) -> list[UnitCost]:
    """Per-rank costs of ``units`` under ``degrees`` (module docstring: TP, then EP's time, then AC, then FSDP2
    and EP's memory), in unit order.

    Args:
        units: pipeline units with consistent flags (``graph.consistent_units``); costs: one rank's whole-unit costs.
        degrees: TP, shard and EP degrees and the checkpointing policy.
        tp_link: link of the TP all-reduces (within a node: NVLink); None: free.
        shard_link: link of FSDP2's all-gathers; None: free.
        checkpoint_overrides: per module a policy replacing ``degrees.checkpointing`` (``plan_checkpointing``).
        experts: the MoE layers and the EP group's link (``experts.expert_parallel_costs``); None: no all-to-all
            or imbalance charged (the experts' memory is still divided by ``degrees.ep``) and, under TP, the routed
            experts' time divided with the rest of the layer's.

    Raises:
        ValueError: when the lengths differ (or on an unknown policy, or EP with TP).
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    if degrees.ep > 1 and degrees.tp > 1:
        raise ValueError(f"EP ({degrees.ep}) with TP ({degrees.tp}) is not modelled")
    routed = {layer.unit: layer.routed_s(1) for layer in experts.layers} if experts is not None else {}
    out = [_tp_cost(u, c, degrees.tp, tp_link, routed.get(u.name, 0.0)) for u, c in zip(units, costs)]
    out = expert_parallel_costs(units, out, degrees.ep, experts)
    out = checkpointed_costs(out, plan_checkpointing(units, degrees.checkpointing, checkpoint_overrides))
    kept = degrees.fsdp_reshard == "after_backward"
    return [_shard_cost(u, c, degrees.dp_shard, shard_link, kept, degrees.ep) for u, c in zip(units, out)]


def pipelined_shard_costs(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees, *,
                          tp_link: P2PModel | None = None,
                          checkpoint_overrides: dict[str, str] | None = None,
                          experts: ExpertDispatch | None = None) -> list[UnitCost]:
    """Per-rank costs of ``units`` under ``degrees`` in a plan with pipeline stages (module docstring, "FSDP2 under
    pipeline stages"): TP and AC as :func:`shard_costs`; FSDP2 leaves each unit's time and ``param_bytes`` whole (the
    stage's parameters are gathered once per step, not per microbatch). Search them with
    :func:`pipelined_optimizer`, :func:`pipelined_overheads` and ``dp_shard = 1`` (the step's gather and
    reduce-scatter move the bytes of the DP all-reduce). ``experts``: as :func:`shard_costs`.

    Raises:
        ValueError: as :func:`shard_costs`.
    """
    whole = dataclasses.replace(degrees, dp_shard=1)
    return shard_costs(units, costs, whole, tp_link=tp_link, checkpoint_overrides=checkpoint_overrides,
                       experts=experts)


def pipelined_optimizer(optimizer: OptimizerSpec, dp_shard: int) -> OptimizerSpec:
    """``optimizer`` with its state (AdamW moments and fp32 master copy) divided over ``dp_shard`` ranks: with
    :func:`pipelined_shard_costs`, ``cost_model.unit_static_bytes`` is then what a rank holds under FSDP2 with
    pipeline stages (whole parameters and gradients, a shard of the state)."""
    return OptimizerSpec(optimizer.grad_bytes_per_param, optimizer.state_bytes_per_param / dp_shard)


def pipelined_overheads(overheads: ActionOverheads, dp_shard: int) -> ActionOverheads:
    """``overheads`` with the optimizer step over one shard of the parameters (``optimizer_s_per_byte / dp_shard``,
    charged on the whole bytes of :func:`pipelined_shard_costs`)."""
    return dataclasses.replace(overheads, optimizer_s_per_byte=overheads.optimizer_s_per_byte / dp_shard)


def _unsharded_grads(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees, dtype: Any,
                     optimizer: OptimizerSpec) -> tuple[list[UnitCost], list[float]]:
    """Per unit its TP-split cost (experts divided over ``degrees.ep``) and the bytes of its whole (unsharded)
    gradient on one TP rank (0 when frozen)."""
    tp_costs = [_ep_cost(_tp_cost(u, c, degrees.tp, None), degrees.ep) for u, c in zip(units, costs)]
    grad_b = optimizer.grad_bytes(dtype)
    return tp_costs, [trained_params(u, c, dtype) * grad_b for u, c in zip(units, tp_costs)]


def unsharded_grad_bytes(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees,
                         dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec()) -> float:
    """Bytes of every trainable unit's whole (unsharded) gradient on one TP rank: what ``fsdp_reduce = "step"`` keeps
    on the device between a rank's microbatches (``costs`` are whole-unit costs; ``dp_shard`` plays no part)."""
    return float(math.fsum(_unsharded_grads(units, costs, degrees, dtype, optimizer)[1]))


def accumulated_grad_bytes(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees,
                           dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec()) -> float:
    """Bytes ``fsdp_reduce = "step"`` with several microbatches per rank adds to :func:`shard_buffer_bytes`: every
    trainable unit's unsharded gradient (of one TP rank) is kept from the first microbatch's backward to the last,
    instead of one unit's at a time: ``sum(grads) - max(grads)`` (with ``fsdp_reshard = "after_backward"`` the
    difference of the two peaks of :func:`shard_buffer_bytes`). 0 when ``dp_shard == 1``."""
    if degrees.dp_shard == 1:
        return 0.0
    if degrees.fsdp_reshard == "after_backward":
        return (shard_buffer_bytes(units, costs, degrees, dtype, optimizer, accumulate=True)
                - shard_buffer_bytes(units, costs, degrees, dtype, optimizer))
    grads = _unsharded_grads(units, costs, degrees, dtype, optimizer)[1]
    return float(math.fsum(grads) - max(grads, default=0.0))


def kept_param_bytes(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees,
                     dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec()) -> float:
    """Bytes of unsharded parameters FSDP2 keeps from the forward to the backward (one TP rank; ``costs`` whole-unit,
    in the compute dtype): with ``fsdp_reshard = "after_backward"`` every trainable unit's, all held at the end of a
    microbatch's forward; 0 with ``"after_forward"`` (each unit's freed after its forward) or ``dp_shard == 1``."""
    if degrees.dp_shard == 1 or degrees.fsdp_reshard != "after_backward":
        return 0.0
    tp_costs = _unsharded_grads(units, costs, degrees, dtype, optimizer)[0]
    return float(math.fsum(c.param_bytes for u, c in zip(units, tp_costs) if u.trainable))


def shard_buffer_bytes(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees,
                       dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(), *,
                       accumulate: bool = False) -> float:
    """Bytes FSDP2 holds unsharded at its peak (module docstring), all on one TP rank (``costs`` are whole-unit costs,
    before ``shard_costs``; frozen units are not sharded, so not gathered). With ``fsdp_reshard = "after_forward"``:
    the largest unsharded parameters of two trainable units next to each other (the running unit and the
    prefetched next one, in unit order) plus the largest unsharded gradient of a trainable unit; with
    ``accumulate`` (``fsdp_reduce = "step"`` and several microbatches per rank) every trainable unit's unsharded
    gradient instead (:func:`accumulated_grad_bytes`). With ``"after_backward"`` the parameters of every unit whose
    backward is pending stay gathered: the peak over the backward (units in reverse order) of the parameters of
    units ``0..k`` plus unit ``k``'s gradient; with ``accumulate`` every parameter and every gradient (the end of a
    later microbatch's forward). 0 when ``dp_shard == 1``."""
    if degrees.dp_shard == 1:
        return 0.0
    tp_costs, grads = _unsharded_grads(units, costs, degrees, dtype, optimizer)
    params = [c.param_bytes if u.trainable else 0 for u, c in zip(units, tp_costs)]
    if degrees.fsdp_reshard == "after_backward":
        if accumulate:
            return float(math.fsum(params) + math.fsum(grads))
        prefix = [math.fsum(params[: k + 1]) for k in range(len(params))]
        return float(max((p + g for p, g in zip(prefix, grads)), default=0.0))
    pairs = max((a + b for a, b in zip(params, params[1:])), default=sum(params))
    held = math.fsum(grads) if accumulate else max(grads, default=0.0)
    return float(pairs + held)


def rank_memory(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees = ParallelDegrees(), *,
                dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
                checkpoint_overrides: dict[str, str] | None = None, pipelined: bool = False,
                accumulation: GradAccumulation = GradAccumulation()) -> RankMemory:
    """Per-rank memory of a stage holding ``units`` under ``degrees`` with one microbatch's activations in flight,
    split by kind (``RankMemory``): the same
    ``cost_model.unit_static_bytes`` / ``unit_activation_bytes`` the search charges, on ``shard_costs`` (with
    ``pipelined``, a stage of a plan with pipeline stages: :func:`pipelined_shard_costs` and
    :func:`pipelined_optimizer`, no separate buffer). Without pipeline stages, ``accumulation.microbatches`` (per
    rank, per step) above 1 with ``fsdp_reduce = "step"`` makes the buffer hold every trainable unit's unsharded
    gradient (:func:`shard_buffer_bytes` with ``accumulate``).

    Raises:
        ValueError: on mismatched lengths.
    """
    in_flight = 1
    if pipelined and degrees.dp_shard > 1:
        per_rank = pipelined_shard_costs(units, costs, degrees, checkpoint_overrides=checkpoint_overrides)
        memory = _memory(units, per_rank, in_flight, dtype, pipelined_optimizer(optimizer, degrees.dp_shard))
        return dataclasses.replace(memory, buffer=0.0)
    per_rank = shard_costs(units, costs, degrees, checkpoint_overrides=checkpoint_overrides)
    memory = _memory(units, per_rank, in_flight, dtype, optimizer)
    accumulate = accumulation.microbatches > 1 and accumulation.fsdp_reduce == "step"
    return dataclasses.replace(memory, buffer=shard_buffer_bytes(units, costs, degrees, dtype, optimizer,
                                                                 accumulate=accumulate))


def _memory(units: Sequence[Unit], per_rank: Sequence[UnitCost], in_flight: float, dtype: Any,
            optimizer: OptimizerSpec) -> RankMemory:
    """``RankMemory`` of per-rank costs, without a buffer."""
    params = float(sum(c.param_bytes for c in per_rank))
    no_state = OptimizerSpec(grad_bytes_per_param=optimizer.grad_bytes_per_param, state_bytes_per_param=0.0)
    static = sum(unit_static_bytes(u, c, dtype, optimizer) for u, c in zip(units, per_rank))
    with_grads = sum(unit_static_bytes(u, c, dtype, no_state) for u, c in zip(units, per_rank))
    acts = sum(unit_activation_bytes(u, c) for u, c in zip(units, per_rank))
    return RankMemory(params, with_grads - params, static - with_grads, in_flight * acts, 0.0)
