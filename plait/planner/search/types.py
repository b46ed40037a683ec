"""What a layout search is asked: the machine a plan runs on and the space of plans searched.

Every search entry point (``search.plan_layout``, ``search.evaluate_plan``, ``search_parallel.plan_parallel``,
``auto_plan.plan_auto_layout``, ``templates.plan_templates``) takes a :class:`Machine` and, where it searches, a
:class:`SearchSpace`, instead of a long list of keyword arguments. Both are frozen and round-trip through JSON
(``serialize.JsonDataclass``). :class:`NoPlanFits` is the error of a search whose every candidate exceeds the
memory cap; it carries the least per-device memory any option searched needs (:class:`LeastNeed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.cost.analytic import OptimizerSpec
from plait.planner.cost.offload import HostSpec
from plait.planner.cost.overheads import ActionOverheads
from plait.planner.pipeline.plan import LAYOUTS
from plait.planner.cost.recompute import CHECKPOINT_POLICIES
from plait.planner.serialize import JsonDataclass
from plait.planner.cost.sharding import FSDP_RESHARD, ParallelDegrees
from plait.planner.pipeline.simulator import P2PModel

__all__ = ["LeastNeed", "Machine", "NoPlanFits", "SearchSpace"]


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
        frozen_aware: plan with the true frozen-aware costs (False: the frozen-unaware baseline, ``search``).
        rel_tol: stop when no candidate can beat the best by more than this fraction (0: exact).
        max_timed: at most this many interleaved / attached candidates are timed (``plan_layout``).
        tp_degrees, dp_shard_degrees: TP and FSDP2 shard degrees searched when the plain plan does not fit
            (None: powers of two, ``search_parallel.degree_options``).
        checkpointing: activation checkpointing policies searched (``recompute.CHECKPOINT_POLICIES``).
        base_checkpointing: the job's own policy: the plain plan's, and the only one searched when not ``"none"``.
        checkpoint_overrides: the job's per-module policies (``recompute.plan_checkpointing``), kept in every option.
        fsdp_reshard: FSDP2 resharding options searched without pipeline stages (``sharding.FSDP_RESHARD``).
        prefer_plain: keep the plain plan whenever it fits (False: the fastest over every option).
        offload: ``"auto"`` (CPU offload searched only when nothing fits without it) or ``"cpu"`` (offloaded plans
            only: a job's own ``parallel.offload``).
    """

    layouts: tuple[str, ...] = LAYOUTS
    dp_degrees: tuple[int, ...] | None = None
    virtual_stages: tuple[int, ...] = (1,)
    attach_encoders: bool = False
    frozen_aware: bool = True
    rel_tol: float = 0.0
    max_timed: int = 256
    tp_degrees: tuple[int, ...] | None = None
    dp_shard_degrees: tuple[int, ...] | None = None
    checkpointing: tuple[str, ...] = CHECKPOINT_POLICIES
    base_checkpointing: str = "none"
    checkpoint_overrides: dict[str, str] | None = None
    fsdp_reshard: tuple[str, ...] = FSDP_RESHARD
    prefer_plain: bool = True
    offload: str = "auto"

    def __post_init__(self) -> None:
        for name in ("layouts", "dp_degrees", "virtual_stages", "tp_degrees", "dp_shard_degrees", "checkpointing",
                     "fsdp_reshard"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


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

