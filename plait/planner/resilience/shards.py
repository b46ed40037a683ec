"""Shard groups: FSDP2 inside the pipelines of a resilient job (``TemplateSet.dp_shard`` > 1).

With shard degree ``d`` the planner (templates, instantiation, reconfiguration) works on **shard groups**, not
workers: group ``g`` is workers ``g * d .. g * d + d - 1``, and a pipeline's plan rank runs on one group, each of
the group's workers holding shard ``i`` (its index in the group) of the rank's trainable units and running its own
copy of the pipeline (shard row ``i``: the pipeline's groups' ``i``-th workers) on its own microbatches. Every
pipeline has the same ``d``, so shard ``i`` of a unit is the same slice in every pipeline and its gradient is
summed among the workers of index ``i`` of the unit's holder groups. The functions here map the group-level plans
to workers; ``d = 1`` makes every group one worker (the plans are then the workers').

A worker's failure fails its group (its partners hold the other shards of the same units: the group's copy of them
is gone): the survivors plan at group level, and the partners leave the job (:func:`partners_left`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from plait.planner.resilience.types import Instantiation, Transfer

__all__ = ["failed_groups", "group_workers", "partners_left", "shard_rows", "worker_transfers"]


def group_workers(group: int, dp_shard: int) -> tuple[int, ...]:
    """The workers of shard group ``group``, in shard order."""
    return tuple(range(group * dp_shard, (group + 1) * dp_shard))


def shard_rows(inst: Instantiation, dp_shard: int) -> tuple[tuple[int, ...], ...]:
    """Per shard row, pipeline by pipeline and shard index within (row ``p * dp_shard + i``), the workers running
    its plan ranks in plan-rank order: worker ``i`` of each of pipeline ``p``'s groups."""
    return tuple(tuple(g * dp_shard + i for g in p.ranks) for p in inst.pipelines for i in range(dp_shard))


def failed_groups(inst: Instantiation, alive: Iterable[int], dp_shard: int) -> tuple[int, ...]:
    """The groups of ``inst`` with a worker not in ``alive`` (worker ids), sorted."""
    alive_set = set(alive)
    return tuple(g for g in inst.ranks if any(w not in alive_set for w in group_workers(g, dp_shard)))


def partners_left(inst: Instantiation, alive: Iterable[int], dp_shard: int) -> tuple[int, ...]:
    """The live workers of failed groups (:func:`failed_groups`), sorted: they hold shards of a copy that is gone
    and leave the job."""
    alive_set = set(alive)
    return tuple(w for g in failed_groups(inst, alive_set, dp_shard) for w in group_workers(g, dp_shard)
                 if w in alive_set)


def worker_transfers(transfers: Sequence[Transfer], dp_shard: int) -> tuple[Transfer, ...]:
    """Group-level unit copies as worker-level ones: a unit copied from group ``s`` to group ``t`` is copied shard
    by shard, worker ``i`` of ``s`` to worker ``i`` of ``t``, each ``1 / dp_shard`` of the bytes (the same
    order: group transfers in turn, shards within)."""
    out = []
    for t in transfers:
        for i in range(dp_shard):
            out.append(Transfer(t.unit, t.src * dp_shard + i, t.dst * dp_shard + i, t.param_bytes // dp_shard,
                                t.state_bytes // dp_shard))
    return tuple(out)
