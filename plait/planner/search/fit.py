"""The least per-device memory a plan needs: what ``NoPlanFits`` reports when no plan fits the memory cap.

:func:`least_need` is a lower bound, over the options a search tried, of the fullest device of any plan under
them (``sharding.rank_memory`` with one microbatch's activations in flight, and FSDP2 CPU offload's device bytes,
``offload.offload_cost``); :func:`least_need_of` packs it as ``request.LeastNeed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.planner.cost.types import HostSpec, OptimizerSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.offload import offload_cost
from plait.planner.search.types import LeastNeed
from plait.planner.cost.sharding import rank_memory
from plait.planner.types import Unit, UnitCost

__all__ = ["MemoryNeed", "least_need", "least_need_of"]


def least_need(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, options: Sequence[ParallelDegrees], *,
               dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
               checkpoint_overrides: dict[str, str] | None = None,
               host: HostSpec | None = None) -> tuple[float, ParallelDegrees]:
    """The least per-device bytes any of ``options`` needs on ``devices`` devices, and that option: a lower bound
    of its fullest device (one microbatch's activations in flight). Pipeline ranks share the units: at least the
    largest unit, and at least an equal share of all of them, over the ``devices / (tp x ep)`` pipeline ranks with
    ``dp_shard = 1`` (``rank_memory``; EP takes its ``ep`` ranks from a stage's DP ranks) and over at most ``devices
    / (tp x dp_shard)`` ranks of FSDP2-sharded stages with ``dp_shard > 1`` (``rank_memory(pipelined=True)``; not
    with EP, which ``plan_parallel`` does not search under FSDP2 with stages); FSDP2 without stages (every rank a DP
    rank) holds every unit on one rank (``rank_memory``); a sharded option needs the least of them. With ``host`` a
    sharded option without EP may also offload to the host as ``plan_parallel`` searches it
    (``offload.offload_cost``: its device bytes, when its host bytes fit ``host.memory_bytes``).

    Raises:
        ValueError: on no options or ``devices`` < 1.
    """
    if not options or devices < 1:
        raise ValueError(f"least_need needs options and devices >= 1, got {len(options)} options, {devices} devices")
    need = MemoryNeed(units, costs, dtype=dtype, optimizer=optimizer, checkpoint_overrides=checkpoint_overrides,
                      host=host)
    return min(((need(o, devices), o) for o in options), key=lambda pair: (pair[0], pair[1].tp, pair[1].dp_shard))


class MemoryNeed:
    """:func:`least_need` of one option on a device count, ``need(degrees, devices)`` (bytes), with the parts that do
    not depend on the device count (each option's whole and largest unit's ``rank_memory``, its flat and offloaded
    bytes) memoised, so the searches on every divisor of a device count share them. Arguments as
    :func:`least_need`'s."""

    def __init__(self, units: Sequence[Unit], costs: Sequence[UnitCost], *, dtype: Any = "bfloat16",
                 optimizer: OptimizerSpec = OptimizerSpec(), checkpoint_overrides: dict[str, str] | None = None,
                 host: HostSpec | None = None) -> None:
        self.units, self.costs, self.host = consistent_units(units), costs, host
        self.kw = dict(dtype=dtype, optimizer=optimizer, checkpoint_overrides=checkpoint_overrides)
        self.memo: dict[tuple, Any] = {}

    def _parts(self, degrees: ParallelDegrees, pipelined: bool) -> tuple[float, float]:
        key = ("shared", degrees, pipelined)
        if key not in self.memo:
            units, costs, kw = self.units, self.costs, self.kw
            whole = rank_memory(units, costs, degrees, pipelined=pipelined, **kw).total
            largest = max(rank_memory([u], [c], degrees, pipelined=pipelined, **kw).total
                          for u, c in zip(units, costs))
            self.memo[key] = (whole, largest)
        return self.memo[key]

    def _shared(self, degrees: ParallelDegrees, ranks: int, pipelined: bool) -> float:
        whole, largest = self._parts(degrees, pipelined)
        return max(largest, whole / ranks)

    def _flat(self, degrees: ParallelDegrees) -> float:
        key = ("flat", degrees)
        if key not in self.memo:
            least = rank_memory(self.units, self.costs, degrees, **self.kw).total
            host = self.host
            if host is not None and degrees.ep == 1:  # EP is not searched with CPU offload
                offload = offload_cost(self.units, self.costs, degrees, host, **self.kw)
                if offload.host_bytes <= host.memory_bytes:
                    least = min(least, offload.device_bytes)
            self.memo[key] = least
        return self.memo[key]

    def __call__(self, degrees: ParallelDegrees, devices: int) -> float:
        if degrees.dp_shard == 1:  # EP splits the DP ranks of a stage: at most devices / (tp ep) stages
            return self._shared(degrees, devices // (degrees.tp * degrees.ep), False)
        stages = devices // (degrees.tp * degrees.dp_shard)
        least = self._flat(degrees)  # with offload's device bytes when it fits the host
        if stages > 1 and degrees.ep == 1:
            least = min(least, self._shared(degrees, stages, True))
        return least


def least_need_of(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, options: Sequence[ParallelDegrees],
                  *, dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
                  checkpoint_overrides: dict[str, str] | None = None, host: HostSpec | None = None) -> LeastNeed:
    """:func:`least_need` as a ``LeastNeed``, ``offloaded`` when CPU offload on ``host`` lowers it (the bound
    without ``host`` is higher).

    Raises:
        ValueError: as :func:`least_need`.
    """
    kw = dict(dtype=dtype, optimizer=optimizer, checkpoint_overrides=checkpoint_overrides)
    need, degrees = least_need(units, costs, devices, options, host=host, **kw)
    offloaded = host is not None and need < least_need(units, costs, devices, options, **kw)[0]
    return LeastNeed(need, degrees, offloaded)
