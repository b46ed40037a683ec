"""What makes ``parallel.plan_parallel`` complete and monotone in the device count: a lower bound of every plan under
one option's per-rank costs, and the search over the divisors of the device count.

:func:`work_bound` bounds every plan (any layout, DP degree, pipeline ranks, schedule) of one option from below by
two facts of the per-rank unit costs: one microbatch's forward and input-gradient chain (the LLM's units in order
after the slowest encoder branch) runs in sequence, and a replica of ``p`` ranks does ``ceil(M / dp)`` microbatches'
work on them, at least the heaviest unit's per microbatch on one rank. It is a true bound (links, overheads and
the gradient synchronisation only add), so ``parallel.search_degrees`` may skip an option whose bound reaches the
best time found.

:func:`plan_over_divisors` makes the search monotone: the plan for ``N`` devices is the fastest of the search on
``N`` (seeded with the best time so far, so options that cannot beat it are skipped) and of the plan for every
proper divisor ``d`` of ``N``, computed the same way and run as it is, its DP replicas unchanged and the other
``N - d`` devices idle (its time does not change: a plan's links depend on its degrees, not on the devices
around it). The plan for ``d`` replicated ``N / d`` times (``N / d`` times its DP degree) is in the search on ``N``
itself (a DP degree dividing ``N``; without pipeline stages, FSDP2's every-device-a-DP-rank plan). Every
divisor's plan is the one a search for ``d`` alone returns (each is computed from its own divisors only), so
``time(N) <= time(d)`` holds exactly, whatever the per-option searches' own exactness. The search on ``N`` may
also come first (``incumbent_first``): the divisors' searches then look only for plans at most as fast as the best
so far, the same fastest plan found with their weak options pruned by the bound.

:class:`RankCosts` keeps each option's per-rank costs for every divisor's search (they do not depend on the device
count); ``layout`` keeps each planning view's partitions the same way. Pure: no torch, no files.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from plait.planner.cost.sharding import shard_costs
from plait.planner.cost.types import ParallelDegrees
from plait.planner.search.types import LayoutChoice, NoPlanFits, SearchSpace
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["OptionBounds", "RankCosts", "chain_s", "divisors", "plan_over_divisors", "work_bound"]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (``[]`` for ``n < 1``)."""
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def chain_s(units: Sequence[Unit], costs: Sequence[UnitCost]) -> float:
    """Seconds of one microbatch's dependency chain: every LLM unit's forward and input gradient (where one is
    needed) plus those of the slowest encoder branch (a module and its ``<module>.<part>`` modules, e.g. its
    projector). Weight gradients are left out (a split backward takes them off the chain).

    Raises:
        ValueError: when the lengths differ.
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    branches: dict[str, float] = {}
    for unit, cost in zip(units, costs):
        step = cost.forward_s + (cost.input_grad_s if unit.needs_input_grad else 0.0)
        branch = unit.module.split(".")[0]
        branches[branch] = branches.get(branch, 0.0) + step
    llm = branches.pop(LLM_MODULE, 0.0)
    return llm + max(branches.values(), default=0.0)


def work_bound(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, microbatches: int,
               dps: Sequence[int]) -> float:
    """A lower bound (seconds) of the iteration time of every plan on ``devices`` pipeline devices (the devices over
    the TP degree) with per-rank unit costs ``costs`` and a DP degree in ``dps``: the larger of :func:`chain_s` and
    the least over ``dp`` of ``ceil(microbatches / dp) x max(work / p, heaviest unit's work)`` with
    ``p = min(devices // dp, len(units))`` ranks per replica (work: forward plus backward per microbatch,
    ``UnitCost.backward_s``). ``inf`` when no DP degree of ``dps`` fits ``devices``.

    Args:
        units: with consistent flags (``graph.consistent_units``); costs: per rank, one per unit.
        devices, microbatches: as ``search.plan_layout``; dps: the DP degrees the option's searches may take.

    Raises:
        ValueError: when the lengths differ.
    """
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    work = [c.forward_s + c.backward_s(u) for u, c in zip(units, costs)]
    total, heaviest = math.fsum(work), max(work, default=0.0)
    best = math.inf
    for dp in dps:
        if 1 <= dp <= devices:
            ranks = min(devices // dp, max(len(units), 1))
            best = min(best, -(-microbatches // dp) * max(total / ranks, heaviest))
    return max(best, chain_s(units, costs)) if best < math.inf else math.inf


Direct = Callable[[int, "LayoutChoice | None", float], "LayoutChoice | None"]
"""The search on ``n`` devices given the best plan so far (None: none) and a time to beat (seconds): the fastest plan
faster than it, None when none is; raises ``ValueError`` (``NoPlanFits``) when nothing fits and no plan was given."""


def plan_over_divisors(devices: int, direct: Direct, key: Callable[[LayoutChoice], tuple],
                       incumbent_first: Callable[[LayoutChoice], bool] | None = None) -> LayoutChoice:
    """The fastest of ``direct(devices, ...)`` and of the plan for each proper divisor of ``devices`` (computed the
    same way, memoised) run as it is on ``devices`` devices (module docstring); ``key`` orders choices (time first,
    then the tie rules); ties keep the divisor's plan (fewer devices).

    ``incumbent_first``: when given, ``devices`` is searched first (nothing to beat) and, when the test accepts its
    plan, each proper divisor ``d`` then only for a plan at most as fast as the best so far (ties to the fewest
    devices). The result is the same as from the smallest divisor up whenever ``direct``'s plan on ``d`` depends on
    the plan so far only through its time (``parallel`` accepts a plan without CPU offload when no offloaded plan on
    any divisor can beat it, offload being searched only where the divisors' plans are offloaded); the large device
    count's time prunes the small ones' searches (``work_bound`` grows as the devices shrink). Otherwise (nothing
    fits on ``devices``, or the test refuses) the divisors are searched from the smallest up.

    Returns:
        A ``LayoutChoice`` with ``devices`` set and its lower bound that of all ``devices``.

    Raises:
        ValueError: ``direct``'s error on ``devices`` when no plan fits on it or any divisor.
    """
    def placed(sub: LayoutChoice, n: int) -> LayoutChoice:
        return dataclasses.replace(sub, devices=n, lower_bound_s=sub.lower_bound_s * sub.devices / n)

    if incumbent_first is not None:
        try:
            top = direct(devices, None, math.inf)
        except ValueError:
            top = None
        if top is not None and incumbent_first(top):
            best, best_n = top, devices
            for d in divisors(devices)[:-1]:  # increasing: an equal key keeps the first (fewest devices)
                own = direct(d, best, math.nextafter(best.iteration_s, math.inf))
                if own is not None and (key(own) < key(best) or (key(own) == key(best) and best_n == devices)):
                    best, best_n = own, d
            return best if best_n == devices else placed(best, devices)

    memo: dict[int, LayoutChoice | None] = {}

    def solve(n: int) -> LayoutChoice | None:
        if n in memo:
            return memo[n]
        best: LayoutChoice | None = None
        for d in divisors(n)[:-1]:
            sub = solve(d)
            if sub is not None:
                here = placed(sub, n)
                if best is None or key(here) < key(best):
                    best = here
        try:
            own = direct(n, best, math.inf if best is None else best.iteration_s)
        except ValueError:
            if best is None and n == devices:
                raise
            own = None
        if own is not None and (best is None or key(own) < key(best)):
            best = own
        memo[n] = best
        return best

    found = solve(devices)
    if found is None:  # direct returned None without a time to beat: not a Direct
        raise NoPlanFits(f"no plan fits on {devices} devices")
    return found


class RankCosts:
    """``sharding.shard_costs`` of one job's units, memoised by the degrees and the keyword arguments (links,
    checkpoint overrides, expert dispatch): the per-rank costs of an option do not depend on the device count
    (only its links may, and they are part of the key), so the searches on every divisor share them."""

    def __init__(self, units: Sequence[Unit], whole: Sequence[UnitCost]) -> None:
        self.units, self.whole = units, whole
        self.memo: dict[tuple, list[UnitCost]] = {}

    def __call__(self, degrees: ParallelDegrees, **link: Any) -> list[UnitCost]:
        """The per-rank costs (a list the caller must not change)."""
        key = (degrees, tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                     for k, v in link.items() if v is not None)))  # None: the default
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = shard_costs(self.units, self.whole, degrees, **link)
        return found


class OptionBounds:
    """Per option (``ParallelDegrees``) of ``parallel.search_degrees`` on ``devices`` devices, lower bounds (seconds)
    of its plans, memoised: :meth:`flat` (FSDP2 without stages: every pipeline device a DP rank, its all-gathers
    charged: ``ceil(M / devices) x`` the per-rank work), :meth:`staged` (with stages, or any plan of an unsharded
    option: :func:`work_bound` on the unsharded per-rank costs) and :meth:`least` (the smaller).

    Args:
        units, whole: units with consistent flags and their whole-unit costs; devices, microbatches: the search's.
        space: its ``dp_degrees``; link: per option the keyword arguments of ``sharding.shard_costs`` (links and
            checkpoint overrides); per_rank: the memoised ``shard_costs`` of ``units`` (default: a fresh one).
    """

    def __init__(self, units: Sequence[Unit], whole: Sequence[UnitCost], devices: int, microbatches: int,
                 space: SearchSpace, link: Callable[[ParallelDegrees], dict[str, Any]],
                 per_rank: RankCosts | None = None) -> None:
        self.units, self.whole, self.devices, self.microbatches = units, whole, devices, microbatches
        self.space, self.link = space, link
        self.per_rank = per_rank if per_rank is not None else RankCosts(units, whole)
        self.memo: dict[tuple[str, ParallelDegrees], float] = {}

    def dps(self, degrees: ParallelDegrees, pipe: int) -> list[int]:
        """The DP degrees the option's staged (or unsharded) searches may take (``parallel._plan_parallel``)."""
        given = self.space.dp_degrees
        out = [d for d in (given if given is not None else range(1, pipe + 1)) if d <= pipe
               and (given is not None or pipe % d == 0)] or [1]
        if degrees.dp_shard > 1:
            out = [d for d in out if d % degrees.dp_shard == 0 and d < pipe and pipe % d == 0
                   and d <= self.microbatches]
        return out

    def flat(self, degrees: ParallelDegrees) -> float:
        key = ("flat", degrees)
        if key not in self.memo:
            pipe = self.devices // degrees.tp
            per_rank = self.per_rank(degrees, **self.link(degrees))
            work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(self.units, per_rank))
            self.memo[key] = -(-self.microbatches // pipe) * work
        return self.memo[key]

    def staged(self, degrees: ParallelDegrees) -> float:
        key = ("staged", degrees)
        if key not in self.memo:
            pipe = self.devices // degrees.tp
            whole = dataclasses.replace(degrees, dp_shard=1)  # pipelined_shard_costs: the unsharded per-rank costs
            per_rank = self.per_rank(whole, **dict(self.link(degrees), shard_link=None))
            self.memo[key] = work_bound(self.units, per_rank, pipe, self.microbatches, self.dps(degrees, pipe))
        return self.memo[key]

    def least(self, degrees: ParallelDegrees) -> float:
        return min(self.flat(degrees), self.staged(degrees)) if degrees.dp_shard > 1 else self.staged(degrees)
