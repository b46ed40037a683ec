"""Exact contiguous stage partitioning of a chain of pipeline units (min-max bottleneck under memory caps).

Problem (chains-on-chains partitioning; Bokhari 1988, Pinar & Aykanat, "Fast optimal load balancing
algorithms for 1D partitioning", JPDC 2004): split units ``0..n-1`` with work ``w_u`` into ``S``
non-empty contiguous stages minimising the bottleneck ``max_i sum_{u in stage i} w_u``, subject to each
stage's memory

    ``M_i = static_i + sum_{u in stage i} m_u + f_i * sum_{u in stage i} a_u <= memory_cap``

where ``m_u`` is the unit's memory independent of microbatches (parameters, gradients, optimizer state),
``a_u`` its saved activations per microbatch and ``f_i`` the microbatches stage ``i`` keeps in flight
(1F1B: ``S - i``, ``one_f_one_b_in_flight``).

Algorithm (exact): the optimal bottleneck ``B*`` is a contiguous sum ``P[b] - P[a]`` of the prefix sums
``P``, at least ``max(max_u w_u, sum w / S)``. We list the candidate sums in ``[that bound, hi)`` (``hi``
the bottleneck of a known feasible partition) and binary-search them with an exact feasibility probe.
The probe for a bound ``B`` computes, from the last stage backwards, the set ``Z_i`` of unit indices at
which stage ``i`` may start so that stages ``i..S-1`` can cover the rest: ``a`` is in ``Z_i`` iff the
smallest ``b`` in ``Z_{i+1}`` above ``a`` has ``[a, b)`` within ``B`` and stage ``i``'s memory cap
(segment sums are monotone, so the smallest such ``b`` is the best). ``Z_i`` is a union of few intervals
(a break only where a single unit does not fit stage ``i``'s memory), so a probe costs
``O(S (k + log n))`` for ``k`` intervals; memory caps that vary with the stage are handled exactly.

Ties: among partitions with bottleneck ``B*`` we return the one with lexicographically largest
boundaries (each stage, from the first, as long as the others still fit). Front-loading leaves slack at
the end of the pipeline, which shortens the 1F1B drain: with Oobleck's pipeline time
``T = sum w_i + (Nb - S + k* - 1) w_k* + sum_{i>=k*} w_i`` a bottleneck
stage early (small ``k*``) is never worse than one late.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Union

import numpy as np

from plait.planner.cost.analytic import (
    unit_activation_bytes,
    unit_static_bytes,
    unit_work,
)
from plait.planner.search.types import Machine, UnitPartition
from plait.planner.types import Unit, UnitCost

__all__ = [
    "one_f_one_b_in_flight",
    "partition_chain",
    "partition_units",
    "partition_work_ranges",
    "stage_loads",
    "stage_memory",
]

Ranges = tuple[tuple[int, int], ...]
InFlight = Union[Callable[[int, int], float], Sequence[float]]
Intervals = list[tuple[int, int]]


def one_f_one_b_in_flight(stage: int, num_stages: int) -> int:
    """Microbatches whose activations stage ``stage`` (0-based) holds at its peak in 1F1B: ``S - stage``."""
    return num_stages - stage


# --------------------------------------------------------------------------------------------------
# Input checking


def _floats(values: Sequence[float], name: str, length: int | None = None) -> list[float]:
    """Finite, non-negative floats of ``values``.

    Raises:
        ValueError: naming ``name`` and the bad index, or on a length mismatch.
    """
    out = [float(v) for v in values]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    for index, value in enumerate(out):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}[{index}] must be finite and >= 0, got {value}")
    return out


def _per_stage(value: float | Sequence[float] | InFlight, num_stages: int, name: str) -> list[float]:
    """A per-stage list from a number, a sequence of ``num_stages`` numbers or ``f(stage, num_stages)``."""
    if callable(value):
        return _floats([value(i, num_stages) for i in range(num_stages)], name)
    if isinstance(value, (int, float)):
        return _floats([value] * num_stages, name)
    return _floats(value, name, num_stages)


# --------------------------------------------------------------------------------------------------
# The chain: prefix sums and segment queries


class _Chain:
    """Prefix sums of work and, per stage, of memory; segment queries used by the probe.

    A segment ``[a, b)`` fits stage ``i`` under bound ``B`` when ``P[b] - P[a] <= B`` and
    ``C_i[b] - C_i[a] <= cap_i`` with ``C_i = prefix(m) + f_i prefix(a)`` and ``cap_i = cap - static_i``.
    """

    def __init__(self, work: list[float], num_stages: int, memory: list[float] | None,
                 activation: list[float] | None, in_flight: list[float], static: list[float],
                 cap: float | None) -> None:
        self.n, self.stages = len(work), num_stages
        self.work, self.max_work = work, max(work)
        self.prefix = [0.0, *accumulate(work)]
        self.mem_prefix: list[list[float]] | None = None
        self.caps: list[float] = []
        self.bad: list[list[int]] = [[] for _ in range(num_stages)]
        if cap is not None:
            self._init_memory(memory, activation, in_flight, static, cap)

    def _init_memory(self, memory, activation, in_flight, static, cap) -> None:
        zeros = np.zeros(self.n)
        static_prefix = np.concatenate([[0.0], np.cumsum(memory if memory is not None else zeros)])
        act_prefix = np.concatenate([[0.0], np.cumsum(activation if activation is not None else zeros)])
        factors = np.asarray(in_flight, dtype=float)
        table = static_prefix[None, :] + factors[:, None] * act_prefix[None, :]
        self.caps = [cap - s for s in static]
        self.mem_prefix = table.tolist()
        single = np.diff(table, axis=1) > np.asarray(self.caps)[:, None]
        self.bad = [np.flatnonzero(row).tolist() for row in single]

    def segment_memory(self, stage: int, start: int, end: int) -> float:
        """Memory of units ``[start, end)`` on ``stage`` without its static term (0 without a cap)."""
        if self.mem_prefix is None:
            return 0.0
        row = self.mem_prefix[stage]
        return row[end] - row[start]

    def min_start(self, stage: int, end: int, bound: float) -> int:
        """Smallest ``a`` with ``[a, end)`` fitting ``stage`` under ``bound`` (``end`` when none does)."""
        start = _first_within(self.prefix, end, bound)
        if self.mem_prefix is not None:
            start = max(start, _first_within(self.mem_prefix[stage], end, self.caps[stage]))
        return start

    def max_end(self, stage: int, start: int, bound: float) -> int:
        """Largest ``b`` with ``[start, b)`` fitting ``stage`` under ``bound`` (``start`` when none does)."""
        end = _last_within(self.prefix, start, bound)
        if self.mem_prefix is not None:
            end = min(end, _last_within(self.mem_prefix[stage], start, self.caps[stage]))
        return end

    def good_runs(self, stage: int, lo: int, hi: int) -> Intervals:
        """Maximal runs of units in ``[lo, hi]`` that fit ``stage``'s memory alone."""
        if lo > hi:
            return []
        bad = self.bad[stage]
        runs, start = [], lo
        for unit in bad[bisect_left(bad, lo):bisect_right(bad, hi)]:
            if unit > start:
                runs.append((start, unit - 1))
            start = unit + 1
        if start <= hi:
            runs.append((start, hi))
        return runs


