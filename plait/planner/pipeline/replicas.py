"""Rows of a microbatch split over the replicas of a replicated encoder stage (``Stage.replicas``).

A replicated encoder branch runs ``r`` copies of each of its stages; every microbatch's rows of the branch (its
samples that hold items of the branch, in microbatch order) are cut into ``r`` contiguous slices, one per replica,
balanced by cost (the exact min-max contiguous partition of :func:`plait.planner.search.partitioner.partition_chain`,
chains-on-chains partitioning). The first LLM stage concatenates the replicas' features in replica order, which is
row order, so it sees exactly the features one encoder stage would have sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.planner.search.partitioner import partition_chain

__all__ = ["plan_replica_rows"]


def plan_replica_rows(row_costs: Sequence[float], replicas: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[start, end)`` row slices of one microbatch's rows of a branch, one per replica, minimising
    the largest slice cost (ties: earlier slices take more rows).

    With fewer rows than replicas, each of the first rows gets a slice of its own and the last replicas get an
    empty slice ``(n, n)`` (they run nothing for that microbatch). No row: every slice is ``(0, 0)``.

    Args:
        row_costs: per row, its cost (any unit, e.g. the encoder's FLOPs or items of the sample), finite, >= 0.
        replicas: ``r >= 1``.

    Returns:
        ``r`` slices tiling ``0..len(row_costs)`` in order.

    Raises:
        ValueError: on ``replicas`` below 1 or a negative or non-finite cost.
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    costs = [float(c) for c in row_costs]
    bad = [c for c in costs if not 0.0 <= c < float("inf")]
    if bad:
        raise ValueError(f"row costs must be finite and >= 0, got {bad[0]}")
    n = len(costs)
    if n <= replicas:
        return tuple((min(k, n), min(k + 1, n)) for k in range(replicas))
    return tuple((int(a), int(b)) for a, b in partition_chain(costs, replicas))
