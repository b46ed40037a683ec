"""FSDP2 CPU offload in ``parallel.plan_parallel`` (its module docstring, "CPU offload"): the fastest offloaded
plan over the options (:func:`plan_offloaded`), one option's plan (:func:`offloaded_one`) and a lower bound of every
offloaded plan on a device count (:func:`offload_floor`). Pure: no torch, no files."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from plait.planner.cost.experts import ExpertDispatch
from plait.planner.cost.offload import offload_cost
from plait.planner.cost.types import ParallelDegrees
from plait.planner.report import format_bytes
from plait.planner.search.monotone import RankCosts
from plait.planner.search.options import degree_options, degrees_of, label, preference
from plait.planner.search.placement import option_links
from plait.planner.search.types import LayoutChoice, NoPlanFits

_Job = Any
"""``parallel``'s search: its units, costs, devices, microbatches, machine, space, layout search and memos."""

__all__ = ["offload_floor", "offload_link", "offloaded_one", "plan_offloaded"]


def plan_offloaded(job: _Job, options: Sequence[ParallelDegrees], cause: Exception) -> LayoutChoice:
    """The fastest plan with FSDP2 CPU offload over ``options`` (module docstring), when no plan fits without it;
    ``job``: ``plan_parallel``'s search (its machine's ``host`` set).

    Raises:
        NoPlanFits: ``cause``'s message and why no offloaded plan fits either (a ``ValueError`` when ``cause`` is
            not a ``NoPlanFits``).
    """
    best: LayoutChoice | None = None
    why: list[str] = []
    for degrees in sorted((o for o in options if o.dp_shard > 1 and o.ep == 1), key=preference):
        try:
            choice = offloaded_one(job, degrees)
        except ValueError as exc:
            why.append(f"{label(degrees)}: {exc}")
            continue
        if best is None or (choice.iteration_s, preference(degrees)) < (best.iteration_s,
                                                                          preference(degrees_of(best))):
            best = choice
    if best is None:
        error = NoPlanFits if isinstance(cause, NoPlanFits) else ValueError
        raise error(f"{cause}; with CPU offload: " + ("; ".join(why[:4]) or "no shard degree above 1")
                         + (f"; ... ({len(why)} in all)" if len(why) > 4 else ""))
    return best


def offload_floor(job: _Job, devices: int, stop: float = -math.inf) -> float:
    """A lower bound (seconds) of every offloaded plan on ``devices`` (``offloaded_one``: every device a DP rank,
    each running ``nb = ceil(M / (devices / tp))`` microbatches' work of its per-rank costs, plus offload's ``nb``
    copies and host AdamW, ``OffloadCost.step_s``; options whose memory does not fit skipped); ``inf`` when offload
    is not searched (no host or no memory cap). Returns as soon as an option's bound is at most ``stop``."""
    machine, space, host = job.machine, job.space, job.machine.host
    if host is None or machine.memory_cap is None:
        return math.inf
    best = math.inf
    for degrees in degree_options(devices, space.tp_degrees, space.dp_shard_degrees, space.checkpointing,
                                  space.fsdp_reshard):
        if degrees.dp_shard > 1 and degrees.ep == 1:
            if degrees not in job.offload_costs:
                job.offload_costs[degrees] = offload_cost(job.true_units, job.whole, degrees, host, dtype=machine.dtype,
                                                          optimizer=machine.optimizer,
                                                          checkpoint_overrides=space.checkpoint_overrides)
            cost = job.offload_costs[degrees]
            if cost.device_bytes > machine.memory_cap or cost.host_bytes > host.memory_bytes:
                continue
            per_rank = job.rank_costs(degrees, **offload_link(job, degrees, devices))
            work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(job.true_units, per_rank))
            nb = -(-job.microbatches // (devices // degrees.tp))
            best = min(best, nb * work + cost.step_s(nb, 0.0))
            if best <= stop:
                break
    return best


def offload_link(job: _Job, degrees: ParallelDegrees, devices: int) -> dict[str, Any]:
    """The keyword arguments of ``sharding.shard_costs`` for an offloaded plan of ``degrees`` on ``devices``."""
    tp_link, shard_link = option_links(job.machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=devices)
    return dict(tp_link=tp_link, shard_link=shard_link, checkpoint_overrides=job.space.checkpoint_overrides,
                experts=ExpertDispatch(job.experts) if job.experts else None)


def offloaded_one(job: _Job, degrees: ParallelDegrees) -> LayoutChoice:
    """The plan without pipeline stages under ``degrees`` with CPU offload (``offload.offload_cost``).

    Raises:
        ValueError: when the device or host memory does not fit, or the DP degree is not searched."""
    machine, space, host = job.machine, job.space, job.machine.host
    pipe = job.devices // degrees.tp
    if space.dp_degrees is not None and pipe not in space.dp_degrees:
        raise ValueError(f"DP degree {pipe} (every device a DP rank) is not searched")
    cost = offload_cost(job.true_units, job.whole, degrees, host, dtype=machine.dtype, optimizer=machine.optimizer,
                        checkpoint_overrides=space.checkpoint_overrides)
    cap = math.inf if machine.memory_cap is None else machine.memory_cap
    if cost.device_bytes > cap or cost.host_bytes > host.memory_bytes:
        cap_text = format_bytes(cap) if machine.memory_cap is not None else "none"
        raise ValueError(f"device {format_bytes(cost.device_bytes)} (cap {cap_text}), host "
                         f"{format_bytes(cost.host_bytes)} (of {format_bytes(host.memory_bytes)})")
    per_rank = (job.rank_costs or RankCosts(job.true_units, job.whole))(
        degrees, **offload_link(job, degrees, job.devices))
    overheads = dataclasses.replace(machine.overheads, optimizer_s_per_byte=0.0)
    choice = job.search(per_rank, pipe, degrees=degrees, dp_degrees=[pipe], memory_cap=None,
                        dp_shard=degrees.dp_shard, overheads=overheads)
    added = cost.step_s(choice.microbatches_per_replica, choice.grad_sync_s)
    by_name = {u.name: (u, c) for u, c in zip(job.true_units, per_rank)}
    static = tuple(float(sum(by_name[n][1].param_bytes for n in st.units if not by_name[n][0].trainable))
                   for st in choice.plan.stages)
    work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(job.true_units, job.whole))
    delta = added - choice.update_s
    return dataclasses.replace(
        choice, devices=job.devices, tp=degrees.tp, checkpointing=degrees.checkpointing,
        fsdp_reshard=degrees.fsdp_reshard, iteration_s=choice.iteration_s + delta,
        planned_iteration_s=choice.planned_iteration_s + delta,
        update_s=0.0, offload_s=added, offload="cpu", host_memory_bytes=cost.host_bytes,
        shard_buffer_bytes=cost.buffer_bytes, memory_cap=machine.memory_cap, fits_memory=True,
        stage_static_bytes=static,
        stage_memory_bytes=tuple(s + a for s, a in zip(static, choice.stage_activation_bytes)),
        lower_bound_s=job.microbatches * work / job.devices)