def _first_within(prefix: list[float], end: int, bound: float) -> int:
    """Smallest ``a <= end`` with ``prefix[end] - prefix[a] <= bound``, exact in the same float arithmetic."""
    if bound == math.inf:
        return 0
    a = bisect_left(prefix, prefix[end] - bound, 0, end)
    while a < end and prefix[end] - prefix[a] > bound:
        a += 1
    while a > 0 and prefix[end] - prefix[a - 1] <= bound:
        a -= 1
    return a


def _last_within(prefix: list[float], start: int, bound: float) -> int:
    """Largest ``b >= start`` with ``prefix[b] - prefix[start] <= bound``."""
    last = len(prefix) - 1
    if bound == math.inf:
        return last
    b = max(bisect_right(prefix, prefix[start] + bound, start, last + 1) - 1, start)  # a negative bound: start
    while b > start and prefix[b] - prefix[start] > bound:
        b -= 1
    while b < last and prefix[b + 1] - prefix[start] <= bound:
        b += 1
    return b


# --------------------------------------------------------------------------------------------------
# Probe and construction


def _merge(pieces: Intervals, floor: int) -> Intervals:
    """Sorted disjoint pieces clipped to ``>= floor``, adjacent ones joined."""
    merged: Intervals = []
    for lo, hi in pieces:
        lo = max(lo, floor)
        if lo > hi:
            continue
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


