"""Why ``plait plan`` found no plan that fits the memory cap, in a few lines a user can act on.

The search (``planner.search_parallel.plan_parallel``) reports every option it tried with its internal reason;
:func:`explain_no_fit` replaces that with the cap in GiB, the least per-device memory any option searched needs
(:func:`least_need`, a lower bound from ``planner.sharding.rank_memory``) and what to change: for ``plait plan``
(:func:`no_fit_message`) and for ``parallel.plan = "auto"`` (``commands.train.resolve_auto``).
:func:`search_plan` is ``plait plan``'s search on its setup with that message in place of the search's
(``plan_command`` and ``commands.plan.compare.considered_plans``); :func:`is_no_fit` tells that error from the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.planner.cost_model import OptimizerSpec
from plait.planner.graph import consistent_units
from plait.planner.offload import HostSpec, offload_cost
from plait.planner.recompute import CHECKPOINT_POLICIES
from plait.planner.report import format_bytes
from plait.planner.search import LayoutChoice
from plait.planner.search_parallel import degree_options, plan_parallel
from plait.planner.sharding import ParallelDegrees, rank_memory
from plait.planner.types import Unit, UnitCost

__all__ = ["explain_no_fit", "is_no_fit", "least_need", "no_fit_message", "search_plan"]

def least_need(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, options: Sequence[ParallelDegrees], *,
               dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
               checkpoint_overrides: dict[str, str] | None = None,
               host: HostSpec | None = None) -> tuple[float, ParallelDegrees]:
    """The least per-device bytes any of ``options`` needs on ``devices`` devices, and that option: a lower bound
    of its fullest device (one microbatch's activations in flight). Pipeline ranks share the units: at least the
    largest unit, and at least an equal share of all of them, over the ``devices / tp`` ranks with ``dp_shard = 1``
    (``rank_memory``) and over at most ``devices / (tp x dp_shard)`` ranks of FSDP2-sharded stages with
    ``dp_shard > 1`` (``rank_memory(pipelined=True)``); FSDP2 without stages (every rank a DP rank) holds every
    unit on one rank (``rank_memory``); a sharded option needs the least of them. With ``host`` a sharded option may
    also offload to the host as ``plait plan`` searches it (``offload.offload_cost``: its device bytes, when its
    host bytes fit ``host.memory_bytes``).

    Raises:
        ValueError: on no options or ``devices`` < 1.
    """
    if not options or devices < 1:
        raise ValueError(f"least_need needs options and devices >= 1, got {len(options)} options, {devices} devices")
    units = consistent_units(units)
    kw = dict(dtype=dtype, optimizer=optimizer, checkpoint_overrides=checkpoint_overrides)

    def shared(degrees: ParallelDegrees, ranks: int, pipelined: bool) -> float:
        whole = rank_memory(units, costs, degrees, pipelined=pipelined, **kw).total
        largest = max(rank_memory([u], [c], degrees, pipelined=pipelined, **kw).total for u, c in zip(units, costs))
        return max(largest, whole / ranks)

    def need(degrees: ParallelDegrees) -> float:
        if degrees.dp_shard == 1:
            return shared(degrees, devices // degrees.tp, False)
        flat = rank_memory(units, costs, degrees, **kw).total
        stages = devices // (degrees.tp * degrees.dp_shard)
        least = min(flat, shared(degrees, stages, True)) if stages > 1 else flat
        if host is not None:
            offload = offload_cost(units, costs, degrees, host, **kw)
            if offload.host_bytes <= host.memory_bytes:
                least = min(least, offload.device_bytes)
        return least

    return min(((need(o), o) for o in options), key=lambda pair: (pair[0], pair[1].tp, pair[1].dp_shard))


def explain_no_fit(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, cap: float, where: str,
                   hints: str, *, dtype: Any = "bfloat16", base_checkpointing: str = "none",
                   checkpoint_overrides: dict[str, str] | None = None) -> str:
    """One sentence: no plan fits in ``cap`` bytes per device (``where`` says where the cap comes from), the least
    need over the options searched (:func:`least_need` over ``degree_options``: TP up to 8, dp_shard up to
    ``devices``, activation checkpointing unless the job fixed its policy, and FSDP2 CPU offload with the default
    ``offload.HostSpec``, as ``plan_parallel`` searches it) and ``hints``, what to change."""
    policies = CHECKPOINT_POLICIES if base_checkpointing == "none" else (base_checkpointing,)
    kw = dict(dtype=dtype, checkpoint_overrides=checkpoint_overrides)
    options = degree_options(devices, None, None, policies)
    need, best = least_need(units, costs, devices, options, host=HostSpec(), **kw)
    offloaded = need < least_need(units, costs, devices, options, **kw)[0]
    return (f"no plan fits in {format_bytes(cap)} per device ({where}): the least any option searched needs is about "
            f"{format_bytes(need)} per device (tp {best.tp}, dp_shard {best.dp_shard}, activation checkpointing "
            f"{best.checkpointing}{', CPU offload' if offloaded else ''}; tp up to {min(8, devices)}, dp_shard up "
            f"to {devices} and CPU offload were searched). To fit: {hints}")


def no_fit_message(setup: Any, devices: int, memory_fraction: float) -> str:
    """The readable error of a ``plait plan`` that found no fitting plan (``setup``: ``plan.PlanSetup``): the cap,
    the least need over the options searched and what to change (:func:`explain_no_fit`)."""
    where = f"{memory_fraction:g} of the {format_bytes(setup.spec.memory_bytes)} of a {setup.spec.name}, --memory-fraction"
    hints = ("more devices (--devices), a larger --memory-fraction or a device with more memory (--device), or freeze "
             "more of the model")
    return explain_no_fit(setup.inputs.units, setup.inputs.costs, devices, setup.search["memory_cap"], where, hints,
                          dtype=setup.search.get("dtype", "bfloat16"),
                          base_checkpointing=setup.degrees.get("base_checkpointing", "none"),
                          checkpoint_overrides=setup.degrees.get("checkpoint_overrides"))


def is_no_fit(exc: ValueError) -> bool:
    """True when ``exc`` is the layout search's "nothing fits the memory cap" error (``plan_parallel``,
    ``plan_layout``), not a bad argument."""
    return str(exc).startswith(("no plan fits", "no layout fits"))


def search_plan(setup: Any, devices: int, memory_fraction: float, **options: Any) -> LayoutChoice:
    """``plait plan``'s search on ``setup`` (``plan.PlanSetup``): ``search_parallel.plan_parallel`` on its units,
    costs, memory cap, links, dtype, overheads and checkpointing, with ``options`` (further ``plan_parallel``
    keyword arguments) for ``devices`` devices.

    Raises:
        ValueError: :func:`no_fit_message` (one sentence) when no plan fits; the search's own error otherwise.
    """
    inputs = setup.inputs
    try:
        return plan_parallel(inputs.units, inputs.costs, devices, microbatches=inputs.microbatches, **setup.search,
                             **setup.degrees, **options)
    except ValueError as exc:
        if not is_no_fit(exc):
            raise
        raise ValueError(no_fit_message(setup, devices, memory_fraction)) from None
