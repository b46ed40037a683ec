"""The FSDP2 collectives of a ``plait plan`` that shards (``dp_shard > 1``), as one line for people.

Under FSDP2 (``plait.parallel.fsdp``) each trainable pipeline unit is one group: its parameters are all-gathered
just before its forward and again before its backward, in every microbatch, and its gradient is reduce-scattered
(then all-reduced over the HSDP replicas) once per step as its last backward ends. :func:`fsdp_collectives` times
them with the planner's own ring formulas (``planner.sharding.gather_s``, ``planner.search_model.grad_sync_s``) on
the link the search charges them on; :func:`fsdp_line` prints them in place of the plain DP all-reduce that a
sharded plan does not run.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.planner.pipeline.graph import consistent_units
from plait.planner.search.types import LayoutChoice
from plait.planner.search.model import grad_sync_s
from plait.planner.cost.sharding import gather_s, shard_costs
from plait.planner.cost.types import ParallelDegrees
from plait.planner.pipeline.types import P2PModel
from plait.planner.types import Unit, UnitCost

__all__ = ["fsdp_collectives", "fsdp_line"]


def fsdp_collectives(units: Sequence[Unit], costs: Sequence[UnitCost], choice: LayoutChoice,
                     link: P2PModel | None) -> tuple[float, float]:
    """``(all-gather seconds per microbatch, gradient synchronisation seconds per step)`` of one rank of a sharded
    plan: two all-gathers (forward, backward; one when ``choice.fsdp_reshard`` is ``"after_backward"``) of each
    trainable unit's parameters (``costs``: whole units on one
    device; their TP shard under the plan's TP degree, ``sharding.shard_costs``) over ``choice.dp_shard`` ranks, and the reduce-scatter of the trained
    share of those bytes over them plus the all-reduce of the shard over the ``dp / dp_shard`` replicas (HSDP).
    ``(0, 0)`` without a link or sharding.

    Raises:
        ValueError: when the lengths of ``units`` and ``costs`` differ.
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    if choice.dp_shard <= 1 or link is None:
        return 0.0, 0.0
    units = consistent_units(units)
    split = shard_costs(units, costs, ParallelDegrees(tp=choice.tp))  # the TP shard of each unit, as the search's
    trained = [(u, c.param_bytes) for u, c in zip(units, split) if u.trainable]
    passes = 1 if choice.fsdp_reshard == "after_backward" else 2  # kept from the forward to the backward: one
    gathers = passes * sum(gather_s(b, choice.dp_shard, link) for _, b in trained)
    shard = sum(b * u.trained_fraction for u, b in trained) / choice.dp_shard
    return gathers, grad_sync_s(shard, choice.dp, link, choice.dp_shard)


def fsdp_line(units: Sequence[Unit], costs: Sequence[UnitCost], choice: LayoutChoice, link: P2PModel | None) -> str:
    """One line on a sharded plan's FSDP2 collectives (:func:`fsdp_collectives`); empty for ``dp_shard = 1``."""
    if choice.dp_shard <= 1:
        return ""
    if link is None:
        return "FSDP2 collectives: not timed (no link to charge them on)"
    gathers, sync = fsdp_collectives(units, costs, choice, link)
    speed = f"{link.bandwidth_Bps / 1e9:.1f} GB/s" if link.bandwidth_Bps else "unlimited"
    if choice.plan.num_ranks > 1:  # FSDP2 under stages (parallel.fsdp): one gather per step, a reduction per stage
        return (f"FSDP2 collectives ({speed} link): each rank all-gathers its stages' trainable parameters once per "
                f"step and reduce-scatters each stage's gradients after its last backward: {1e3 * gathers / 2:.2f} ms "
                f"of all-gathers and {1e3 * sync:.2f} ms of gradient reduce-scatter"
                f"{' + replica all-reduce' if choice.dp > choice.dp_shard else ''} per step over all stages "
                "(the search charges them as the DP all-reduce's bytes)")
    return (f"FSDP2 collectives per rank ({speed} link): parameter all-gathers {1e3 * gathers:.2f} ms per microbatch "
            + ("(forward only: kept until the backward, parallel.fsdp_reshard = \"after_backward\"; "
               if choice.fsdp_reshard == "after_backward" else "(forward and backward; ")
            + f"what compute does not hide is in the stage times), gradient reduce-scatter"
            f"{' + replica all-reduce' if choice.dp > choice.dp_shard else ''} {1e3 * sync:.2f} ms "
            + (f"per microbatch ({choice.microbatches_per_replica} per step, parallel.fsdp_reduce = \"microbatch\")"
               if choice.fsdp_reduce == "microbatch" else "per step") + " (each unit's as its backward ends)")