def _probe(chain: _Chain, bound: float) -> list[Intervals] | None:
    """Co-reachable start sets ``Z_0..Z_S`` under ``bound`` (see the module docstring), or None when no
    partition has every stage within ``bound`` and its memory cap."""
    if chain.max_work > bound:
        return None
    sets: list[Intervals] = [[] for _ in range(chain.stages)] + [[(chain.n, chain.n)]]
    for stage in range(chain.stages - 1, -1, -1):
        if len(sets[stage + 1]) == 1 and not chain.bad[stage]:  # fast path: one interval, no misfits
            lo, hi = sets[stage + 1][0]
            start = max(min(chain.min_start(stage, lo, bound), lo), stage)
            if start > hi - 1:
                return None
            sets[stage] = [(start, hi - 1)]
            continue
        pieces: Intervals = []
        previous: tuple[int, int] | None = None
        for lo, hi in sets[stage + 1]:
            floor = 0
            if previous is not None:
                pieces += chain.good_runs(stage, previous[0], previous[1] - 1)
                floor = previous[1]
            pieces.append((max(chain.min_start(stage, lo, bound), floor), lo - 1))
            previous = (lo, hi)
        pieces += chain.good_runs(stage, previous[0], previous[1] - 1)
        sets[stage] = _merge(pieces, stage)
        if not sets[stage]:
            return None
    return sets if sets[0][0][0] == 0 else None


def _largest_at_most(intervals: Intervals, limit: int) -> int:
    """Largest element of the interval union that is ``<= limit`` (-1 if none)."""
    index = bisect_right(intervals, (limit, math.inf)) - 1
    return -1 if index < 0 else min(intervals[index][1], limit)


def _construct(chain: _Chain, sets: list[Intervals], bound: float) -> Ranges:
    """Lexicographically largest boundaries: each stage ends as late as ``bound``, its memory cap and
    the feasibility of the remaining stages (``sets``) allow."""
    ranges, start = [], 0
    for stage in range(chain.stages):
        end = _largest_at_most(sets[stage + 1], chain.max_end(stage, start, bound))
        if end <= start:  # cannot happen when start is in sets[stage]
            raise RuntimeError(f"partition construction failed at stage {stage}")
        ranges.append((start, end))
        start = end
    return tuple(ranges)


