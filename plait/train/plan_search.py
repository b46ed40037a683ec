"""Why ``plait plan`` found no plan that fits the memory cap, in a few lines a user can act on.

The search (``planner.search_parallel.plan_parallel``) raises ``planner.request.NoPlanFits`` listing every option it
tried with its internal reason, and the least per-device memory any of them needs (``planner.fit.least_need``).
:func:`explain_no_fit` replaces that with the cap in GiB, the least need and what to change: for ``plait plan``
(:func:`no_fit_message`) and for ``parallel.plan = "auto"`` (``commands.train.resolve_auto``).
:func:`search_plan` is ``plait plan``'s search on its setup with that message in place of the search's
(``plan_command`` and ``commands.plan.compare.considered_plans``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from plait.models.plan_inputs import build_plan_inputs, device_spec
from plait.planner.cost.experts import ExpertLayer, expert_layers, searched_ep_degrees
from plait.planner.cost.types import DeviceSpec
from plait.planner.types import Unit
from plait.planner.report import format_bytes
from plait.planner.search.types import LayoutChoice, NoPlanFits
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import LayoutSearch, plan_parallel

__all__ = ["explain_no_fit", "job_expert_layers", "no_fit_message", "search_plan"]


def explain_no_fit(error: NoPlanFits, devices: int, cap: float, where: str, hints: str, max_ep: int = 1) -> str:
    """One sentence: no plan fits in ``cap`` bytes per device on ``devices`` devices (``where`` says where the cap
    comes from), the least need over the options searched (``error.least``: TP up to 8, dp_shard up to ``devices``,
    activation checkpointing unless the job fixed its policy, EP up to ``max_ep`` for a MoE LLM, and FSDP2 CPU
    offload, as ``plan_parallel`` searches them; the least option's EP degree named when above 1) and ``hints``,
    what to change. Without a least need: the cap, ``error``'s message and ``hints``."""
    least = error.least
    if least is None:
        return f"no plan fits in {format_bytes(cap)} per device ({where}): {error}. To fit: {hints}"
    best = least.degrees
    ep = f", ep {best.ep}" if best.ep > 1 else ""
    searched_ep = f", ep up to {max_ep}" if max_ep > 1 else ""
    return (f"no plan fits in {format_bytes(cap)} per device ({where}): the least any option searched needs is about "
            f"{format_bytes(least.bytes)} per device (tp {best.tp}, dp_shard {best.dp_shard}{ep}, activation "
            f"checkpointing {best.checkpointing}{', CPU offload' if least.offloaded else ''}; tp up to "
            f"{min(8, devices)}, dp_shard up to {devices}{searched_ep} and CPU offload were searched). To fit: {hints}")


def no_fit_message(error: NoPlanFits, setup: Any, devices: int, memory_fraction: float, max_ep: int = 1) -> str:
    """The readable error of a ``plait plan`` that found no fitting plan (``setup``: ``plan.PlanSetup``): the cap,
    the least need over the options searched and what to change (:func:`explain_no_fit`)."""
    where = f"{memory_fraction:g} of the {format_bytes(setup.spec.memory_bytes)} of a {setup.spec.name}, --memory-fraction"
    hints = ("more devices (--devices), a larger --memory-fraction or a device with more memory (--device), or freeze "
             "more of the model")
    return explain_no_fit(error, devices, setup.machine.memory_cap, where, hints, max_ep)


def search_plan(setup: Any, devices: int, memory_fraction: float, layout_search: LayoutSearch = plan_layout,
                **space: Any) -> LayoutChoice:
    """``plait plan``'s search on ``setup`` (``plan.PlanSetup``): ``search_parallel.plan_parallel`` on its units,
    costs and machine (memory cap, links, dtype, overheads) with its search space (the job's checkpointing) changed
    by ``space`` (``SearchSpace`` fields) for ``devices`` devices with ``layout_search`` (``parallel.LayoutSearch``:
    ``plan_layout``, or ``auto_layout.plan_filling_layout`` for plans using every device); a MoE LLM's layers (``cost.experts.expert_layers``,
    with the measured profile's ``setup.router_load``, else uniform routing) let it search expert parallelism.

    Raises:
        ValueError: :func:`no_fit_message` (one sentence) when no plan fits; the search's own error otherwise.
    """
    inputs = setup.inputs
    experts = expert_layers(inputs.units, inputs.model_configs, inputs.shapes["llm"], setup.spec, inputs.dtype,
                            getattr(setup, "router_load", None))
    try:
        return plan_parallel(inputs.units, inputs.costs, devices, microbatches=inputs.microbatches,
                             machine=setup.machine, space=dataclasses.replace(setup.space, **space), experts=experts,
                             layout_search=layout_search)
    except NoPlanFits as exc:
        searched = searched_ep_degrees(space.get("ep_degrees", setup.space.ep_degrees), experts, devices)
        max_ep = max(e for e in searched if e <= max(inputs.microbatches, 1) or e == 1)  # a microbatch per DP rank
        raise ValueError(no_fit_message(exc, setup, devices, memory_fraction, max_ep)) from None


def job_expert_layers(cfg: Any, units: Sequence[Unit], device: str | DeviceSpec, dtype: Any,
                      router_load: Mapping[str, Sequence[float]] | None = None) -> tuple[ExpertLayer, ...]:
    """The MoE layers of job ``cfg``'s LLM among ``units`` (e.g. a measured profile's) for a search on ``device``
    (preset name or ``DeviceSpec``): ``cost.experts.expert_layers`` with the model configs and LLM microbatch shape
    ``plait plan`` derives (``models.plan_inputs.build_plan_inputs``) and the measured ``router_load`` (None:
    uniform routing); ``()`` for an LLM without experts.

    Raises:
        ValueError, FileNotFoundError: as ``build_plan_inputs`` and ``expert_layers``.
    """
    spec = device_spec(device)
    inputs = build_plan_inputs(cfg, spec)
    return expert_layers(units, inputs.model_configs, inputs.shapes["llm"], spec, dtype, router_load)
