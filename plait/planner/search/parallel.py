"""The layout search with tensor parallelism, FSDP2 sharding and activation checkpointing, complete and monotone.

:func:`plan_parallel` wraps ``search.plan_layout``: it searches every ``ParallelDegrees`` (TP degree dividing the
devices, shard degree dividing the data-parallel degree, checkpointing policy) whether or not the plain plan (no
TP, no sharding, the job's checkpointing) fits the memory cap, and keeps the fastest fitting plan: each option is the
exact ``plan_layout`` (branch and bound) on ``devices / tp`` pipeline "devices" with the per-rank costs of
``sharding.shard_costs`` and the cap lowered by FSDP2's transient buffer (``sharding.shard_buffer_bytes``). The
options are taken in increasing lower bound (``monotone.work_bound``: one microbatch's chain and the work per rank
of the per-rank costs, ``search_degrees``) and the loop stops when the bound reaches the best time found; FSDP2's
runtimes are skipped on their own bounds, and plans with stages of a TP degree on the best time of its
least-checkpointed unsharded costs searched without the cap (more checkpointing and FSDP2 under stages only add time
to the same plans; that search stops at the time to beat, ``layout.plan_layout_below``, and then bounds the least
option itself too); each option's own search (FSDP2's: with stages) stops at the best time so far as well (with
1F1B's schedules: ``_Job.seeded``; with a topology through ``placement.search_placed``, for ``parallel.plan =
"auto"`` through ``auto_layout.plan_filling_layout``). Ties go to less TP, then less sharding, then less
checkpointing. ``SearchSpace.prefer_plain`` restores keeping the plain plan whenever it fits.

**Monotone in the device count** (``monotone.plan_over_divisors``): the plan for ``N`` devices is the fastest of that
search and of the plan for every proper divisor ``d`` of ``N`` (found the same way) run as it is, the other devices
idle; so it is never slower than the plan for ``d`` devices, nor than that plan replicated ``N / d`` times (a DP
degree the search on ``N`` holds). ``N`` is searched first and the divisors then only for plans at most as fast,
so their options' bounds stop their searches early, whenever no CPU-offloaded plan on a divisor can beat ``N``'s
(``offloaded.offload_floor``; else from the smallest divisor up, as offload is searched only where the divisors'
plans are offloaded). An option whose least memory (``fit.least_need``) exceeds the cap is skipped unsearched. With
``plan_filling_layout`` (plans must use every device) only the search on ``N`` runs.

With a shard degree above 1 both runtimes of FSDP2 are searched (``plan_parallel``): every rank a DP rank
(``pp = 1``: units gathered per microbatch, ``sharding.shard_costs`` and its buffer; with several microbatches per
rank both gradient reductions, ``parallel.fsdp_reduce`` ``"step"`` and ``"microbatch"``, ``flat_reduce``) and pipeline stages whose DP
ranks shard them (``pp > 1``: gathered once per step, ``sharding.pipelined_shard_costs``, whole parameters and
gradients within the step, a shard of the optimizer state); the faster fitting plan is kept. Without stages both
``parallel.fsdp_reshard`` values are options (``ParallelDegrees.fsdp_reshard``): ``"after_backward"`` saves the
backward's all-gathers and holds every trainable unit's gathered parameters (``sharding.shard_buffer_bytes``), so it
is chosen when the cap allows it and it is faster (ties: ``"after_forward"``).

**CPU offload** (``parallel.offload = "cpu"``, ``offload.offload_cost``) is searched only when no degrees give a
fitting plan (or none beats a divisor's offloaded plan; it costs host-device copies and a host optimizer step): over the same degrees with a shard degree
above 1, the plan without pipeline stages (every device a DP rank, the only one the runtime offloads), whose device
memory (frozen units, FSDP2's working set, one microbatch's activations) fits the cap and whose host memory fits
``HostSpec.memory_bytes``; the fastest (``plan_layout``'s time with no device optimizer step, plus
``OffloadCost.step_s``) is chosen, its ``LayoutChoice.offload`` set to ``"cpu"``. A job's own
``parallel.offload = "cpu"`` (``SearchSpace(offload="cpu")``) searches offloaded plans only.

**Where ranks sit** (``Machine.topology``, ``placement``): each option and DP degree is searched with the links of
its groups under the rank order ``topology.plan_rank_order`` picks for its degrees (the inter-node link for an axis
whose groups cross nodes), and the chosen plan records that order (``LayoutChoice.rank_order``).

**Expert parallelism** (``experts``: an MoE LLM's layers, ``cost.experts``): EP degrees are options too (``tp = 1``; DP
degrees ``ep`` divides; not FSDP2 under stages, not offload), charged by ``sharding.shard_costs``.

The result's ``lower_bound_s`` is ``microbatches x (work of the given costs) / devices``: still a lower bound
with TP (a layer's work split over ``tp`` devices plus its all-reduces is at least its work on one), sharding
(all-gathers only add) and checkpointing (recomputation only adds), so ratios to it stay comparable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from plait.planner.search.fit import MemoryNeed, least_need_of
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.experts import ExpertDispatch, ExpertLayer, searched_ep_degrees
from plait.planner.cost.types import CHECKPOINT_POLICIES, HostSpec, ParallelDegrees
from plait.planner.report import format_bytes
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace
from plait.planner.search.layout import plan_layout_below, plan_layout
from plait.planner.search.placement import Seeding, ep_link, option_links, retime, search_placed
from plait.planner.search.model import Costs, cost_list
from plait.planner.search.monotone import OptionBounds, RankCosts, divisors, plan_over_divisors
from plait.planner.search.offloaded import offload_floor, plan_offloaded
from plait.planner.search.options import degree_options, degrees_of as _degrees_of, label as _label
from plait.planner.search.options import preference as _preference
from plait.planner.cost.sharding import (
    accumulated_grad_bytes, pipelined_optimizer, pipelined_overheads, pipelined_shard_costs, shard_buffer_bytes,
)
from plait.planner.types import Unit, UnitCost

__all__ = ["LayoutSearch", "SearchOne", "degree_options", "flat_reduce", "plan_offloaded", "plan_parallel",
           "search_degrees"]

LayoutSearch = Callable[..., LayoutChoice]
"""A search with ``search.plan_layout``'s signature ``(units, costs, devices, *, microbatches, machine, space)``:
``plan_layout``, or ``planner.auto_plan.plan_filling_layout`` (the plans that use every device), which also takes a
keyword ``beat`` (seconds: the same plan whenever it is faster, else None or a plan not faster; ``plan_layout``'s is
``layout.plan_layout_below``)."""
SearchOne = Callable[[Sequence[UnitCost], int, float | None, ParallelDegrees, frozenset[str]], LayoutChoice]
"""One search under fixed degrees: ``(per-rank costs, devices / tp, memory cap left, degrees, parts) ->
LayoutChoice``, ``parts`` naming FSDP2's runtimes searched with a shard degree above 1 (``"flat"``: without pipeline
stages, ``"staged"``: with them); raises ``ValueError`` when nothing fits. ``plan_parallel``'s own also takes a
keyword ``beat`` (seconds; ``layout.plan_layout_below``: None when nothing is faster)."""


def search_degrees(units: Sequence[Unit], costs: Costs, devices: int, microbatches: int, search: SearchOne,
                   options: Sequence[ParallelDegrees], *, machine: Machine = Machine(),
                   space: SearchSpace = SearchSpace()) -> LayoutChoice:
    """The fastest fitting plan over ``options`` (module docstring), or the plain plan whenever it fits with
    ``space.prefer_plain``. No MoE layers are given here: options with ``ep > 1`` get their experts' memory
    divided but no all-to-all charged (``plan_parallel`` charges them).

    Args:
        units, costs: pipeline units and their whole-unit costs on one device, without checkpointing (the degrees'
            policy is applied here); devices: all devices.
        search: the search under fixed degrees (``SearchOne``).
        options: the degrees searched (``degree_options``).
        machine: ``memory_cap`` (bytes per device; None: everything fits), the links of the TP all-reduces and
            FSDP2 all-gathers (``tp_link``, ``shard_link``, already defaulted; ``sharding.shard_costs``; with
            ``topology`` set, per option ``placement.option_links``), dtype and optimizer for FSDP2's buffer
            (``sharding.shard_buffer_bytes``).
        space: ``base_checkpointing`` gives the plain degrees (the job's own policy, no TP, no sharding);
            ``checkpoint_overrides``: per module a policy replacing the degrees' (``sharding.shard_costs``);
            ``prefer_plain``: return the plain degrees' plan whenever it fits (the default, False: the fastest over
            ``options``, the plain degrees searched only when among them); ``dp_degrees`` bound the options.

    Returns:
        The chosen ``LayoutChoice`` with ``tp``, ``dp_shard``, ``checkpointing``, ``shard_buffer_bytes``, the
        devices and the caller's cap filled in, and the lower bound of the given costs.

    Raises:
        NoPlanFits: when no degrees give a fitting plan (listing why for each; no least need).
    """
    found = _search_degrees(units, costs, devices, microbatches, search, options, machine, space, math.inf, ())
    assert found is not None  # with no time to beat, _search_degrees raises rather than returning None
    return found


def _search_degrees(units: Sequence[Unit], costs: Costs, devices: int, microbatches: int, search: SearchOne,
                    options: Sequence[ParallelDegrees], machine: Machine, space: SearchSpace,
                    beat: float, experts: Sequence[ExpertLayer],
                    rank_costs: RankCosts | None = None, seeded: bool = False,
                    needs: MemoryNeed | None = None) -> LayoutChoice | None:
    """``search_degrees`` keeping only plans faster than ``beat`` seconds: None when no option gives one (raises
    ``NoPlanFits`` only with ``beat`` infinite and nothing fitting). Options go in increasing
    ``monotone.work_bound`` and stop when it reaches the best time; FSDP2's two runtimes (without and with
    stages) are each skipped when their own bound does: without stages ``ceil(M / devices) x`` the per-rank work
    with the all-gathers, with stages also the best time of the same TP degree's least-checkpointed unsharded costs
    searched without the memory cap (``_uncapped``; less its optimizer step when charged; not for EP options, whose
    smaller expert gradients synchronise faster). ``experts``: the MoE layers whose all-to-alls and imbalance EP
    options pay (``cost.experts``). ``seeded``: ``search`` takes a keyword ``beat`` (``_uncapped``); each
    option's own search then stops at the time to beat (the best so far, ties kept for the tie order). ``needs``:
    ``fit.least_need`` per option, shared by the divisors' searches (without the host)."""
    memory_cap, dtype, optimizer = machine.memory_cap, machine.dtype, machine.optimizer
    base, prefer_base = ParallelDegrees(checkpointing=space.base_checkpointing), space.prefer_plain
    true_units = consistent_units(units)
    whole = cost_list(units, costs)
    work = math.fsum(c.forward_s + c.backward_s(u) for u, c in zip(true_units, whole))
    links: dict[tuple[int, int], dict[str, Any]] = {}

    def link(degrees: ParallelDegrees) -> dict[str, Any]:  # the option's TP, FSDP2 and EP links (placement)
        key = (degrees.tp, degrees.dp_shard, degrees.ep)
        if key not in links:
            tp_link, shard_link = option_links(machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=devices)
            links[key] = dict(tp_link=tp_link, shard_link=shard_link, checkpoint_overrides=space.checkpoint_overrides)
            if experts and (degrees.ep > 1 or degrees.tp > 1):  # TP: the routed experts' time whole (sharding)
                links[key]["experts"] = ExpertDispatch(tuple(experts), ep_link(
                    machine, tp=degrees.tp, dp_shard=degrees.dp_shard, ep=degrees.ep, devices=devices))
        return links[key]

    def attempt(degrees: ParallelDegrees, parts: frozenset[str] = BOTH,
                seed: float = math.inf) -> LayoutChoice | None:  # seed: the time to beat (seeded), else inf
        per_rank = bounds.per_rank(degrees, **link(degrees))
        buffer = shard_buffer_bytes(true_units, whole, degrees, dtype, optimizer)
        left = None if memory_cap is None else memory_cap - buffer
        if left is not None and left <= 0:
            raise ValueError(f"FSDP2's buffer alone ({buffer:.3g} bytes) exceeds the memory cap")
        if seed < math.inf:
            choice = search(per_rank, devices // degrees.tp, left, degrees, parts, beat=seed)
            if choice is None:  # nothing faster than the seed
                return None
        else:
            choice = search(per_rank, devices // degrees.tp, left, degrees, parts)
        # with stages: whole within the step (sharding); without, the flat search's accumulated gradients added
        flat = choice.plan.num_ranks == 1
        buffered = buffer + choice.shard_buffer_bytes if flat else 0.0
        reshard = degrees.fsdp_reshard if flat else "after_forward"  # with stages: whole within the step anyway
        return dataclasses.replace(choice, devices=devices, tp=degrees.tp, checkpointing=degrees.checkpointing,
                                   shard_buffer_bytes=buffered, memory_cap=memory_cap, fsdp_reshard=reshard,
                                   lower_bound_s=microbatches * work / devices, ep=degrees.ep)

    bounds = OptionBounds(true_units, whole, devices, microbatches, space, link, rank_costs)
    uncapped: dict[int, float] = {}

    def floor_of(tp: int, to_beat: float) -> float:  # at most the least time of any staged plan of TP degree tp
        if tp not in uncapped:  # (_uncapped); to_beat only falls, so a floor found at least as large stays valid
            uncapped[tp] = _uncapped(bounds, search, options, tp, machine, to_beat if seeded else math.inf)
        return uncapped[tp]

    memory_need = needs if needs is not None else MemoryNeed(true_units, whole, dtype=dtype, optimizer=optimizer,
                                                             checkpoint_overrides=space.checkpoint_overrides)

    def _least_need(degrees: ParallelDegrees) -> float:  # fit.least_need of the option alone
        return memory_need(degrees, devices)

    errors = []
    best: LayoutChoice | None = None
    if prefer_base:
        try:
            first = attempt(base)
            if first.fits_memory:
                return first if first.iteration_s < beat else None
        except ValueError as exc:
            errors.append(f"{_label(base)}: {exc}")
    ranked = sorted((o for o in options if o != base or not prefer_base),
                    key=lambda o: (bounds.least(o), _preference(o)))
    for degrees in ranked:
        to_beat = beat if best is None else min(beat, best.iteration_s)
        if bounds.least(degrees) >= to_beat:
            break
        parts = set(BOTH) if degrees.dp_shard > 1 else {"staged"}
        if degrees.dp_shard > 1 and bounds.flat(degrees) >= to_beat:
            parts.discard("flat")
        staged = bounds.staged(degrees)
        if staged < to_beat and to_beat < math.inf and degrees.ep == 1 and (
                seeded or degrees != _least_of(options, degrees.tp)):  # seeded: the floor costs less than the search
            staged = max(staged, floor_of(degrees.tp, to_beat))
        if staged >= to_beat:
            parts.discard("staged")
        if not parts:
            continue
        need = _least_need(degrees) if memory_cap is not None else 0.0
        if memory_cap is not None and need > memory_cap * (1 + 1e-9) + 64:  # no plan of it fits (fit.least_need)
            errors.append(f"{_label(degrees)}: needs at least {format_bytes(need)} per device")
            continue
        # seeded: the option's own search stops at the time to beat (ties with the best kept: the tie order decides)
        seed = (beat if best is None else min(beat, math.nextafter(best.iteration_s, math.inf))) * (1 + SEED_MARGIN)
        try:
            choice = attempt(degrees, frozenset(parts) if degrees.dp_shard > 1 else BOTH,
                             seed if seeded else math.inf)  # FSDP2: the staged search stops there, not the flat
        except ValueError as exc:
            errors.append(f"{_label(degrees)}: {exc}")
            continue
        if choice is None:
            continue
        if choice.fits_memory and choice.iteration_s < beat and (
                best is None or (choice.iteration_s, _preference(degrees)) <
                (best.iteration_s, _preference(_degrees_of(best)))):
            best = choice
    if best is None and beat == math.inf:
        raise NoPlanFits("no plan fits the memory cap with any TP degree, shard degree or checkpointing: "
                         + "; ".join(errors[:6]) + (f"; ... ({len(errors)} in all)" if len(errors) > 6 else ""))
    return best


BOTH = frozenset(("flat", "staged"))
"""FSDP2's two runtimes (``_sharded``): without pipeline stages (``"flat"``) and with them (``"staged"``)."""


def _least_of(options: Sequence[ParallelDegrees], tp: int) -> ParallelDegrees:
    """The option of TP degree ``tp`` with the least checkpointing, unsharded (the one ``_uncapped`` searches)."""
    policies = [o.checkpointing for o in options if o.tp == tp]
    least = min(policies, key=CHECKPOINT_POLICIES.index) if policies else "none"
    return ParallelDegrees(tp, 1, least)


SEED_MARGIN = 1e-6
"""Relative margin of ``_uncapped``'s incumbent above the time to beat (planned and simulated times may differ in
their last bits)."""


def _uncapped(bounds: OptionBounds, search: SearchOne, options: Sequence[ParallelDegrees], tp: int,
              machine: Machine, beat: float = math.inf) -> float:
    """The best time of TP degree ``tp``'s least-checkpointed unsharded costs searched without the memory cap, less
    the optimizer step of all their trainable bytes: below every plan with stages of that TP degree (more
    checkpointing only adds recomputation; FSDP2 with stages runs the same per-rank costs with less memory and a
    shard's optimizer step), up to the layout search's own exactness. ``-inf`` when that search finds nothing.
    ``beat`` finite: only whether that time reaches ``beat`` matters, so the search (``search`` with keyword
    ``beat``) stops at ``beat`` plus the step (``SEED_MARGIN`` above), and ``beat`` is returned when it finds
    nothing faster."""
    degrees = _least_of(options, tp)
    per_rank = bounds.per_rank(degrees, **bounds.link(degrees))
    trained = math.fsum(c.param_bytes * u.trained_fraction for u, c in zip(bounds.units, per_rank))
    step = machine.overheads.update_s(trained)
    try:
        if beat < math.inf:
            choice = search(per_rank, bounds.devices // tp, None, degrees, BOTH,
                            beat=(beat + step) * (1 + SEED_MARGIN))
            if choice is None:
                return beat
        else:
            choice = search(per_rank, bounds.devices // tp, None, degrees, BOTH)
    except ValueError:
        return -math.inf
    return choice.iteration_s - step


def plan_parallel(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int,
                  machine: Machine = Machine(), space: SearchSpace = SearchSpace(),
                  layout_search: LayoutSearch = plan_layout, experts: Sequence[ExpertLayer] = ()) -> LayoutChoice:
    """``search.plan_layout`` over layouts, stages and DP degrees, TP degree, FSDP2 shard degree and activation
    checkpointing, whether or not the plain plan fits ``machine.memory_cap``, FSDP2 CPU offload when nothing fits
    without it, and the plans of every divisor of ``devices`` (module docstring: the result is never slower than
    ``plan_parallel`` on a divisor of ``devices``). Times in seconds, memory in bytes.

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
            searched when not ``"none"``), ``checkpoint_overrides`` (kept in every option), ``prefer_plain`` (keep
            the plain plan whenever it fits; default False: the fastest over every option) and
            ``offload`` (``"auto"``: CPU offload only when nothing fits without it; ``"cpu"``: a job's own
            ``parallel.offload = "cpu"``: only offloaded plans, :func:`plan_offloaded` over the options with a
            shard degree above 1; ``host`` None: the default ``HostSpec``; no cap: the device unchecked).
            ``dp_degrees`` (all of ``dp x dp_shard``) above ``devices / tp`` are dropped for that TP degree.
        layout_search: the search under fixed degrees (``LayoutSearch``: ``plan_layout``, or
            ``planner.auto_plan.plan_filling_layout``, the plans that use every device), used by every option,
            FSDP2's both runtimes and CPU offload alike; ``machine.dp_shard`` is set per option.
        experts: the LLM's MoE layers (``cost.experts.expert_layers``): expert parallelism is searched
            (``space.ep_degrees``, with ``tp = 1``, on the DP degrees ``ep`` divides, FSDP2 without pipeline stages or
            plain data parallelism with them; not with CPU offload), each EP option charged its all-to-alls on the
            link of its EP group (``placement.ep_link``) and its load imbalance; the result's ``ep`` records it.

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
    eps = searched_ep_degrees(space.ep_degrees, experts, devices)
    options = degree_options(devices, space.tp_degrees, space.dp_shard_degrees, space.checkpointing,
                             space.fsdp_reshard, eps)
    true_units, whole = consistent_units(units), cost_list(units, costs)
    job = _Job(units, true_units, whole, devices, microbatches, machine, space, layout_search, tuple(experts),
               RankCosts(true_units, whole), needs=MemoryNeed(true_units, whole, dtype=machine.dtype,
                                                              optimizer=machine.optimizer,
                                                              checkpoint_overrides=space.checkpoint_overrides))

    unbeaten: dict[int, LayoutChoice] = {}  # the searches with nothing to beat, when their plan is not offloaded

    def direct(count: int, so_far: LayoutChoice | None, beat: float) -> LayoutChoice | None:  # ``count`` alone
        offload = so_far is None or so_far.offload == "cpu"
        if count in unbeaten:  # its plan, if faster than ``beat``; else offload's, searched only as below
            if unbeaten[count].iteration_s < beat or not offload:
                return unbeaten[count] if unbeaten[count].iteration_s < beat else None
        on = options if count == devices else degree_options(count, space.tp_degrees, space.dp_shard_degrees,
                                                             space.checkpointing, space.fsdp_reshard, eps)
        found = _plan_parallel(dataclasses.replace(job, devices=count), costs, on, beat, offload=offload)
        if beat == math.inf and found is not None and found.offload == "none":
            unbeaten[count] = found
        return found

    try:
        if layout_search is not plan_layout:  # plans must use every device: no divisor's plan run as it is
            return _plan_parallel(job, costs, options, math.inf)
        return plan_over_divisors(devices, direct, lambda c: (c.iteration_s, _preference(_degrees_of(c))),
                                  incumbent_first=lambda top: space.offload == "auto" and top.offload == "none" and all(
                                      offload_floor(job, c, top.iteration_s) > top.iteration_s
                                      for c in reversed(divisors(devices)[:-1])))
    except NoPlanFits as exc:
        host = machine.host or (HostSpec() if space.offload == "cpu" else None)
        tried = [o for o in options if o.ep <= microbatches]  # EP needs a microbatch per DP rank
        raise NoPlanFits(str(exc), least_need_of(job.true_units, job.whole, devices, tried, dtype=machine.dtype,
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
    experts: tuple[ExpertLayer, ...] = ()
    rank_costs: RankCosts | None = dataclasses.field(default=None, compare=False)  # shared by every divisor
    offload_costs: dict[ParallelDegrees, Any] = dataclasses.field(default_factory=dict, compare=False)  # likewise
    needs: MemoryNeed | None = dataclasses.field(default=None, compare=False)  # likewise

    def search(self, per_rank: Sequence[UnitCost], devices: int, *, degrees: ParallelDegrees = ParallelDegrees(),
               microbatches: int | None = None, **changes: Any) -> LayoutChoice:
        """``layout_search`` on ``per_rank`` costs over ``devices``; ``changes``: ``Machine`` fields (``memory_cap``,
        ``optimizer``, ``overheads``, ``dp_shard``) and ``dp_degrees``. With ``machine.topology`` set, the links
        follow where each plan's ranks sit (``placement.search_placed``; ``degrees``: the option's TP degree and
        the FSDP2 shard degree of its rank layout) and the result records its rank order."""
        dps, beat = changes.pop("dp_degrees"), changes.pop("beat", math.inf)
        count = self.microbatches if microbatches is None else microbatches
        machine = dataclasses.replace(self.machine, **changes)

        def run(searched: Machine, degrees_dp: Sequence[int] | None, on: int,
                to_beat: float = math.inf) -> LayoutChoice | None:
            space = dataclasses.replace(self.space, dp_degrees=None if degrees_dp is None else tuple(degrees_dp),
                                        encoder_tp=self.space.encoder_tp if degrees.tp == 1 else ())  # not with TP
            if to_beat < math.inf:  # None when nothing is faster (seeded: see _Job.seeded)
                below = plan_layout_below if self.layout_search is plan_layout else self.layout_search
                return below(self.units, per_rank, on, microbatches=count, machine=searched, space=space,
                             beat=to_beat)
            return self.layout_search(self.units, per_rank, on, microbatches=count, machine=searched, space=space)

        if machine.topology is None:
            return run(machine, dps, devices, beat)

        def time_again(choice: LayoutChoice, placed: Machine) -> LayoutChoice:
            return retime(choice, self.units, per_rank, machine=placed, microbatches=count, devices=devices)

        # only plan_layout's plans may leave ranks idle (plan_filling_layout's fill them)
        return search_placed(run, time_again, machine, dps, devices=devices, microbatches=count, degrees=degrees,
                             seeding=Seeding(idle_ranks=self.layout_search is plan_layout, beat=beat,
                                             seeded=self.seeded))

    @property
    def seeded(self) -> bool:
        """Whether a search may stop at a time to beat (``layout.plan_layout_below``, ``plan_filling_layout``'s
        ``beat``; with a topology through ``placement.search_placed``): 1F1B's schedules only (the chosen plan's
        simulated time is then its planned one)."""
        return set(self.space.schedules) == {"1f1b"}


def _plan_parallel(job: _Job, costs: Costs, options: Sequence[ParallelDegrees], beat: float,
                   offload: bool = True) -> LayoutChoice | None:
    """The search on ``job.devices`` alone after ``plan_parallel``'s arguments are checked (module docstring): the
    fastest plan faster than ``beat`` seconds, None when there is none; CPU offload (``space.offload = "auto"``)
    when nothing without it is, and ``offload`` (the plan to beat, if any, is offloaded itself).

    Raises:
        NoPlanFits: without the least need, when nothing fits and ``beat`` is infinite."""
    machine, space, microbatches = job.machine, job.space, job.microbatches

    def one(per_rank: Sequence[UnitCost], pipe_devices: int, cap: float | None, degrees: ParallelDegrees,
            parts: frozenset[str] = BOTH, beat: float = math.inf) -> LayoutChoice | None:
        dps = None if space.dp_degrees is None else [d for d in space.dp_degrees if d <= pipe_devices] or [1]
        if degrees.ep > 1:  # EP splits the DP ranks of a stage: DP degrees it divides, a microbatch per DP rank
            dps = [d for d in (dps or divisors(pipe_devices)) if d % degrees.ep == 0 and d <= microbatches]
            if not dps:
                raise ValueError(f"ep {degrees.ep} divides no DP degree searched (at most {microbatches} microbatches)")
        if degrees.dp_shard == 1:
            seed = dict(beat=beat) if beat < math.inf else {}  # only when job.seeded
            return job.search(per_rank, pipe_devices, degrees=degrees, memory_cap=cap, dp_degrees=dps, **seed)

        def flat(flat_dps: list[int]) -> LayoutChoice:  # every device a DP rank: FSDP2 per microbatch, the buffer
            def run(flat_cap: float | None) -> LayoutChoice:
                return job.search(per_rank, pipe_devices, degrees=degrees, memory_cap=flat_cap, dp_degrees=flat_dps,
                                  dp_shard=degrees.dp_shard)

            rank_microbatches = -(-microbatches // pipe_devices)
            extra = (accumulated_grad_bytes(job.true_units, job.whole, degrees, machine.dtype, machine.optimizer)
                     if rank_microbatches > 1 else 0.0)
            return flat_reduce(run, cap, rank_microbatches, extra)

        def staged(staged_dps: list[int]) -> LayoutChoice | None:  # pipeline stages sharded over their DP ranks
            return _pipelined(job, degrees, pipe_devices, staged_dps, beat)  # None: nothing faster than beat

        # staged plans keep their stages whole within the step whatever fsdp_reshard says: searched once
        # staged FSDP2 with EP is not searched (its experts' optimizer state is not modelled)
        return _sharded(degrees, pipe_devices, microbatches, dps, flat if "flat" in parts else None,
                        staged if degrees.fsdp_reshard == "after_forward" and "staged" in parts
                        and degrees.ep == 1 else None)

    if space.offload == "cpu":  # the job's own CPU offload: only offloaded plans, whether or not others fit
        if machine.host is None:
            job = dataclasses.replace(job, machine=dataclasses.replace(machine, host=HostSpec()))
        return plan_offloaded(job, options, NoPlanFits("no plan fits the memory cap with the job's CPU offload "
                                                       "(parallel.offload = 'cpu')"))
    try:
        found = _search_degrees(job.units, costs, job.devices, microbatches, one, options, machine, space, beat,
                                job.experts, job.rank_costs, job.seeded, job.needs)
    except ValueError as exc:
        if machine.host is None or machine.memory_cap is None:
            raise
        return plan_offloaded(job, options, exc)
    if found is not None or not offload or machine.host is None or machine.memory_cap is None:
        return found
    try:  # nothing without offload beats the divisors' offloaded plan
        offloaded = plan_offloaded(job, options, NoPlanFits("no plan fits the memory cap"))
    except ValueError:
        return None
    return offloaded if offloaded.iteration_s < beat else None


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
             flat: Callable[[list[int]], LayoutChoice] | None,
             staged: Callable[[list[int]], LayoutChoice | None] | None) -> LayoutChoice | None:
    """The faster fitting of FSDP2 without pipeline stages (``flat``, every device a DP rank) and with them
    (``staged``, the DP degrees ``dp_shard`` divides below ``pipe_devices``, up to ``microbatches``); each called
    with its DP degrees, None: not searched. ``staged`` may return None (nothing faster than a time to beat); None
    when it does and ``flat`` gives nothing either.

    Raises:
        ValueError: when neither finds a plan (both reasons).
    """
    wanted = [d for d in (dps if dps is not None else range(1, pipe_devices + 1)) if d % degrees.dp_shard == 0]
    runs = [(flat, [pipe_devices] if pipe_devices in wanted else [])] if flat is not None else []
    if staged is not None:
        runs.append((staged, [d for d in wanted if d < pipe_devices and pipe_devices % d == 0 and d <= microbatches]))
    found, errors, below = [], [], False
    for search, degrees_dp in runs:
        if not degrees_dp:
            continue
        try:
            choice = search(degrees_dp)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if choice is None:
            below = True
        else:
            found.append(choice)
    if not found and below:
        return None
    if not found:
        raise ValueError(f"dp_shard {degrees.dp_shard} divides no DP degree of {pipe_devices} devices that fits: "
                         + ("; ".join(errors) or "no such DP degree"))
    return min(found, key=lambda c: (not c.fits_memory, c.iteration_s))


def _pipelined(job: _Job, degrees: ParallelDegrees, pipe_devices: int, dps: list[int],
               beat: float = math.inf) -> LayoutChoice | None:
    """``plan_layout`` with pipeline stages sharded by FSDP2 (``sharding``, "FSDP2 under pipeline stages"): whole
    per-unit costs and parameters, a shard of the optimizer state, the DP all-reduce's bytes; the whole memory cap
    (no separate buffer). The result records ``degrees.dp_shard``; no encoder replicas or TP groups
    (``encoder_dp``, ``encoder_tp``) with FSDP2. ``beat`` finite (``job.seeded``): the search stops there, None
    when nothing is faster."""
    space = dataclasses.replace(job.space, encoder_dp=(), encoder_tp=())
    machine, job = job.machine, dataclasses.replace(job, space=space)
    tp_link, _ = option_links(machine, tp=degrees.tp, dp_shard=degrees.dp_shard, devices=job.devices)
    per_rank = pipelined_shard_costs(job.true_units, job.whole, degrees, tp_link=tp_link,
                                     checkpoint_overrides=job.space.checkpoint_overrides,
                                     experts=ExpertDispatch(job.experts) if job.experts else None)
    choice = job.search(per_rank, pipe_devices, degrees=degrees, dp_degrees=dps,
                        overheads=pipelined_overheads(machine.overheads, degrees.dp_shard),
                        optimizer=pipelined_optimizer(machine.optimizer, degrees.dp_shard),
                        **(dict(beat=beat) if beat < math.inf else {}))
    return None if choice is None else dataclasses.replace(choice, dp_shard=degrees.dp_shard)
