"""``plan_microbatches``: assign the samples of one global batch to DP ranks and microbatches by the
policy's method (``hierarchical`` in its own module; the baselines here).

Baselines: ``"arrival"`` (consecutive equal-count groups in arrival order, what a plain loader does),
``"random"`` (a seeded shuffle, then the same) and ``"lpt"`` (Graham 1969, "Bounds on multiprocessing timing
anomalies", SIAM J. Appl. Math. 17(2): longest processing time first, onto the least-loaded microbatch,
over the scalar total cost of all modules).

Determinism: a plan depends only on ``(costs, policy, step)``. Ties are broken by a permutation drawn from
a generator seeded with a hash of ``(policy.seed, step)`` (so for ``"hierarchical"`` and ``"lpt"`` the step
only matters through ties); the hierarchical balancing is exact integer arithmetic on quantised work and
``"lpt"`` adds floats in a fixed order, so every rank computes the same plan without communication (same
Python version assumed, as for any seeded run).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.planner.microbatch.hierarchical import plan_hierarchical
from plait.planner.microbatch.partition import chunks, count_ok, no_fit, pick, tie_keys
from plait.planner.microbatch.types import MicrobatchPlan, MicrobatchPolicy, SampleCost, check_costs, check_int

__all__ = [
    "plan_microbatches",
]


def _plan_equal_groups(order: Sequence[int], policy: MicrobatchPolicy) -> list[tuple[int, int, int]]:
    """Consecutive equal-count groups of ``order``: first over DP ranks, then over microbatches."""
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * len(order)
    for r, chunk in enumerate(chunks(order, policy.dp)):
        for i, part in enumerate(chunks(chunk, policy.num_microbatches)):
            for p in part:
                assign[p] = (r, i, i)
    return assign


def _plan_arrival(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    return _plan_equal_groups(list(range(len(costs))), policy)


def _plan_random(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    return _plan_equal_groups(sorted(range(len(costs)), key=keys.__getitem__), policy)


def _plan_lpt(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    """Graham's LPT over all ``dp * M`` microbatches on the scalar total cost; microbatch ``g`` belongs to
    rank ``g // M``. Honours ``equal_counts_per_rank`` and ``max_tokens_per_microbatch``."""
    m, n = policy.num_microbatches, len(costs)
    groups = policy.dp * m
    totals = [c.total for c in costs]
    loads = np.zeros(groups)
    counts = np.zeros(groups, dtype=np.int64)
    tokens = np.zeros(groups, dtype=np.int64)
    rank_counts = np.zeros(policy.dp, dtype=np.int64)
    cap = policy.max_tokens_per_microbatch
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * n
    for p in sorted(range(n), key=lambda p: (-totals[p], keys[p])):
        mask = np.ones(groups, dtype=bool)
        if policy.equal_counts_per_rank:
            mask &= np.repeat(count_ok(rank_counts, n), m)
        if cap is not None:
            mask &= tokens + costs[p].tokens <= cap
        g = pick(loads, counts, mask)
        if g < 0:
            raise no_fit(costs[p], policy)
        loads[g] += totals[p]
        counts[g] += 1
        tokens[g] += costs[p].tokens
        rank_counts[g // m] += 1
        assign[p] = (g // m, g % m, g % m)
    return assign


_PLANNERS = {
    "arrival": _plan_arrival,
    "random": _plan_random,
    "lpt": _plan_lpt,
    "hierarchical": plan_hierarchical,
}


def plan_microbatches(costs: Sequence[SampleCost], policy: MicrobatchPolicy, step: int) -> MicrobatchPlan:
    """Assign the samples of one global batch to DP ranks and microbatches.

    Args:
        costs: one ``SampleCost`` per sample, in arrival order (the order ``"arrival"`` keeps).
        policy: method, ``dp``, ``num_microbatches`` and options (``MicrobatchPolicy``).
        step: the training step (>= 0); with ``policy.seed`` it seeds shuffles and tie-breaking, so the
            same inputs give the same plan on every rank.

    Returns:
        A ``MicrobatchPlan`` in which every sample appears exactly once; microbatches may be empty (package
        docstring). Only ``"hierarchical"`` defers samples (``llm_microbatch`` > encoder microbatch).

    Raises:
        ValueError: on inconsistent costs (duplicate index, differing module counts), a negative step, or a
            sample that fits in no microbatch under ``max_tokens_per_microbatch``.
    """
    costs = check_costs(costs)
    check_int("plan_microbatches", "step", step, 0)
    keys = tie_keys(len(costs), policy.seed, step)
    assign = _PLANNERS[policy.method](costs, policy, keys)
    mbs: list[list[list[tuple[int, int]]]] = [
        [[] for _ in range(policy.num_microbatches)] for _ in range(policy.dp)
    ]
    for cost, (r, i, j) in zip(costs, assign):
        mbs[r][i].append((cost.index, j))
    return MicrobatchPlan(
        method=policy.method,
        dp=policy.dp,
        num_microbatches=policy.num_microbatches,
        step=step,
        microbatches=tuple(tuple(tuple(x for x, _ in sorted(mb)) for mb in rank) for rank in mbs),
        llm_microbatch=tuple(tuple(tuple(j for _, j in sorted(mb)) for mb in rank) for rank in mbs),
    )
