"""The layout search with tensor parallelism, FSDP2 sharding and activation checkpointing, when memory requires.

:func:`plan_parallel` wraps ``search.plan_layout``: it first searches the plain plan (no TP, no sharding, the
job's checkpointing); when that fits the memory cap it is the answer (sharding, TP and recomputation all cost
time or communication, so a plan that fits without them is preferred). Otherwise it searches every
``ParallelDegrees`` (TP degree dividing the devices, shard degree dividing the data-parallel degree, checkpointing
policy): each is the exact ``plan_layout`` (branch and bound) on ``devices / tp`` pipeline "devices" with the per-rank
costs of ``sharding.shard_costs`` and the cap lowered by FSDP2's transient buffer (``sharding.shard_buffer_bytes``).
The degrees are taken in increasing lower bound ``microbatches x (per-rank work per microbatch) / (devices / tp)``
(``search_degrees``; ``search.evaluate_plan``'s bound on the transformed costs) and the loop stops when the bound
reaches the best time found: the fastest fitting plan over the degrees, exact given each search's exactness.
Ties go to less TP, then less sharding, then less checkpointing.

With a shard degree above 1 both runtimes of FSDP2 are searched (``plan_parallel``): every rank a DP rank
(``pp = 1``: units gathered per microbatch, ``sharding.shard_costs`` and its buffer; with several microbatches per
rank both gradient reductions, ``parallel.fsdp_reduce`` ``"step"`` and ``"microbatch"``, ``flat_reduce``) and pipeline stages whose DP
ranks shard them (``pp > 1``: gathered once per step, ``sharding.pipelined_shard_costs``, whole parameters and
gradients within the step, a shard of the optimizer state); the faster fitting plan is kept. Without stages both
``parallel.fsdp_reshard`` values are options (``ParallelDegrees.fsdp_reshard``): ``"after_backward"`` saves the
backward's all-gathers and holds every trainable unit's gathered parameters (``sharding.shard_buffer_bytes``), so it
is chosen when the cap allows it and it is faster (ties: ``"after_forward"``).

**CPU offload** (``parallel.offload = "cpu"``, ``offload.offload_cost``) is searched only when no degrees give a
fitting plan (it costs host-device copies and a host optimizer step): over the same degrees with a shard degree
above 1, the plan without pipeline stages (every device a DP rank, the only one the runtime offloads), whose device
memory (frozen units, FSDP2's working set, one microbatch's activations) fits the cap and whose host memory fits
``HostSpec.memory_bytes``; the fastest (``plan_layout``'s time with no device optimizer step, plus
``OffloadCost.step_s``) is chosen, its ``LayoutChoice.offload`` set to ``"cpu"``. A job's own
``parallel.offload = "cpu"`` (``plan_parallel(offload="cpu")``) searches offloaded plans only.

The result's ``lower_bound_s`` is ``microbatches x (work of the given costs) / devices``: still a lower bound
with TP (a layer's work split over ``tp`` devices plus its all-reduces is at least its work on one), sharding
(all-gathers only add) and checkpointing (recomputation only adds), so ratios to it stay comparable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from plait.planner.cost_model import OptimizerSpec
from plait.planner.graph import consistent_units
from plait.planner.offload import HostSpec, offload_cost
from plait.planner.recompute import CHECKPOINT_POLICIES
from plait.planner.report import format_bytes
from plait.planner.search import LayoutChoice, plan_layout
from plait.planner.search_model import Costs, cost_list
from plait.planner.overheads import ActionOverheads
from plait.planner.sharding import (FSDP_RESHARD, ParallelDegrees, accumulated_grad_bytes, pipelined_optimizer,
                                    pipelined_overheads, pipelined_shard_costs, shard_buffer_bytes, shard_costs)
from plait.planner.simulator import P2PModel
from plait.planner.types import Unit, UnitCost

__all__ = ["LayoutSearch", "SearchOne", "degree_options", "flat_reduce", "plan_offloaded", "plan_parallel",
           "search_degrees"]

LayoutSearch = Callable[..., LayoutChoice]
"""A search with ``search.plan_layout``'s signature: ``plan_layout``, or ``planner.auto_plan.plan_filling_layout``
(the plans that use every device)."""
SearchOne = Callable[[Sequence[UnitCost], int, float | None, ParallelDegrees], LayoutChoice]
"""One search under fixed degrees: ``(per-rank costs, devices / tp, memory cap left, degrees) -> LayoutChoice``;
raises ``ValueError`` when nothing fits."""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(max(limit, 1).bit_length()) if (1 << k) <= limit]


def degree_options(devices: int, tp_degrees: Sequence[int] | None = None,
                   dp_shard_degrees: Sequence[int] | None = None,
                   checkpointing: Sequence[str] = CHECKPOINT_POLICIES,
                   fsdp_reshard: Sequence[str] = FSDP_RESHARD) -> list[ParallelDegrees]:
    """Every ``ParallelDegrees`` to consider on ``devices``: TP degrees (default powers of two up to 8) dividing
    ``devices``, shard degrees (default powers of two) dividing ``devices / tp``, each checkpointing policy, and
    with a shard degree above 1 each of ``fsdp_reshard`` (``sharding.FSDP_RESHARD``).

    Raises:
        ValueError: on a degree below 1, an unknown policy or an unknown ``fsdp_reshard``.
    """
    tps = sorted({int(t) for t in (tp_degrees if tp_degrees is not None else _powers_of_two(min(8, devices)))})
    out = []
    for tp in (t for t in tps if devices % max(t, 1) == 0):
        rest = devices // tp
        shards = dp_shard_degrees if dp_shard_degrees is not None else _powers_of_two(rest)
        for shard in sorted({int(s) for s in shards if rest % max(int(s), 1) == 0}):
            reshards = fsdp_reshard if shard > 1 else ("after_forward",)
            out += [ParallelDegrees(tp, shard, policy, r) for policy in checkpointing for r in reshards]
    return out


def search_degrees(units: Sequence[Unit], costs: Costs, devices: int, microbatches: int, search: SearchOne,
                   options: Sequence[ParallelDegrees], *, memory_cap: float | None = None,
                   base: ParallelDegrees = ParallelDegrees(), tp_link: P2PModel | None = None,
                   shard_link: P2PModel | None = None, dtype: Any = "bfloat16",
                   optimizer: OptimizerSpec = OptimizerSpec(),
                   checkpoint_overrides: dict[str, str] | None = None, prefer_base: bool = True) -> LayoutChoice:
    """The plain search ``base`` if it fits, else the fastest fitting plan over ``options`` (module docstring).

    Args:
        units, costs: pipeline units and their whole-unit costs on one device, without checkpointing (the degrees'
            policy is applied here); devices: all devices.
        search: the search under fixed degrees (``SearchOne``).
        options: degrees to try when ``base`` does not fit (``degree_options``).
        memory_cap: bytes per device (None: everything fits: ``base`` is returned).
        base: the degrees tried first (the job's own checkpointing policy, no TP, no sharding).
        tp_link, shard_link: links of the TP all-reduces and FSDP2 all-gathers (``sharding.shard_costs``).
        dtype, optimizer: for FSDP2's buffer (``sharding.shard_buffer_bytes``).
        checkpoint_overrides: per module a checkpointing policy replacing the degrees' (``sharding.shard_costs``).
        prefer_base: return ``base``'s plan whenever it fits (default); False: the fastest over ``options`` (``base``
            is then searched only when it is among them).

    Returns:
        The chosen ``LayoutChoice`` with ``tp``, ``dp_shard``, ``checkpointing``, ``shard_buffer_bytes``, the
        devices and the caller's cap filled in, and the lower bound of the given costs.

    Raises:
        ValueError: when no degrees give a fitting plan (listing why for each).
    """
    true_units = consistent_units(units)
    whole = cost_list(units, costs)
    work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(true_units, whole))
    link = dict(tp_link=tp_link, shard_link=shard_link, checkpoint_overrides=checkpoint_overrides)

    def attempt(degrees: ParallelDegrees) -> LayoutChoice:
        per_rank = shard_costs(true_units, whole, degrees, **link)
        buffer = shard_buffer_bytes(true_units, whole, degrees, dtype, optimizer)
        left = None if memory_cap is None else memory_cap - buffer
        if left is not None and left <= 0:
            raise ValueError(f"FSDP2's buffer alone ({buffer:.3g} bytes) exceeds the memory cap")
        choice = search(per_rank, devices // degrees.tp, left, degrees)
        # with stages: whole within the step (sharding); without, the flat search's accumulated gradients added
        flat = choice.plan.num_ranks == 1
        buffered = buffer + choice.shard_buffer_bytes if flat else 0.0
        reshard = degrees.fsdp_reshard if flat else "after_forward"  # with stages: whole within the step anyway
        return dataclasses.replace(choice, devices=devices, tp=degrees.tp, checkpointing=degrees.checkpointing,
                                   shard_buffer_bytes=buffered, memory_cap=memory_cap, fsdp_reshard=reshard,
                                   lower_bound_s=microbatches * work / devices)

    errors = []
    if prefer_base:
        try:
            first = attempt(base)
            if first.fits_memory:
                return first
        except ValueError as exc:
            errors.append(f"{_label(base)}: {exc}")
    ranked = sorted((o for o in options if o != base or not prefer_base),
                    key=lambda o: (_bound(true_units, whole, o, link, devices, microbatches), _preference(o)))
    best: LayoutChoice | None = None
    for degrees in ranked:
        if best is not None and _bound(true_units, whole, degrees, link, devices, microbatches) >= best.iteration_s:
            break
        try:
            choice = attempt(degrees)
        except ValueError as exc:
            errors.append(f"{_label(degrees)}: {exc}")
            continue
        if choice.fits_memory and (best is None or (choice.iteration_s, _preference(degrees)) <
                                   (best.iteration_s, _preference(_degrees_of(best)))):
            best = choice
    if best is None:
        raise ValueError("no plan fits the memory cap with any TP degree, shard degree or checkpointing: "
                         + "; ".join(errors[:6]) + (f"; ... ({len(errors)} in all)" if len(errors) > 6 else ""))
    return best


def _bound(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees, link: dict[str, Any],
           devices: int, microbatches: int) -> float:
    """``microbatches x per-rank work / (devices / tp)``: a lower bound of any plan under ``degrees`` (FSDP2's
    all-gathers free: with pipeline stages they run once per step, not per microbatch)."""
    per_rank = shard_costs(units, costs, degrees, **dict(link, shard_link=None))
    work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(units, per_rank))
    return microbatches * work / (devices // degrees.tp)


def _preference(degrees: ParallelDegrees) -> tuple[int, int, int, int]:
    """Tie order: less TP, less sharding, less checkpointing, parameters resharded after the forward (less memory)."""
    return (degrees.tp, degrees.dp_shard, CHECKPOINT_POLICIES.index(degrees.checkpointing),
            FSDP_RESHARD.index(degrees.fsdp_reshard))


def _degrees_of(choice: LayoutChoice) -> ParallelDegrees:
    return ParallelDegrees(choice.tp, choice.dp_shard, choice.checkpointing, choice.fsdp_reshard)


def _label(degrees: ParallelDegrees) -> str:
    reshard = f", fsdp_reshard {degrees.fsdp_reshard}" if degrees.fsdp_reshard != "after_forward" else ""
    return f"tp {degrees.tp}, dp_shard {degrees.dp_shard}, checkpointing {degrees.checkpointing}{reshard}"


def plan_parallel(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int,
                  memory_cap: float | None = None, tp_degrees: Sequence[int] | None = None,
                  dp_shard_degrees: Sequence[int] | None = None,
                  checkpointing: Sequence[str] = CHECKPOINT_POLICIES, base_checkpointing: str = "none",
                  fsdp_reshard: Sequence[str] = FSDP_RESHARD,
                  checkpoint_overrides: dict[str, str] | None = None, prefer_plain: bool = True,
                  tp_link: P2PModel | None = None, shard_link: P2PModel | None = None,
                  dp_degrees: Sequence[int] | None = None, dtype: Any = "bfloat16",
                  optimizer: OptimizerSpec = OptimizerSpec(), host: HostSpec | None = HostSpec(),
                  offload: str = "auto", layout_search: LayoutSearch = plan_layout, **search: Any) -> LayoutChoice:
    """``search.plan_layout`` over layouts, stages and DP degrees, and over TP degree, FSDP2 shard degree and
    activation checkpointing when the plain plan does not fit ``memory_cap``, and FSDP2 CPU offload when nothing
    fits without it (module docstring).

    Args:
        units, costs, devices, microbatches, memory_cap, dtype, optimizer: as ``plan_layout``; ``costs`` without
            checkpointing (``base_checkpointing`` and the searched policies are applied here).
        tp_degrees, dp_shard_degrees, checkpointing, fsdp_reshard: the degrees and policies to search
            (``degree_options``; ``fsdp_reshard`` only for FSDP2 without pipeline stages, ``sharding``).
        base_checkpointing: the job's own policy: the plain plan's, and the only one searched when not ``"none"``;
            checkpoint_overrides: the job's per-module
            policies (``recompute.plan_checkpointing``), kept in every option.
        prefer_plain: keep the plain plan whenever it fits (default); False: the fastest plan over every option.
        tp_link: link of the TP all-reduces (default ``search["p2p"]``, the stage-to-stage link: within a node);
            shard_link: link of FSDP2's all-gathers and reduce-scatters (default ``search["dp_link"]``).
        dp_degrees: data-parallel degrees (all of ``dp x dp_shard``) to consider; those above ``devices / tp`` are
            dropped for that TP degree.
        search: the other ``plan_layout`` keyword arguments (``frozen_aware``, ``p2p``, ``dp_link``, ``layouts``,
            ``rel_tol``, ``virtual_stages``, ``attach_encoders``, ``max_timed``, ``overheads``).
        host: the host side of a device for CPU offload (``offload.HostSpec``); None: offload not searched.
        offload: ``"auto"``: CPU offload searched only when nothing fits without it (default); ``"cpu"``: a job's
            own ``parallel.offload = "cpu"``: only offloaded plans (:func:`plan_offloaded` over the options with a
            shard degree above 1; ``host`` None: the default ``HostSpec``; no ``memory_cap``: the device unchecked).
        layout_search: the search under fixed degrees (``LayoutSearch``: ``plan_layout``, or
            ``planner.auto_plan.plan_filling_layout``, the plans that use every device), used by every option,
            FSDP2's both runtimes and CPU offload alike.

    Raises:
        ValueError: on bad arguments (``offload`` not ``"auto"`` or ``"cpu"``) or when no plan fits.
    """
    if offload not in ("auto", "cpu"):
        raise ValueError(f"offload must be 'auto' or 'cpu', got {offload!r}")
    if base_checkpointing != "none":  # the job's own policy is kept: only TP and sharding are searched
        checkpointing = (base_checkpointing,)
    tp_link = tp_link if tp_link is not None else search.get("p2p")
    shard_link = shard_link if shard_link is not None else search.get("dp_link")

    true_units = consistent_units(units)
    whole = cost_list(units, costs)

    def one(per_rank: Sequence[UnitCost], pipe_devices: int, cap: float | None, degrees: ParallelDegrees):
        dps = None if dp_degrees is None else [d for d in dp_degrees if d <= pipe_devices] or [1]
        if degrees.dp_shard == 1:
            return layout_search(units, per_rank, pipe_devices, microbatches=microbatches, memory_cap=cap,
                                 dp_degrees=dps, dtype=dtype, optimizer=optimizer, **search)

        def flat(flat_dps: list[int]) -> LayoutChoice:  # every device a DP rank: FSDP2 per microbatch, the buffer
            def run(flat_cap: float | None) -> LayoutChoice:
                return layout_search(units, per_rank, pipe_devices, microbatches=microbatches, memory_cap=flat_cap,
                                     dp_degrees=flat_dps, dtype=dtype, optimizer=optimizer,
                                     dp_shard=degrees.dp_shard, **search)

            rank_microbatches = -(-microbatches // pipe_devices)
            extra = (accumulated_grad_bytes(true_units, whole, degrees, dtype, optimizer) if rank_microbatches > 1
                     else 0.0)
            return flat_reduce(run, cap, rank_microbatches, extra)

        def staged(staged_dps: list[int]) -> LayoutChoice:  # pipeline stages sharded over their DP ranks
            return _pipelined(true_units, whole, degrees, pipe_devices, staged_dps, microbatches, memory_cap, dtype,
                              optimizer, tp_link, checkpoint_overrides, search, layout_search)

        # staged plans keep their stages whole within the step whatever fsdp_reshard says: searched once
        return _sharded(degrees, pipe_devices, microbatches, dps, flat,
                        staged if degrees.fsdp_reshard == "after_forward" else None)

    options = degree_options(devices, tp_degrees, dp_shard_degrees, checkpointing, fsdp_reshard)
    links = dict(tp_link=tp_link, shard_link=shard_link, checkpoint_overrides=checkpoint_overrides)
    if offload == "cpu":  # the job's own CPU offload: only offloaded plans, whether or not others fit
        job = _Offload(units, true_units, whole, devices, microbatches, memory_cap, host or HostSpec(), dtype,
                       optimizer, links, dp_degrees, search, layout_search)
        return plan_offloaded(job, options, ValueError("no plan fits the memory cap with the job's CPU offload "
                                                       "(parallel.offload = 'cpu')"))
    try:
        return search_degrees(units, costs, devices, microbatches, one, options, memory_cap=memory_cap,
                              base=ParallelDegrees(checkpointing=base_checkpointing), tp_link=tp_link,
                              shard_link=shard_link, dtype=dtype, optimizer=optimizer,
                              checkpoint_overrides=checkpoint_overrides, prefer_base=prefer_plain)
    except ValueError as exc:
        if host is None or memory_cap is None:
            raise
        job = _Offload(units, true_units, whole, devices, microbatches, memory_cap, host, dtype, optimizer, links,
                       dp_degrees, search, layout_search)
        return plan_offloaded(job, options, exc)


def flat_reduce(run: Callable[[float | None], LayoutChoice], cap: float | None, per_rank: int,
                extra: float) -> LayoutChoice:
    """The faster fitting of FSDP2's two gradient reductions without pipeline stages (``sharding``,
    ``parallel.fsdp_reduce``): ``"step"`` (the unsharded gradients accumulate over the ``per_rank`` microbatches:
    ``run`` under the cap lowered by ``extra``, ``sharding.accumulated_grad_bytes``, recorded in the result's
    ``shard_buffer_bytes``) and ``"microbatch"`` (a reduce-scatter after every microbatch: ``run`` under ``cap``,
    ``per_rank - 1`` more of the plan's ``grad_sync_s`` added to its iteration). With one microbatch per rank (or
    nothing accumulated) the two are the same: ``"step"``. Ties go to ``"step"``.

    Args:
        run: the search under a memory cap (bytes; None: no cap); cap: the cap left after FSDP2's one-unit buffer.
        per_rank: microbatches each rank runs per step; extra: bytes ``"step"`` adds to the buffer.

    Raises:
        ValueError: when neither fits a plan (both reasons).
    """
    if per_rank <= 1 or extra <= 0:
        return run(cap)
    found, errors, step = [], [], None
    if cap is None or cap - extra > 0:
        try:
            step = run(None if cap is None else cap - extra)
            found.append(dataclasses.replace(step, shard_buffer_bytes=extra))
        except ValueError as exc:
            errors.append(f"fsdp_reduce step: {exc}")
    else:
        errors.append(f"fsdp_reduce step: the accumulated unsharded gradients ({extra:.3g} bytes) exceed the cap")
    try:
        choice = step if cap is None and step is not None else run(cap)  # no cap: the same search as "step"
        added = (per_rank - 1) * choice.grad_sync_s
        found.append(dataclasses.replace(choice, fsdp_reduce="microbatch", iteration_s=choice.iteration_s + added,
                                         planned_iteration_s=choice.planned_iteration_s + added))
    except ValueError as exc:
        errors.append(f"fsdp_reduce microbatch: {exc}")
    if not found:
        raise ValueError("; ".join(errors))
    return min(found, key=lambda c: (not c.fits_memory, c.iteration_s, c.fsdp_reduce != "step"))


def _sharded(degrees: ParallelDegrees, pipe_devices: int, microbatches: int, dps: Sequence[int] | None,
             flat: Callable[[list[int]], LayoutChoice],
             staged: Callable[[list[int]], LayoutChoice] | None) -> LayoutChoice:
    """The faster fitting of FSDP2 without pipeline stages (``flat``, every device a DP rank) and with them
    (``staged``, the DP degrees ``dp_shard`` divides below ``pipe_devices``, up to ``microbatches``; None: not
    searched); each called with its DP degrees.

    Raises:
        ValueError: when neither finds a plan (both reasons).
    """
    wanted = [d for d in (dps if dps is not None else range(1, pipe_devices + 1)) if d % degrees.dp_shard == 0]
    runs = [(flat, [pipe_devices] if pipe_devices in wanted else [])]
    if staged is not None:
        runs.append((staged, [d for d in wanted if d < pipe_devices and pipe_devices % d == 0 and d <= microbatches]))
    found, errors = [], []
    for search, degrees_dp in runs:
        if not degrees_dp:
            continue
        try:
            found.append(search(degrees_dp))
        except ValueError as exc:
            errors.append(str(exc))
    if not found:
        raise ValueError(f"dp_shard {degrees.dp_shard} divides no DP degree of {pipe_devices} devices that fits: "
                         + ("; ".join(errors) or "no such DP degree"))
    return min(found, key=lambda c: (not c.fits_memory, c.iteration_s))


def _pipelined(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees, pipe_devices: int,
               dps: list[int], microbatches: int, memory_cap: float | None, dtype: Any, optimizer: OptimizerSpec,
               tp_link: P2PModel | None, overrides: dict[str, str] | None, search: dict[str, Any],
               layout_search: LayoutSearch = plan_layout) -> LayoutChoice:
    """``plan_layout`` with pipeline stages sharded by FSDP2 (``sharding``, "FSDP2 under pipeline stages"): whole
    per-unit costs and parameters, a shard of the optimizer state, the DP all-reduce's bytes; the whole memory cap
    (no separate buffer). The result records ``degrees.dp_shard``."""
    per_rank = pipelined_shard_costs(units, costs, degrees, tp_link=tp_link, checkpoint_overrides=overrides)
    options = dict(search, overheads=pipelined_overheads(search.get("overheads", ActionOverheads()), degrees.dp_shard))
    choice = layout_search(units, per_rank, pipe_devices, microbatches=microbatches, memory_cap=memory_cap,
                           dp_degrees=dps, dtype=dtype, optimizer=pipelined_optimizer(optimizer, degrees.dp_shard),
                           **options)
    return dataclasses.replace(choice, dp_shard=degrees.dp_shard)


@dataclasses.dataclass(frozen=True)
class _Offload:
    """What :func:`plan_offloaded` searches: ``plan_parallel``'s arguments (``links``: ``tp_link``, ``shard_link``,
    ``checkpoint_overrides``)."""

    units: Sequence[Unit]
    true_units: Sequence[Unit]
    whole: Sequence[UnitCost]
    devices: int
    microbatches: int
    memory_cap: float | None
    host: HostSpec
    dtype: Any
    optimizer: OptimizerSpec
    links: dict[str, Any]
    dp_degrees: Sequence[int] | None
    search: dict[str, Any]
    layout_search: LayoutSearch = plan_layout


def plan_offloaded(job: _Offload, options: Sequence[ParallelDegrees], cause: Exception) -> LayoutChoice:
    """The fastest plan with FSDP2 CPU offload over ``options`` (module docstring), when no plan fits without it.

    Raises:
        ValueError: ``cause``'s message and why no offloaded plan fits either.
    """
    best: LayoutChoice | None = None
    why: list[str] = []
    for degrees in sorted((o for o in options if o.dp_shard > 1), key=_preference):
        try:
            choice = _offloaded_one(job, degrees)
        except ValueError as exc:
            why.append(f"{_label(degrees)}: {exc}")
            continue
        if best is None or (choice.iteration_s, _preference(degrees)) < (best.iteration_s,
                                                                          _preference(_degrees_of(best))):
            best = choice
    if best is None:
        raise ValueError(f"{cause}; with CPU offload: " + ("; ".join(why[:4]) or "no shard degree above 1")
                         + (f"; ... ({len(why)} in all)" if len(why) > 4 else ""))
    return best


def _offloaded_one(job: _Offload, degrees: ParallelDegrees) -> LayoutChoice:
    """The plan without pipeline stages under ``degrees`` with CPU offload (``offload.offload_cost``).

    Raises:
        ValueError: when the device or host memory does not fit, or the DP degree is not searched."""
    pipe = job.devices // degrees.tp
    if job.dp_degrees is not None and pipe not in job.dp_degrees:
        raise ValueError(f"DP degree {pipe} (every device a DP rank) is not searched")
    cost = offload_cost(job.true_units, job.whole, degrees, job.host, dtype=job.dtype, optimizer=job.optimizer,
                        checkpoint_overrides=job.links["checkpoint_overrides"])
    cap = math.inf if job.memory_cap is None else job.memory_cap
    if cost.device_bytes > cap or cost.host_bytes > job.host.memory_bytes:
        cap_text = format_bytes(cap) if job.memory_cap is not None else "none"
        raise ValueError(f"device {format_bytes(cost.device_bytes)} (cap {cap_text}), host "
                         f"{format_bytes(cost.host_bytes)} (of {format_bytes(job.host.memory_bytes)})")
    per_rank = shard_costs(job.true_units, job.whole, degrees, **job.links)
    overheads = dataclasses.replace(job.search.get("overheads", ActionOverheads()), optimizer_s_per_byte=0.0)
    choice = job.layout_search(job.units, per_rank, pipe, microbatches=job.microbatches, dp_degrees=[pipe],
                               dtype=job.dtype, optimizer=job.optimizer, dp_shard=degrees.dp_shard,
                               **dict(job.search, overheads=overheads))
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
        shard_buffer_bytes=cost.buffer_bytes, memory_cap=job.memory_cap, fits_memory=True,
        stage_static_bytes=static,
        stage_memory_bytes=tuple(s + a for s, a in zip(static, choice.stage_activation_bytes)),
        lower_bound_s=job.microbatches * work / job.devices)
