"""What a layout search is asked: the machine a plan runs on and the space of plans searched.

Every search entry point (``search.plan_layout``, ``search.evaluate_plan``, ``search_parallel.plan_parallel``,
``auto_plan.plan_auto_layout``, ``templates.plan_templates``) takes a :class:`Machine` and, where it searches, a
:class:`SearchSpace`, instead of a long list of keyword arguments. Both are frozen and round-trip through JSON
(``serialize.JsonDataclass``). :class:`NoPlanFits` is the error of a search whose every candidate exceeds the
memory cap; it carries the least per-device memory any option searched needs (:class:`LeastNeed`).

What a search returns is here too: :class:`LayoutChoice` (the chosen layout with its predicted cost) and
:class:`UnitPartition` (a stage partition of named units with its predicted load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.planner.cost.topology import RANK_ORDERS, Topology
from plait.planner.cost.types import (CHECKPOINT_POLICIES, FSDP_RESHARD, ActionOverheads, HostSpec, OptimizerSpec,
                                      ParallelDegrees)
from plait.planner.pipeline.types import LAYOUTS, P2PModel, PipelinePlan
from plait.planner.serialize import JsonDataclass

__all__ = ["METHODS", "LayoutChoice", "LeastNeed", "Machine", "NoPlanFits", "SearchSpace", "UnitPartition"]


@dataclass(frozen=True)
class Machine(JsonDataclass):
    """The devices a plan runs on and what each holds per trainable parameter.

    Attributes:
        memory_cap: bytes per device a stage may use (parameters, gradients, optimizer state, activations in
            flight); None: unchecked.
        p2p: stage-to-stage transfer model (None: free and instant).
        dp_link: link of the data-parallel gradient all-reduce (None: not charged).
        tp_link: link of the tensor-parallel all-reduces (None: ``p2p``, within a node).
        shard_link: link of FSDP2's all-gathers and reduce-scatters (None: ``dp_link``).
        dtype: parameter dtype name for memory (``cost_model.dtype_bytes``).
        optimizer: optimizer state per trainable parameter (``cost_model.OptimizerSpec``).
        overheads: the runtime's fixed seconds per action, module chunk and optimizer byte
            (``overheads.ActionOverheads``; default none, GPU presets).
        host: the host side of a device for FSDP2 CPU offload (``offload.HostSpec``); None: offload not searched.
        dp_shard: FSDP2 shard degree the costs are per (``sharding.shard_costs``): only DP degrees it divides are
            searched and gradients are reduce-scattered; ``plan_parallel`` sets it per option.
        ep_link: link of the expert-parallel all-to-alls (``cost.experts``; None: ``shard_link``). With
            ``topology`` set it is derived like the others: ``topology.inter_link`` when an EP group spans nodes.
        topology: the nodes the devices sit in and their links (``cost.topology.Topology``); None: the explicit
            links above. When set, ``search_parallel.plan_parallel`` (and ``plan_auto_layout`` through it) ignores
            ``p2p``, ``dp_link``, ``tp_link`` and ``shard_link`` and derives them per plan from where each
            collective's group sits under the plan's rank order (``planner.search.placement``): ``topology.inter_link``
            when a group of the axis spans several nodes (the DP gradient synchronisation: ``dp`` or ``dp_shard``;
            FSDP2's all-gathers: ``dp_shard``; TP: ``tp``; stage transfers: ``pp``), else ``intra_link`` (None:
            free, as ``Topology`` says). The searches under fixed degrees (``plan_layout``, ``evaluate_plan``) read
            the explicit links only: ``plan_parallel`` sets them for each plan it hands them.
    """

    memory_cap: float | None = None
    p2p: P2PModel | None = None
    dp_link: P2PModel | None = None
    tp_link: P2PModel | None = None
    shard_link: P2PModel | None = None
    dtype: str = "bfloat16"
    optimizer: OptimizerSpec = OptimizerSpec()
    overheads: ActionOverheads = ActionOverheads()
    host: HostSpec | None = HostSpec()
    dp_shard: int = 1
    topology: Topology | None = None
    ep_link: P2PModel | None = None


@dataclass(frozen=True)
class SearchSpace(JsonDataclass):
    """The plans a search considers.

    Attributes:
        layouts: encoder layouts (``pipeline_plan.LAYOUTS``; a model without encoders has one either way).
        dp_degrees: data-parallel degrees (all of ``dp x dp_shard``); None: divisors of the devices up to the
            microbatches (``plan_layout``).
        virtual_stages: LLM chunks per LLM rank (1: one stage per rank, 1F1B; ``v > 1``: interleaved 1F1B,
            Narayanan et al., SC'21, section 2.2.2).
        attach_encoders: also consider plans whose encoders are one stage each on the first LLM rank.
        in_bubble: also consider plans whose encoders are one stage on the last LLM rank, their work in its
            bubbles (``plan.stage_ranks(..., in_bubble=True)``; timed with ``1f1b`` and the zero-bubble H schedules
            of ``schedules``, ``schedules.IN_BUBBLE_SCHEDULES``).
        frozen_aware: plan with the true frozen-aware costs (False: the frozen-unaware baseline, ``search``).
        rel_tol: stop when no candidate can beat the best by more than this fraction (0: exact).
        max_timed: at most this many interleaved / attached candidates are timed (``plan_layout``).
        tp_degrees, dp_shard_degrees: TP and FSDP2 shard degrees searched (None: powers of two,
            ``search_parallel.degree_options``).
        checkpointing: activation checkpointing policies searched (``recompute.CHECKPOINT_POLICIES``).
        base_checkpointing: the job's own policy: the plain plan's, and the only one searched when not ``"none"``.
        checkpoint_overrides: the job's per-module policies (``recompute.plan_checkpointing``), kept in every option.
        fsdp_reshard: FSDP2 resharding options searched without pipeline stages (``sharding.FSDP_RESHARD``).
        prefer_plain: keep the plain plan whenever it fits (default False: the fastest over every option,
            ``search_parallel.plan_parallel``).
        offload: ``"auto"`` (CPU offload searched only when nothing fits without it) or ``"cpu"`` (offloaded plans
            only: a job's own ``parallel.offload``).
        schedules: the schedules weighed for the best plan with one stage per rank (``schedules.SCHEDULE_NAMES``:
            1F1B and the zero-bubble ``zb_h1`` / ``zb_h2``), and ``zb_v`` on that plan's LLM cut into twice its
            ranks' stages placed in a V; the fastest that fits the memory cap is chosen (``plan_layout``).
            Interleaved and attached plans run ``interleaved_1f1b``.
        ep_degrees: expert-parallel degrees searched (``ParallelDegrees.ep``, with ``tp = 1``; each must divide the
            plan's data-parallel degree and every MoE layer's experts); None: powers of two dividing the experts
            when ``plan_parallel`` is given MoE layers, else 1 only.
        encoder_dp: per encoder branch, the most data-parallel replicas of each of its stages searched
            (``search.encoder_dp``: powers of two up to it; a replica takes an equal share of every microbatch's rows
            of the branch, so it is at most the branch's rows per microbatch); ``()``: every branch at degree 1.
        encoder_tp: per encoder branch, the most tensor-parallel degree of its stages searched beside its replicas
            (``[parallel.pp] encoder_tp``: powers of two up to it, on ranks of their own; each must divide the
            tower's heads, so give the largest power of two that does); ``()``: none.
    """

    layouts: tuple[str, ...] = LAYOUTS
    dp_degrees: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] = (1,)
    attach_encoders: bool = False
    in_bubble: bool = False
    frozen_aware: bool = True
    rel_tol: float = 0.0
    max_timed: int = 256
    tp_degrees: tuple[int, ...] | None = None
    dp_shard_degrees: tuple[int, ...] | None = None
    checkpointing: tuple[str, ...] = CHECKPOINT_POLICIES
    base_checkpointing: str = "none"
    checkpoint_overrides: dict[str, str] | None = None
    fsdp_reshard: tuple[str, ...] = FSDP_RESHARD
    prefer_plain: bool = False
    offload: str = "auto"
    schedules: tuple[str, ...] = ("1f1b",)
    ep_degrees: tuple[int, ...] | None = None
    encoder_dp: tuple[tuple[str, int], ...] = ()
    encoder_tp: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("encoder_dp", "encoder_tp"):
            object.__setattr__(self, name, tuple((str(m), int(r)) for m, r in dict(getattr(self, name)).items()))
            if any(r < 1 for _, r in getattr(self, name)):
                raise ValueError(f"SearchSpace.{name} degrees must be >= 1, got {dict(getattr(self, name))}")
        for name in ("layouts", "dp_degrees", "virtual_stages", "tp_degrees", "dp_shard_degrees", "checkpointing",
                     "fsdp_reshard", "schedules", "ep_degrees"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if not self.schedules:
            raise ValueError("SearchSpace.schedules must name at least one schedule (e.g. '1f1b')")

    @property
    def copies_encoders(self) -> bool:
        """True when some encoder branch may run its stages on several ranks (``encoder_dp`` or ``encoder_tp``)."""
        return any(r > 1 for _, r in (*self.encoder_dp, *self.encoder_tp))


@dataclass(frozen=True)
class LeastNeed(JsonDataclass):
    """The least per-device memory any option searched needs (``fit.least_need``).

    Attributes:
        bytes: a lower bound of the fullest device of the least-needing option (bytes).
        degrees: that option.
        offloaded: True when that option needs FSDP2 CPU offload to get that low.
    """

    bytes: float
    degrees: ParallelDegrees
    offloaded: bool = False


class NoPlanFits(ValueError):
    """No candidate of a layout search fits the memory cap (a ``ValueError``: one line where errors print).

    Attributes:
        least: the least per-device need over the options searched (``search_parallel.plan_parallel`` fills it;
            None from a search under fixed degrees, ``search.plan_layout``).
    """

    def __init__(self, message: str, least: LeastNeed | None = None) -> None:
        super().__init__(message)
        self.least = least


METHODS = ("plait", "frozen_unaware", "megatron_even", "given")


@dataclass(frozen=True)
class LayoutChoice(JsonDataclass):
    """A chosen pipeline layout with its predicted cost (times in seconds, memory in bytes).

    Attributes:
        method: who chose it: ``"plait"`` (frozen-aware search), ``"frozen_unaware"`` (search with the
            frozen-unaware cost model), ``"megatron_even"`` (even split by unit count) or ``"given"``.
        layout: ``"encoder_parallel"`` or ``"encoders_colocated"`` (the plan's layout).
        dp: data-parallel degree (pipeline replicas).
        stages_per_module: ``((module, stages), ...)`` in plan order, ``"llm"`` last.
        plan: one replica's ``PipelinePlan`` (``num_microbatches`` = microbatches per replica).
        microbatches: global microbatches per iteration (all replicas).
        devices: accelerators available; ``devices_used = dp * plan.num_ranks``.
        iteration_s: predicted iteration time with the true frozen-aware costs: ``makespan_s + grad_sync_s +
            update_s``.
        makespan_s: simulated 1F1B makespan of the busiest replica (``ceil(microbatches / dp)``
            microbatches).
        grad_sync_s: data-parallel gradient all-reduce after the flush (0 without ``dp_link`` or for dp 1).
        update_s: the slowest rank's optimizer step after it (``overheads.ActionOverheads.update_s``; 0 unless
            charged).
        planned_iteration_s: the iteration time the choosing cost model predicted (differs from
            ``iteration_s`` for ``"frozen_unaware"``).
        lower_bound_s: ``microbatches * (total true work per microbatch) / devices``.
        bubble_fraction: idle fraction of the pipeline ranks over the makespan, averaged over ranks.
        stage_forward_s, stage_backward_s: per stage, forward and full backward (dX + dW) seconds per
            microbatch (true costs); ``stage_work_s`` is their sum.
        stage_weight_grad_s: under a split-backward schedule (``zb_h1``, ``zb_h2``, ``zb_v``), per stage the seconds of its
            ``W`` action (dW), included in ``stage_backward_s`` (its ``B`` is the rest); empty otherwise.
        stage_static_bytes, stage_activation_bytes: per stage, parameters + gradients + optimizer state,
            and saved activations per in-flight microbatch.
        stage_memory_bytes: per stage, peak memory under 1F1B (static + peak in-flight x activations).
        stage_boundary_bytes: per stage, bytes sent to its successor per microbatch (its gradient alike).
        memory_cap: bytes per device the plan was checked against (None: unchecked).
        fits_memory: every rank's simulated peak is within ``memory_cap``.
        p2p: the point-to-point model used for stage transfers.
        candidates: candidates the search considered (lower-bounded); simulated: candidates timed.
        schedule: the schedule the plan is timed with (``"1f1b"``, a zero-bubble one, or ``"interleaved_1f1b"``
            / ``"zb_v"`` when LLM ranks hold several chunks or the encoders sit on the first LLM rank); the runtime
            must run the same one.
        update_s: see ``iteration_s``.
        dp_shard: of the ``dp`` data-parallel ranks of each stage, how many share one sharded copy of its
            parameters, gradients and optimizer state (FSDP2, ``parallel.dp_shard``; it divides ``dp``; the
            replicate degree ``parallel.dp`` is ``dp / dp_shard``). Costs and memory are then per shard.
        tp: tensor-parallel degree: every pipeline rank is ``tp`` devices splitting its layers
            (``sharding.shard_costs``); ``devices_used = dp * plan.num_ranks * tp``.
        checkpointing: the activation checkpointing policy the costs include (``train.activation_checkpointing``).
        shard_buffer_bytes: FSDP2's transient unsharded bytes per rank (``sharding.shard_buffer_bytes``), included
            in ``fits_memory`` (not in the per-stage memory).
        offload: ``"cpu"`` when FSDP2 offloads its shards, gradients and optimizer state to the host
            (``parallel.offload``; ``offload.offload_cost``: a plan without pipeline stages), else ``"none"``.
        host_memory_bytes: host memory per device the plan needs (offload), included in ``fits_memory``.
        offload_s: seconds offload adds to the iteration (copies, per-microbatch reduce-scatters, the host's
            AdamW), included in ``iteration_s``.
        fsdp_reduce: FSDP2 without pipeline stages (``parallel.fsdp_reduce``, ``search_parallel.flat_reduce``):
            ``"step"`` (gradients accumulate unsharded, reduce-scattered at the last microbatch) or ``"microbatch"``
            (reduce-scattered after every microbatch, included in ``iteration_s``).
        fsdp_reshard: FSDP2 without pipeline stages (``parallel.fsdp_reshard``, ``sharding.FSDP_RESHARD``):
            ``"after_forward"`` (each unit gathered again for its backward) or ``"after_backward"`` (kept from its
            forward: no backward all-gather, every trainable unit's parameters in ``shard_buffer_bytes``).
        rank_order: the order of the parallel axes in the rank numbering the costs assume (a
            ``cost.topology.RANK_ORDERS`` name: ``"dp_outer"`` or ``"pp_outer"``); the runtime must number its ranks
            the same way (``parallel.rank_order``) for the collectives to sit where they were charged.
            ``plan_parallel`` sets it from ``Machine.topology`` (``topology.plan_rank_order`` of the plan's
            degrees); without a topology it stays ``"dp_outer"``.
        schedules_weighed: the schedules ``plan_layout`` timed for this choice, ``(schedule, iteration_s,
            fits_memory)`` each (``SearchSpace.schedules``; ``zb_v`` on its own V, ``interleaved_1f1b`` on the best
            interleaved or attached plan), fastest first; empty when only one was timed. The chosen one is the
            fastest that fits the memory cap.
        ep: expert-parallel degree (``parallel.ep``): of the ``dp`` data-parallel ranks of the LLM's stages, how many
            split each MoE layer's routed experts (``cost.experts``); it divides ``dp``.
        encoder_dp: ``((branch, replicas), ...)`` of the encoder branches whose stages are replicated
            (``[parallel.pp] encoder_dp``: each stage of the branch on ``replicas`` ranks, each taking an equal share
            of every microbatch's rows, its gradients all-reduced over ``replicas x dp`` ranks); ``()``: none.
        encoder_tp: ``((branch, t), ...)`` of the encoder branches whose stages are tensor-parallel groups
            (``[parallel.pp] encoder_tp``: each stage on ``t`` ranks of its own, every row on each); ``()``: none.

    Raises:
        ValueError: when the per-stage tuples do not have one entry per stage, an unknown method or an unknown
            rank order.
    """

    method: str
    layout: str
    dp: int
    stages_per_module: tuple[tuple[str, int], ...]
    plan: PipelinePlan
    microbatches: int
    devices: int
    iteration_s: float
    makespan_s: float
    grad_sync_s: float
    planned_iteration_s: float
    lower_bound_s: float
    bubble_fraction: float
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    stage_static_bytes: tuple[float, ...]
    stage_activation_bytes: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    stage_boundary_bytes: tuple[float, ...]
    memory_cap: float | None = None
    fits_memory: bool = True
    p2p: P2PModel = P2PModel()
    candidates: int = 0
    simulated: int = 0
    schedule: str = "1f1b"
    update_s: float = 0.0
    dp_shard: int = 1
    tp: int = 1
    checkpointing: str = "none"
    shard_buffer_bytes: float = 0.0
    offload: str = "none"
    host_memory_bytes: float = 0.0
    offload_s: float = 0.0
    fsdp_reduce: str = "step"
    fsdp_reshard: str = "after_forward"
    stage_weight_grad_s: tuple[float, ...] = ()
    rank_order: str = "dp_outer"
    schedules_weighed: tuple[tuple[str, float, bool], ...] = ()
    ep: int = 1
    encoder_dp: tuple[tuple[str, int], ...] = ()
    encoder_tp: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder_dp", tuple((str(m), int(r)) for m, r in self.encoder_dp))
        object.__setattr__(self, "encoder_tp", tuple((str(m), int(r)) for m, r in self.encoder_tp))
        if not isinstance(self.plan, PipelinePlan):
            object.__setattr__(self, "plan", PipelinePlan.from_dict(self.plan))
        if not isinstance(self.p2p, P2PModel):
            object.__setattr__(self, "p2p", P2PModel.from_dict(self.p2p))
        object.__setattr__(self, "stages_per_module", tuple((str(m), int(s)) for m, s in self.stages_per_module))
        for name in _STAGE_FIELDS:
            value = tuple(float(v) for v in getattr(self, name))
            object.__setattr__(self, name, value)
            if len(value) != self.plan.num_stages:
                raise ValueError(f"LayoutChoice.{name} has {len(value)} entries for {self.plan.num_stages} stages")
        object.__setattr__(self, "stage_weight_grad_s", tuple(float(v) for v in self.stage_weight_grad_s))
        if self.stage_weight_grad_s and len(self.stage_weight_grad_s) != self.plan.num_stages:
            raise ValueError(f"LayoutChoice.stage_weight_grad_s has {len(self.stage_weight_grad_s)} entries for "
                             f"{self.plan.num_stages} stages")
        if self.method not in METHODS:
            raise ValueError(f"LayoutChoice.method must be one of {METHODS}, got {self.method!r}")
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"LayoutChoice.rank_order must be one of {tuple(RANK_ORDERS)}, got {self.rank_order!r}")
        object.__setattr__(self, "schedules_weighed",
                           tuple((str(n), float(t), bool(f)) for n, t, f in self.schedules_weighed))

    @property
    def microbatches_per_replica(self) -> int:
        """``ceil(microbatches / dp)``: what the busiest replica runs."""
        return -(-self.microbatches // self.dp)

    @property
    def devices_used(self) -> int:
        """``dp * pipeline ranks * tp``."""
        return self.dp * self.plan.num_ranks * self.tp

    @property
    def stage_work_s(self) -> tuple[float, ...]:
        """Per stage, forward + backward seconds per microbatch (true costs)."""
        return tuple(f + b for f, b in zip(self.stage_forward_s, self.stage_backward_s))

    @property
    def ratio_to_lower_bound(self) -> float:
        """``iteration_s / lower_bound_s`` (1 is perfect; inf when the bound is 0)."""
        return self.iteration_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf


_STAGE_FIELDS = ("stage_forward_s", "stage_backward_s", "stage_static_bytes", "stage_activation_bytes",
                 "stage_memory_bytes", "stage_boundary_bytes")


@dataclass(frozen=True)
class UnitPartition(JsonDataclass):
    """A stage partition of named units with its predicted load.

    Attributes:
        ranges: half-open unit index range per stage.
        stage_units: unit names per stage.
        stage_work_s: forward + backward seconds per microbatch per stage.
        stage_memory_bytes: peak memory per stage (bytes) with the in-flight microbatches used to plan.
        bottleneck_s: ``max(stage_work_s)``.
        frozen_aware: whether the work applied the units' frozen flags (memory always does).
    """

    ranges: tuple[tuple[int, int], ...]
    stage_units: tuple[tuple[str, ...], ...]
    stage_work_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    bottleneck_s: float
    frozen_aware: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", tuple(tuple(r) for r in self.ranges))
        object.__setattr__(self, "stage_units", tuple(tuple(s) for s in self.stage_units))
        object.__setattr__(self, "stage_work_s", tuple(self.stage_work_s))
        object.__setattr__(self, "stage_memory_bytes", tuple(self.stage_memory_bytes))
