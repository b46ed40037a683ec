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
``parallel.offload = "cpu"`` (``SearchSpace(offload="cpu")``) searches offloaded plans only.

**Where ranks sit** (``Machine.topology``, ``placement``): each option and DP degree is searched with the links of
its groups under the rank order ``topology.plan_rank_order`` picks for its degrees (the inter-node link for an axis
whose groups cross nodes), and the chosen plan records that order (``LayoutChoice.rank_order``).

The result's ``lower_bound_s`` is ``microbatches x (work of the given costs) / devices``: still a lower bound
with TP (a layer's work split over ``tp`` devices plus its all-reduces is at least its work on one), sharding
(all-gathers only add) and checkpointing (recomputation only adds), so ratios to it stay comparable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from plait.planner.search.fit import least_need_of
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.offload import offload_cost
from plait.planner.cost.types import CHECKPOINT_POLICIES, FSDP_RESHARD, HostSpec, ParallelDegrees
from plait.planner.report import format_bytes
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace
from plait.planner.search.layout import plan_layout
from plait.planner.search.placement import option_links, retime, search_placed
from plait.planner.search.model import Costs, cost_list
from plait.planner.cost.sharding import (
    accumulated_grad_bytes, pipelined_optimizer, pipelined_overheads, pipelined_shard_costs, shard_buffer_bytes,
    shard_costs,
)
from plait.planner.types import Unit, UnitCost

__all__ = ["LayoutSearch", "SearchOne", "degree_options", "flat_reduce", "plan_offloaded", "plan_parallel",
           "search_degrees"]

LayoutSearch = Callable[..., LayoutChoice]
"""A search with ``search.plan_layout``'s signature ``(units, costs, devices, *, microbatches, machine, space)``:
``plan_layout``, or ``planner.auto_plan.plan_filling_layout``
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
                   options: Sequence[ParallelDegrees], *, machine: Machine = Machine(),
                   space: SearchSpace = SearchSpace()) -> LayoutChoice:
    """The plain search ``base`` if it fits, else the fastest fitting plan over ``options`` (module docstring).

    Args:
        units, costs: pipeline units and their whole-unit costs on one device, without checkpointing (the degrees'
            policy is applied here); devices: all devices.
        search: the search under fixed degrees (``SearchOne``).
        options: degrees to try when ``base`` does not fit (``degree_options``).
        machine: ``memory_cap`` (bytes per device; None: everything fits: the base degrees are returned), the
            links of the TP all-reduces and FSDP2 all-gathers (``tp_link``, ``shard_link``, already defaulted;
            ``sharding.shard_costs``; with ``topology`` set, per option ``placement.option_links``), dtype and
            optimizer for FSDP2's buffer (``sharding.shard_buffer_bytes``).
        space: ``base_checkpointing`` gives the degrees tried first (the job's own policy, no TP, no sharding);
            ``checkpoint_overrides``: per module a policy replacing the degrees' (``sharding.shard_costs``);
            ``prefer_plain``: return the base degrees' plan whenever it fits (default); False: the fastest over
            ``options`` (the base degrees are then searched only when among them).

    Returns:
        The chosen ``LayoutChoice`` with ``tp``, ``dp_shard``, ``checkpointing``, ``shard_buffer_bytes``, the
        devices and the caller's cap filled in, and the lower bound of the given costs.

    Raises:
        NoPlanFits: when no degrees give a fitting plan (listing why for each; no least need).
    """
    memory_cap, dtype, optimizer = machine.memory_cap, machine.dtype, machine.optimizer
    base, prefer_base = ParallelDegrees(checkpointing=space.base_checkpointing), space.prefer_plain
    true_units = consistent_units(units)
    whole = cost_list(units, costs)
    work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(true_units, whole))
    links: dict[tuple[int, int], dict[str, Any]] = {}

    def link(degrees: ParallelDegrees) -> dict[str, Any]:  # the option's TP and FSDP2 links (placement)
        key = (degrees.tp, degrees.dp_shard)
        if key not in links:
            tp_link, shard_link = option_links(machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=devices)
            links[key] = dict(tp_link=tp_link, shard_link=shard_link, checkpoint_overrides=space.checkpoint_overrides)
        return links[key]

    def attempt(degrees: ParallelDegrees) -> LayoutChoice:
        per_rank = shard_costs(true_units, whole, degrees, **link(degrees))
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
                    key=lambda o: (_bound(true_units, whole, o, link(o), devices, microbatches), _preference(o)))
    best: LayoutChoice | None = None
    for degrees in ranked:
        if best is not None and _bound(true_units, whole, degrees, link(degrees), devices,
                                       microbatches) >= best.iteration_s:
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
        raise NoPlanFits("no plan fits the memory cap with any TP degree, shard degree or checkpointing: "
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
                  machine: Machine = Machine(), space: SearchSpace = SearchSpace(),
                  layout_search: LayoutSearch = plan_layout) -> LayoutChoice:
    """``search.plan_layout`` over layouts, stages and DP degrees, and over TP degree, FSDP2 shard degree and
    activation checkpointing when the plain plan does not fit ``machine.memory_cap``, and FSDP2 CPU offload when
    nothing fits without it (module docstring).

    Args:
        units, costs, devices, microbatches: as ``plan_layout``; ``costs`` without checkpointing
            (``space.base_checkpointing`` and the searched policies are applied here).
        machine: as ``plan_layout``; ``tp_link``: link of the TP all-reduces (default ``p2p``, the stage-to-stage
            link: within a node); ``shard_link``: link of FSDP2's all-gathers and reduce-scatters (default
            ``dp_link``); ``host``: the host side of a device for CPU offload (None: offload not searched);
            ``topology``: when set, those four links are ignored and derived per plan from where each collective's
            group sits under the plan's rank order (``placement``), which the result's ``rank_order`` records.
        space: as ``plan_layout``, plus the degrees and policies to search (``tp_degrees``, ``dp_shard_degrees``,
            ``checkpointing``, ``fsdp_reshard``: ``degree_options``; ``fsdp_reshard`` only for FSDP2 without
            pipeline stages), ``base_checkpointing`` (the job's own policy: the plain plan's, and the only one
            searched when not ``"none"``), ``checkpoint_overrides`` (kept in every option), ``prefer_plain`` and
            ``offload`` (``"auto"``: CPU offload only when nothing fits without it; ``"cpu"``: a job's own
            ``parallel.offload = "cpu"``: only offloaded plans, :func:`plan_offloaded` over the options with a
            shard degree above 1; ``host`` None: the default ``HostSpec``; no cap: the device unchecked).
            ``dp_degrees`` (all of ``dp x dp_shard``) above ``devices / tp`` are dropped for that TP degree.
        layout_search: the search under fixed degrees (``LayoutSearch``: ``plan_layout``, or
            ``planner.auto_plan.plan_filling_layout``, the plans that use every device), used by every option,
            FSDP2's both runtimes and CPU offload alike; ``machine.dp_shard`` is set per option.

    Raises:
        ValueError: on bad arguments (``offload`` not ``"auto"`` or ``"cpu"``); ``NoPlanFits`` with the least need
            over the options searched (``fit.least_need``) when no plan fits.
    """
    if space.offload not in ("auto", "cpu"):
        raise ValueError(f"offload must be 'auto' or 'cpu', got {space.offload!r}")
    if space.base_checkpointing != "none":  # the job's own policy is kept: only TP and sharding are searched
        space = dataclasses.replace(space, checkpointing=(space.base_checkpointing,))
    machine = dataclasses.replace(machine, dp_shard=1,
                                  tp_link=machine.tp_link if machine.tp_link is not None else machine.p2p,
                                  shard_link=machine.shard_link if machine.shard_link is not None
                                  else machine.dp_link)
    options = degree_options(devices, space.tp_degrees, space.dp_shard_degrees, space.checkpointing,
                             space.fsdp_reshard)
    job = _Job(units, consistent_units(units), cost_list(units, costs), devices, microbatches, machine, space,
               layout_search)
    try:
        return _plan_parallel(job, costs, options)
    except NoPlanFits as exc:
        host = machine.host or (HostSpec() if space.offload == "cpu" else None)
        raise NoPlanFits(str(exc), least_need_of(job.true_units, job.whole, devices, options, dtype=machine.dtype,
                                                 optimizer=machine.optimizer,
                                                 checkpoint_overrides=space.checkpoint_overrides, host=host)) from exc


@dataclasses.dataclass(frozen=True)
class _Job:
    """What ``plan_parallel`` searches: its arguments, the units as ``consistent_units`` gives them and their
    whole-unit costs (``cost_list``); the machine's TP and shard links defaulted."""

    units: Sequence[Unit]
    true_units: Sequence[Unit]
    whole: Sequence[UnitCost]
    devices: int
    microbatches: int
    machine: Machine
    space: SearchSpace
    layout_search: LayoutSearch = plan_layout

    def search(self, per_rank: Sequence[UnitCost], devices: int, *, degrees: ParallelDegrees = ParallelDegrees(),
               microbatches: int | None = None, **changes: Any) -> LayoutChoice:
        """``layout_search`` on ``per_rank`` costs over ``devices``; ``changes``: ``Machine`` fields (``memory_cap``,
        ``optimizer``, ``overheads``, ``dp_shard``) and ``dp_degrees``. With ``machine.topology`` set, the links
        follow where each plan's ranks sit (``placement.search_placed``; ``degrees``: the option's TP degree and
        the FSDP2 shard degree of its rank layout) and the result records its rank order."""
        dps = changes.pop("dp_degrees")
        count = self.microbatches if microbatches is None else microbatches
        machine = dataclasses.replace(self.machine, **changes)

        def run(searched: Machine, degrees_dp: Sequence[int] | None, on: int) -> LayoutChoice:
            space = dataclasses.replace(self.space, dp_degrees=None if degrees_dp is None else tuple(degrees_dp))
            return self.layout_search(self.units, per_rank, on, microbatches=count, machine=searched, space=space)

        if machine.topology is None:
            return run(machine, dps, devices)

        def time_again(choice: LayoutChoice, placed: Machine) -> LayoutChoice:
            return retime(choice, self.units, per_rank, machine=placed, microbatches=count, devices=devices)

        # only plan_layout's plans may leave ranks idle (plan_filling_layout's fill them)
        return search_placed(run, time_again, machine, dps, devices=devices, microbatches=count, degrees=degrees,
                             idle_ranks=self.layout_search is plan_layout)


def _plan_parallel(job: _Job, costs: Costs, options: Sequence[ParallelDegrees]) -> LayoutChoice:
    """``plan_parallel`` after its arguments are checked (module docstring).

    Raises:
        NoPlanFits: without the least need."""
    machine, space, microbatches = job.machine, job.space, job.microbatches

    def one(per_rank: Sequence[UnitCost], pipe_devices: int, cap: float | None, degrees: ParallelDegrees):
        dps = None if space.dp_degrees is None else [d for d in space.dp_degrees if d <= pipe_devices] or [1]
        if degrees.dp_shard == 1:
            return job.search(per_rank, pipe_devices, degrees=degrees, memory_cap=cap, dp_degrees=dps)

        def flat(flat_dps: list[int]) -> LayoutChoice:  # every device a DP rank: FSDP2 per microbatch, the buffer
            def run(flat_cap: float | None) -> LayoutChoice:
                return job.search(per_rank, pipe_devices, degrees=degrees, memory_cap=flat_cap, dp_degrees=flat_dps,
                                  dp_shard=degrees.dp_shard)

            rank_microbatches = -(-microbatches // pipe_devices)
            extra = (accumulated_grad_bytes(job.true_units, job.whole, degrees, machine.dtype, machine.optimizer)
                     if rank_microbatches > 1 else 0.0)
            return flat_reduce(run, cap, rank_microbatches, extra)

        def staged(staged_dps: list[int]) -> LayoutChoice:  # pipeline stages sharded over their DP ranks
            return _pipelined(job, degrees, pipe_devices, staged_dps)

        # staged plans keep their stages whole within the step whatever fsdp_reshard says: searched once
        return _sharded(degrees, pipe_devices, microbatches, dps, flat,
                        staged if degrees.fsdp_reshard == "after_forward" else None)

    if space.offload == "cpu":  # the job's own CPU offload: only offloaded plans, whether or not others fit
        if machine.host is None:
            job = dataclasses.replace(job, machine=dataclasses.replace(machine, host=HostSpec()))
        return plan_offloaded(job, options, NoPlanFits("no plan fits the memory cap with the job's CPU offload "
                                                       "(parallel.offload = 'cpu')"))
    try:
        return search_degrees(job.units, costs, job.devices, microbatches, one, options, machine=machine,
                              space=space)
    except ValueError as exc:
        if machine.host is None or machine.memory_cap is None:
            raise
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


def _pipelined(job: _Job, degrees: ParallelDegrees, pipe_devices: int, dps: list[int]) -> LayoutChoice:
    """``plan_layout`` with pipeline stages sharded by FSDP2 (``sharding``, "FSDP2 under pipeline stages"): whole
    per-unit costs and parameters, a shard of the optimizer state, the DP all-reduce's bytes; the whole memory cap
    (no separate buffer). The result records ``degrees.dp_shard``."""
    machine = job.machine
    tp_link, _ = option_links(machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=job.devices)
    per_rank = pipelined_shard_costs(job.true_units, job.whole, degrees, tp_link=tp_link,
                                     checkpoint_overrides=job.space.checkpoint_overrides)
    choice = job.search(per_rank, pipe_devices, degrees=degrees, dp_degrees=dps,
                        overheads=pipelined_overheads(machine.overheads, degrees.dp_shard),
                        optimizer=pipelined_optimizer(machine.optimizer, degrees.dp_shard))
    return dataclasses.replace(choice, dp_shard=degrees.dp_shard)


def plan_offloaded(job: _Job, options: Sequence[ParallelDegrees], cause: Exception) -> LayoutChoice:
    """The fastest plan with FSDP2 CPU offload over ``options`` (module docstring), when no plan fits without it;
    ``job``: ``plan_parallel``'s search (its machine's ``host`` set).

    Raises:
        NoPlanFits: ``cause``'s message and why no offloaded plan fits either (a ``ValueError`` when ``cause`` is
            not a ``NoPlanFits``).
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
        error = NoPlanFits if isinstance(cause, NoPlanFits) else ValueError
        raise error(f"{cause}; with CPU offload: " + ("; ".join(why[:4]) or "no shard degree above 1")
                         + (f"; ... ({len(why)} in all)" if len(why) > 4 else ""))
    return best


def _offloaded_one(job: _Job, degrees: ParallelDegrees) -> LayoutChoice:
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
    tp_link, shard_link = option_links(machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=job.devices)
    per_rank = shard_costs(job.true_units, job.whole, degrees, tp_link=tp_link, shard_link=shard_link,
                           checkpoint_overrides=space.checkpoint_overrides)
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