def _candidates(prefix: list[float], lo: float, hi: float) -> list[float]:
    """Sorted distinct contiguous sums ``P[b] - P[a]`` (``a < b``) in ``[lo, hi)``."""
    p = np.asarray(prefix)
    n = len(p) - 1
    starts = np.arange(n)
    left = np.maximum(np.searchsorted(p, p[:-1] + lo, "left") - 1, starts + 1)
    right = np.minimum(np.searchsorted(p, p[:-1] + hi, "left") + 1, n + 1)
    counts = np.maximum(right - left, 0)
    total = int(counts.sum())
    if total == 0:
        return []
    rows = np.repeat(starts, counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    values = p[np.repeat(left, counts) + offsets] - p[rows]
    return np.unique(values[(values >= lo) & (values < hi)]).tolist()


def _bottleneck(chain: _Chain, ranges: Ranges) -> float:
    # A one-unit stage's prefix difference can round below the unit's own work, which _probe compares
    # against directly: the bottleneck is never below the largest unit.
    return max(chain.max_work, max(chain.prefix[b] - chain.prefix[a] for a, b in ranges))


def _search(chain: _Chain, names: Sequence[str] | None) -> Ranges:
    """Exact minimum bottleneck partition (binary search over candidate sums)."""
    total, largest = chain.prefix[-1], chain.max_work
    lower = max(largest, total / chain.stages)
    bound = lower + largest  # always feasible without memory caps
    sets = _probe(chain, bound)
    if sets is None:
        bound, sets = math.inf, _probe(chain, math.inf)
        if sets is None:
            raise ValueError(_memory_diagnosis(chain, names))
    hi = _bottleneck(chain, _construct(chain, sets, bound))
    candidates = _candidates(chain.prefix, lower * (1 - 1e-9), hi)
    lo_index, hi_index, best = 0, len(candidates), None
    while lo_index < hi_index:
        mid = (lo_index + hi_index) // 2
        probe = _probe(chain, candidates[mid])
        if probe is None:
            lo_index = mid + 1
        else:
            hi_index, best, hi = mid, probe, candidates[mid]
    return _construct(chain, best if best is not None else _probe(chain, hi), hi)


def _name(names: Sequence[str] | None, unit: int) -> str:
    return f"unit {unit} ({names[unit]!r})" if names is not None else f"unit {unit}"


def _memory_diagnosis(chain: _Chain, names: Sequence[str] | None) -> str:
    """Why no partition fits the memory caps: a unit that fits no stage alone, else how far packing each
    stage as full as memory allows gets."""
    misfits = [set(bad) for bad in chain.bad]
    for unit in range(chain.n):
        if all(unit in misfit for misfit in misfits):
            stage = min(range(chain.stages), key=lambda i: chain.segment_memory(i, unit, unit + 1) - chain.caps[i])
            need = chain.segment_memory(stage, unit, unit + 1)
            return (f"memory_cap too small: {_name(names, unit)} alone needs {need:.4g} bytes on every stage "
                    f"(least on stage {stage}, which has {chain.caps[stage]:.4g} bytes left after its static memory)")
    start = 0
    for stage in range(chain.stages):
        end = chain.max_end(stage, start, math.inf)
        if end == start:
            return (f"memory_cap too small: packing stages 0..{stage - 1} as full as memory allows, "
                    f"stage {stage} cannot hold {_name(names, start)}")
        start = end
        if start == chain.n:
            break
    if start < chain.n:
        return (f"memory_cap too small: {chain.stages} stages packed as full as memory allows hold only units "
                f"0..{start - 1}; {_name(names, start)} to unit {chain.n - 1} do not fit")
    return ("memory_cap too small: no split into non-empty stages fits (some stage cannot hold any of the "
            "units that would remain for it)")


# --------------------------------------------------------------------------------------------------
# Public API


def partition_chain(
    work: Sequence[float],
    num_stages: int,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    static_memory_per_stage: float | Sequence[float] = 0.0,
    activation_memory: Sequence[float] | None = None,
    in_flight: InFlight | None = None,
    names: Sequence[str] | None = None,
) -> Ranges:
    """Contiguous partition of units into ``num_stages`` non-empty stages minimising the largest stage work.

    Args:
        work: per-unit work (any unit, e.g. seconds of forward + backward per microbatch), finite, >= 0.
        num_stages: ``S``, 1 <= S <= len(work).
        memory: per-unit memory that does not scale with microbatches in flight (bytes: parameters,
            gradients, optimizer state); ignored without ``memory_cap``.
        memory_cap: per-stage memory limit (bytes); None for no memory constraint.
        static_memory_per_stage: bytes every stage holds besides its units (runtime, buffers): one number
            or one per stage.
        activation_memory: per-unit saved activations per microbatch in flight (bytes).
        in_flight: microbatches in flight per stage, a sequence of ``S`` numbers or ``f(stage, S)``;
            default 1F1B ``S - stage``. Stage ``i`` memory is
            ``static_i + sum(memory) + in_flight_i * sum(activation_memory)`` over its units.
        names: unit names for error messages.

    Returns:
        ``((start, end), ...)``, one half-open unit range per stage, covering ``0..n`` in order. Exact
        minimum bottleneck; ties broken towards the lexicographically largest boundaries (see module
        docstring).

    Raises:
        ValueError: on bad input (named), ``num_stages`` outside ``1..len(work)``, or when no partition fits
            the memory cap (the message names the unit or stage that cannot fit).
    """
    work_list = _floats(work, "work")
    n = len(work_list)
    if n == 0:
        raise ValueError("work is empty: nothing to partition")
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages must be in 1..{n} (number of units), got {num_stages}")
    if names is not None and len(names) != n:
        raise ValueError(f"names has {len(names)} entries, expected {n}")
    cap = None
    if memory_cap is not None:
        if not math.isfinite(memory_cap) or memory_cap < 0:
            raise ValueError(f"memory_cap must be finite and >= 0, got {memory_cap}")
        cap = float(memory_cap)
    chain = _Chain(
        work_list, num_stages,
        None if memory is None else _floats(memory, "memory", n),
        None if activation_memory is None else _floats(activation_memory, "activation_memory", n),
        _per_stage(one_f_one_b_in_flight if in_flight is None else in_flight, num_stages, "in_flight"),
        _per_stage(static_memory_per_stage, num_stages, "static_memory_per_stage"), cap,
    )
    return _search(chain, names)


def _check_ranges(ranges: Ranges, n: int) -> None:
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise ValueError(f"ranges must be contiguous, non-empty and start at 0, got {ranges}")
        expected = end
    if expected != n:
        raise ValueError(f"ranges cover units 0..{expected}, expected 0..{n}")


def stage_loads(work: Sequence[float], ranges: Ranges) -> tuple[float, ...]:
    """Work of each stage: ``sum(work[start:end])`` per range (same units as ``work``).

    Raises:
        ValueError: when the ranges do not tile ``work``.
    """
    _check_ranges(ranges, len(work))
    return tuple(math.fsum(work[a:b]) for a, b in ranges)


def stage_memory(
    ranges: Ranges,
    memory: Sequence[float] | None = None,
    activation_memory: Sequence[float] | None = None,
    in_flight: InFlight | None = None,
    static_memory_per_stage: float | Sequence[float] = 0.0,
) -> tuple[float, ...]:
    """Memory (bytes) of each stage: ``static_i + sum(memory) + in_flight_i * sum(activation_memory)``
    over its units (defaults as ``partition_chain``).

    Raises:
        ValueError: on mismatched lengths or ranges that do not tile the units.
    """
    n = ranges[-1][1] if ranges else 0
    _check_ranges(ranges, n)
    mem = _floats(memory, "memory", n) if memory is not None else [0.0] * n
    act = _floats(activation_memory, "activation_memory", n) if activation_memory is not None else [0.0] * n
    factors = _per_stage(one_f_one_b_in_flight if in_flight is None else in_flight, len(ranges), "in_flight")
    static = _per_stage(static_memory_per_stage, len(ranges), "static_memory_per_stage")
    return tuple(static[i] + math.fsum(mem[a:b]) + factors[i] * math.fsum(act[a:b]) for i, (a, b) in enumerate(ranges))


def partition_work_ranges(units: Sequence[Unit], ranges: Ranges) -> tuple[tuple[str, ...], ...]:
    """Unit names of each stage: ``ranges`` mapped onto ``units``.

    Raises:
        ValueError: when the ranges do not tile ``units``.
    """
    _check_ranges(ranges, len(units))
    return tuple(tuple(u.name for u in units[a:b]) for a, b in ranges)


def partition_units(
    units: Sequence[Unit],
    costs: Sequence[UnitCost],
    num_stages: int,
    *,
    machine: Machine = Machine(),
    frozen_aware: bool = True,
    in_flight: InFlight | None = None,
    static_memory_per_stage: float | Sequence[float] = 0.0,
) -> UnitPartition:
    """Partition pipeline units by their frozen-aware work and memory (``cost_model.unit_work``,
    ``unit_static_bytes``, ``unit_activation_bytes``) with ``partition_chain``.

    With ``frozen_aware=False`` every unit's work is ``f + dX + dW`` (the frozen-unaware baseline
    Cornstarch compares against) and the reported ``stage_work_s`` uses that model too. Memory always follows
    the units' flags: it is the hard limit the runtime really meets (frozen units hold no optimizer state
    whatever the planner believes about their time).

    Args:
        units, costs: the chain in execution order and one ``UnitCost`` per unit.
        num_stages: pipeline stages ``S``.
        machine: its ``memory_cap`` (bytes per stage, e.g. ``DeviceSpec.memory_bytes``; None for none), ``dtype``
            and ``optimizer`` (per-parameter gradient / optimizer bytes); links and overheads unused.
        in_flight, static_memory_per_stage: as ``partition_chain`` (default 1F1B ``S - stage``).

    Raises:
        ValueError: as ``partition_chain``, or when ``units`` and ``costs`` differ in length.
    """
    work = unit_work(units, costs, frozen_aware)
    memory = [unit_static_bytes(u, c, machine.dtype, machine.optimizer) for u, c in zip(units, costs)]
    activation = [unit_activation_bytes(u, c) for u, c in zip(units, costs)]
    ranges = partition_chain(work, num_stages, memory, machine.memory_cap, static_memory_per_stage, activation,
                             in_flight, [u.name for u in units])
    loads = stage_loads(work, ranges)
    return UnitPartition(
        ranges=ranges, stage_units=partition_work_ranges(units, ranges), stage_work_s=loads,
        stage_memory_bytes=stage_memory(ranges, memory, activation, in_flight, static_memory_per_stage),
        bottleneck_s=max(loads), frozen_aware=frozen_aware,
    )
