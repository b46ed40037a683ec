"""Work balance of a microbatch plan (``workload_stats``), Entrain's metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.planner.microbatch.types import MicrobatchPlan, SampleCost, WorkloadStats, check_costs

__all__ = ["workload_stats"]


def _spread(values: np.ndarray) -> tuple[float, float]:
    """(cv, max/mean) of ``values``; (0, 1) when they are all zero."""
    mean = float(values.mean()) if values.size else 0.0
    if mean <= 0:
        return 0.0, 1.0
    return float(values.std() / mean), float(values.max() / mean)


def _per_microbatch_work(plan: MicrobatchPlan, costs: Sequence[SampleCost]) -> np.ndarray:
    """Array (dp * M, modules) of the work each microbatch runs per module.

    Raises:
        ValueError: when the plan and ``costs`` do not hold the same sample indices.
    """
    by_index = {c.index: c for c in costs}
    if set(by_index) != set(plan.placements):
        missing = sorted(set(by_index) ^ set(plan.placements))[:5]
        raise ValueError(f"workload_stats: plan and costs differ in samples, e.g. {missing}")
    k = len(costs[0].work) if costs else 1
    work = np.zeros((plan.dp * plan.num_microbatches, k))
    for index, (r, i, j) in plan.placements.items():
        w = by_index[index].work
        work[r * plan.num_microbatches + i, :-1] += w[:-1]
        work[r * plan.num_microbatches + j, -1] += w[-1]
    return work


def workload_stats(
    plan: MicrobatchPlan, costs: Sequence[SampleCost], module_names: Sequence[str] | None = None
) -> WorkloadStats:
    """Per-module balance of ``plan`` under ``costs``: CV and max/mean over all microbatches of all ranks.

    Args:
        plan: a plan for exactly the samples of ``costs``.
        costs: the per-sample costs (any order).
        module_names: names in ``work`` order; default ``("module0", ..., "llm")``.

    Raises:
        ValueError: when plan and costs hold different samples, or names do not match the module count.
    """
    costs = check_costs(costs)
    work = _per_microbatch_work(plan, costs)
    k = work.shape[1]
    names = (
        tuple(module_names)
        if module_names is not None
        else tuple(f"module{x}" for x in range(k - 1)) + ("llm",)
    )
    if len(names) != k:
        raise ValueError(f"workload_stats: {len(names)} module names for {k} modules")
    per_module = [_spread(work[:, x]) for x in range(k)]
    total_cv, total_mom = _spread(work.sum(axis=1))
    per_rank = work.reshape(plan.dp, plan.num_microbatches, k).sum(axis=1)
    buffered = [b for r in range(plan.dp) for b in plan.buffered(r)]
    return WorkloadStats(
        modules=names,
        cv=tuple(cv for cv, _ in per_module),
        max_over_mean=tuple(mom for _, mom in per_module),
        total_cv=total_cv,
        total_max_over_mean=total_mom,
        rank_max_over_mean=tuple(_spread(per_rank[:, x])[1] for x in range(k)),
        num_microbatches=plan.dp * plan.num_microbatches,
        num_deferred=len(plan.deferred()),
        max_buffered=max(buffered, default=0),
    )
