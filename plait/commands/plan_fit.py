"""Why ``plait plan`` found no plan that fits the memory cap, in a few lines a user can act on.

The search (``planner.search_parallel.plan_parallel``) reports every option it tried with its internal reason;
:func:`explain_no_fit` replaces that with the cap in GiB, the least per-device memory any option searched needs
(:func:`least_need`, a lower bound from ``planner.sharding.rank_memory``) and what to change: for ``plait plan``
(:func:`no_fit_message`) and for ``parallel.plan = "auto"`` (``commands.train.resolve_auto``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.planner.cost_model import OptimizerSpec
from plait.planner.graph import consistent_units
from plait.planner.recompute import CHECKPOINT_POLICIES
from plait.planner.search_parallel import degree_options
from plait.planner.sharding import ParallelDegrees, rank_memory
from plait.planner.types import Unit, UnitCost

__all__ = ["explain_no_fit", "least_need", "no_fit_message"]

GIB = 2**30


def _size(num_bytes: float) -> str:
    """``"12.34 GiB"``, or MiB below one GiB."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def least_need(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, options: Sequence[ParallelDegrees], *,
               dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
               checkpoint_overrides: dict[str, str] | None = None) -> tuple[float, ParallelDegrees]:
    """The least per-device bytes any of ``options`` needs on ``devices`` devices, and that option: a lower bound
    of its fullest device (one microbatch's activations in flight). With ``dp_shard > 1`` (no pipeline, as the
    runtime) one rank holds every unit (``rank_memory``); with ``dp_shard = 1`` the ``devices / tp`` pipeline ranks
    share the units: at least the largest unit, and at least an equal share of all of them.

    Raises:
        ValueError: on no options or ``devices`` < 1.
    """
    if not options or devices < 1:
        raise ValueError(f"least_need needs options and devices >= 1, got {len(options)} options, {devices} devices")
    units = consistent_units(units)
    kw = dict(dtype=dtype, optimizer=optimizer, checkpoint_overrides=checkpoint_overrides)

    def need(degrees: ParallelDegrees) -> float:
        whole = rank_memory(units, costs, degrees, **kw).total
        if degrees.dp_shard > 1:
            return whole
        largest = max(rank_memory([u], [c], degrees, **kw).total for u, c in zip(units, costs))
        return max(largest, whole / (devices // degrees.tp))

    return min(((need(o), o) for o in options), key=lambda pair: (pair[0], pair[1].tp, pair[1].dp_shard))


def explain_no_fit(units: Sequence[Unit], costs: Sequence[UnitCost], devices: int, cap: float, where: str,
                   hints: str, *, dtype: Any = "bfloat16", base_checkpointing: str = "none",
                   checkpoint_overrides: dict[str, str] | None = None) -> str:
    """One sentence: no plan fits in ``cap`` bytes per device (``where`` says where the cap comes from), the least
    need over the options searched (:func:`least_need` over ``degree_options``: TP up to 8, dp_shard up to
    ``devices``, and activation checkpointing unless the job fixed its policy) and ``hints``, what to change."""
    policies = CHECKPOINT_POLICIES if base_checkpointing == "none" else (base_checkpointing,)
    need, best = least_need(units, costs, devices, degree_options(devices, None, None, policies), dtype=dtype,
                            checkpoint_overrides=checkpoint_overrides)
    return (f"no plan fits in {_size(cap)} per device ({where}): the least any option searched needs is about "
            f"{_size(need)} per device (tp {best.tp}, dp_shard {best.dp_shard}, activation checkpointing "
            f"{best.checkpointing}; tp up to {min(8, devices)} and dp_shard up to {devices} were searched). To fit: "
            f"{hints}")


def no_fit_message(setup: Any, devices: int, memory_fraction: float) -> str:
    """The readable error of a ``plait plan`` that found no fitting plan (``setup``: ``plan.PlanSetup``): the cap,
    the least need over the options searched and what to change (:func:`explain_no_fit`)."""
    where = f"{memory_fraction:g} of the {_size(setup.spec.memory_bytes)} of a {setup.spec.name}, --memory-fraction"
    hints = ("more devices (--devices), a larger --memory-fraction or a device with more memory (--device), or freeze "
             "more of the model")
    return explain_no_fit(setup.inputs.units, setup.inputs.costs, devices, setup.search["memory_cap"], where, hints,
                          dtype=setup.search.get("dtype", "bfloat16"),
                          base_checkpointing=setup.degrees.get("base_checkpointing", "none"),
                          checkpoint_overrides=setup.degrees.get("checkpoint_overrides"))
