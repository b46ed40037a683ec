"""Links by where ranks sit: the search's collectives charged on the link their group's ranks use.

With ``Machine.topology`` set, ``search_parallel.plan_parallel`` does not read the machine's explicit links: for each
plan it numbers the ranks in the order :func:`plait.planner.cost.topology.plan_rank_order` chooses for the plan's
degrees (``dp`` replicas of ``dp_shard`` FSDP2 shards, ``pp`` pipeline ranks, CP 1, ``tp``) and charges each
collective on ``topology.inter_link`` when some group of its axis spans several nodes
(:func:`plait.planner.cost.topology.crossing_axes`), else on ``topology.intra_link``:

- ``dp_link`` (the gradient synchronisation after the flush: a reduce-scatter over the ``dp_shard`` group then an
  all-reduce over the ``dp`` replicas; under pipeline stages one all-reduce over the ``dp x dp_shard`` ranks of a
  stage, ``sharding``): it crosses when ``dp`` or ``dp_shard`` does. ``dp`` sits outside ``dp_shard`` in both
  orders, so when ``dp`` stays inside nodes the whole ``dp x dp_shard`` group does too, and when ``dp`` is 1 the
  group is the ``dp_shard`` group: exactly the groups the synchronisation spans. One link is charged for both steps
  (the slower one when either crosses: an upper bound of the reduce-scatter on NVLink plus the all-reduce across).
- ``shard_link`` (FSDP2's per-unit all-gathers without pipeline stages): ``dp_shard``.
- ``tp_link`` (the TP all-reduces): ``tp``.
- ``p2p`` (stage-to-stage transfers): ``pp``.
- ``ep_link`` (the expert-parallel all-to-alls, ``cost.experts``): the EP groups (``topology.ep_crosses``), folded
  into the per-rank costs like TP's (:func:`ep_link`).

The DP degree and the pipeline ranks of a plan are chosen inside the layout search (``search.plan_layout``), which
reads one ``p2p`` and one ``dp_link`` for all its candidates. :func:`search_placed` therefore searches the DP degrees
grouped by the links of the plans that fill their devices (``devices // dp`` pipeline ranks), and again, per DP
degree, on fewer devices for every other set of links fewer pipeline ranks give; a chosen plan searched with links
other than its own (a plan leaving ranks idle) is timed again with its own (:func:`retime`), so the returned times
are always those of the plan's own placement, and the search is exact when crossing nodes never gets rarer with
more pipeline ranks and the inter-node link is no faster (:func:`search_placed`).

TP's and FSDP2's links are folded into the per-rank unit costs before the layout search (``sharding.shard_costs``):
they are taken from the option with every device used (:func:`option_links`), exact for FSDP2 without pipeline
stages (the only plans charging ``shard_link``) and for TP whenever ``tp`` divides the node (a TP group then never
crosses) or the plan uses every device. Pure: no torch, no processes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from plait.planner.cost.topology import RANK_ORDERS, crossing_axes, ep_crosses, plan_rank_order
from plait.planner.cost.types import ParallelDegrees
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.layout import evaluate_plan
from plait.planner.search.model import Costs
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits
from plait.planner.types import Unit

__all__ = ["Seeding", "ep_link", "option_links", "placed_machine", "rank_sizes", "retime", "search_placed"]


def rank_sizes(*, tp: int, dp: int, dp_shard: int, pp: int) -> dict[str, int]:
    """The degree per axis of the rank layout (``topology.RANK_AXES``) of a plan: ``dp`` data-parallel ranks per
    stage (all of ``dp x dp_shard``: the replicas are ``dp / dp_shard``), ``pp`` pipeline ranks, CP 1, ``tp``.

    Raises:
        ValueError: on a degree below 1 or a ``dp_shard`` that does not divide ``dp``.
    """
    if min(tp, dp, dp_shard, pp) < 1 or dp % dp_shard:
        raise ValueError(f"degrees must be >= 1 and dp_shard must divide dp, got tp {tp}, dp {dp}, "
                         f"dp_shard {dp_shard}, pp {pp}")
    return {"dp": dp // dp_shard, "dp_shard": dp_shard, "pp": pp, "cp": 1, "tp": tp}


def placed_machine(machine: Machine, *, tp: int, dp: int, dp_shard: int, pp: int,
                   ep: int = 1) -> tuple[Machine, str]:
    """``machine`` with its five links set by where the groups of a plan of these degrees sit (module docstring),
    and the name of the rank order (``topology.RANK_ORDERS``) that places them; ``machine`` itself and
    ``"dp_outer"`` when ``machine.topology`` is None.

    Args:
        machine: the machine searched; tp, dp (all of ``dp x dp_shard``), dp_shard, pp, ep: the plan's degrees
            (``ep`` dividing ``dp``).

    Raises:
        ValueError: as :func:`rank_sizes`.
    """
    topology = machine.topology
    if topology is None:
        return machine, "dp_outer"
    sizes = rank_sizes(tp=tp, dp=dp, dp_shard=dp_shard, pp=pp)
    order = plan_rank_order(sizes, topology.gpus_per_node, ep)
    crossing = set(crossing_axes(RANK_ORDERS[order], sizes, topology.gpus_per_node))
    placed = dataclasses.replace(machine, dp_link=topology.link(bool(crossing & {"dp", "dp_shard"})),
                                 shard_link=topology.link("dp_shard" in crossing),
                                 tp_link=topology.link("tp" in crossing), p2p=topology.link("pp" in crossing),
                                 ep_link=topology.link(ep > 1 and ep_crosses(RANK_ORDERS[order], sizes, ep,
                                                                             topology.gpus_per_node)))
    return placed, order


def option_links(machine: Machine, *, tp: int, dp_shard: int, devices: int) -> tuple[P2PModel | None,
                                                                                     P2PModel | None]:
    """``(tp_link, shard_link)`` of an option searched on ``devices`` devices: the machine's own without a
    topology, else those of the option with every device a data-parallel rank of one stage (``pp = 1``,
    ``dp = devices / tp``, rounded down to a multiple of ``dp_shard``; module docstring: exact for FSDP2's
    all-gathers, which only plans without stages charge, and for TP whenever ``tp`` divides the node or the plan uses
    every device).

    Raises:
        ValueError: on a degree below 1.
    """
    if machine.topology is None:
        return machine.tp_link, machine.shard_link
    if min(tp, dp_shard, devices) < 1:
        raise ValueError(f"tp, dp_shard and devices must be >= 1, got {tp}, {dp_shard}, {devices}")
    dp = max(devices // tp // dp_shard, 1) * dp_shard  # ``degree_options``: exactly devices / tp
    placed, _ = placed_machine(machine, tp=tp, dp=dp, dp_shard=dp_shard, pp=1)
    return placed.tp_link, placed.shard_link


def ep_link(machine: Machine, *, tp: int, dp_shard: int, ep: int, devices: int) -> P2PModel | None:
    """The link of the expert-parallel all-to-alls of an option searched on ``devices`` devices: ``machine.ep_link``
    (else its ``shard_link``) without a topology; else ``topology.inter_link`` when an EP group spans nodes
    (``topology.ep_crosses``) under the rank order of the option with every device a data-parallel rank of one
    stage (as :func:`option_links`). The same holds with stages: ``topology.plan_rank_order`` weighs the EP groups
    right after TP, so a plan's own order keeps them in a node whenever ``pp_outer`` does, which places them as
    the plan without stages does (the data-parallel axes inside the pipeline's).

    Raises:
        ValueError: on a degree below 1 or an ``ep`` not dividing the data-parallel ranks.
    """
    if machine.topology is None:
        return machine.ep_link if machine.ep_link is not None else machine.shard_link
    if min(tp, dp_shard, ep, devices) < 1:
        raise ValueError(f"tp, dp_shard, ep and devices must be >= 1, got {tp}, {dp_shard}, {ep}, {devices}")
    dp = max(devices // tp // dp_shard, 1) * dp_shard
    return placed_machine(machine, tp=tp, dp=dp, dp_shard=dp_shard, pp=1, ep=ep)[0].ep_link


def retime(choice: LayoutChoice, units: Sequence[Unit], costs: Costs, *, machine: Machine, microbatches: int,
           devices: int) -> LayoutChoice:
    """``choice`` with its plan timed again on ``machine``'s links (``search.evaluate_plan`` with its DP degree
    and schedule): the times and ``p2p`` replaced, ``planned_iteration_s`` moved by the same seconds as
    ``iteration_s`` (memory does not depend on the links).

    Args:
        units, costs: the units and the per-rank costs the choice was searched with; microbatches: global per
            step; devices: the devices the search had (``dp x pipeline ranks`` at most).

    Raises:
        ValueError: as ``evaluate_plan`` (a plan that does not match the units).
    """
    timed = evaluate_plan(choice.plan, units, costs, dp=choice.dp, microbatches=microbatches, devices=devices,
                          machine=machine, schedule=choice.schedule)
    delta = timed.iteration_s - choice.iteration_s
    return dataclasses.replace(choice, iteration_s=timed.iteration_s, makespan_s=timed.makespan_s,
                               grad_sync_s=timed.grad_sync_s, bubble_fraction=timed.bubble_fraction, p2p=timed.p2p,
                               update_s=timed.update_s, planned_iteration_s=choice.planned_iteration_s + delta)


def _search_links(machine: Machine) -> tuple[P2PModel | None, P2PModel | None]:
    """The links the layout search itself reads (the others are in the per-rank costs)."""
    return machine.p2p, machine.dp_link


Run = Callable[..., "LayoutChoice | None"]
"""A layout search ``(machine, dp_degrees, devices[, beat]) -> LayoutChoice`` on fixed per-rank costs
(``plan_layout``'s, the DP degrees as ``SearchSpace.dp_degrees``, None: its default); with a time to beat
(seconds), the same plan whenever it is faster, else None or a plan not faster (``layout.plan_layout_below``)."""


@dataclasses.dataclass(frozen=True)
class Seeding:
    """How :func:`search_placed` may stop its searches: ``idle_ranks`` (the layout search may leave ranks idle:
    ``plan_layout``'s; ``plan_filling_layout``'s fill them), ``beat`` (seconds: only plans faster matter) and
    ``seeded`` (``Run`` takes a time to beat: each search after the first stops at the best time so far)."""

    idle_ranks: bool = True
    beat: float = math.inf
    seeded: bool = False


def search_placed(run: Run, time_again: Callable[[LayoutChoice, Machine], LayoutChoice], machine: Machine,
                  dps: Sequence[int] | None, *, devices: int, microbatches: int, degrees: ParallelDegrees,
                  seeding: Seeding = Seeding()) -> LayoutChoice | None:
    """The layout search ``run`` with its links set by where each plan's ranks sit (module docstring).

    The DP degrees (``dps``, default every divisor of ``devices``) are grouped by the links of the plans filling
    their devices (``devices // dp`` pipeline ranks; degrees above ``microbatches`` apart, as ``plan_layout``
    refuses them) and each group is searched on all ``devices`` with its links (one group: one search with ``dps``
    as given). With ``seeding.idle_ranks`` (the search may leave ranks idle: ``plan_layout``), for each DP degree
    and each
    other set of links that fewer pipeline ranks ``p`` give, the search runs again on ``dp x p`` devices (``p`` the
    most ranks with those links) with them. Every chosen plan whose own degrees give other links than it was
    searched with is timed again (``time_again(choice, machine)``, :func:`retime`); the fastest that fits the
    memory cap (else the fastest) is returned with its ``rank_order``, its ``devices`` and lower bound those of
    all ``devices``. Exact (given ``run``) when crossing nodes never gets rarer with more pipeline ranks and the
    inter-node link is no faster (each plan then searched with its own links or slower ones, and exactly once).

    With ``seeding.beat`` finite (seconds; ``run`` then stops at it, ``Run``) the result is the same plan whenever it is
    faster than ``beat``, else None or a plan not faster: under the same conditions the fastest plan is found by
    the search with its own links, where its searched time is its true time (below ``beat``, so that search returns
    what it returns without one), and a plan searched with slower links is timed again only faster. With
    ``seeding.seeded`` (``run`` takes a time to beat even when ``beat`` is infinite) each search after the first
    stops at the best fitting time found so far (ties kept: the first found stays chosen), by the same argument.

    Args:
        run: the layout search (``Run``); time_again: the re-timing of a choice on a machine's links.
        machine: with ``topology`` set; devices: the pipeline "devices" searched (the devices over ``tp``).
        degrees: the option's; its TP degree and FSDP2 shard degree place the ranks (``machine.dp_shard`` may be 1
            where stages are sharded: ``sharding.pipelined_shard_costs``).

    Raises:
        ValueError: as ``run`` (the error of a single search; with several, every search's reason, a
            ``NoPlanFits`` when all of them are; with ``beat`` finite, None when every search found nothing
            faster).
    """
    tp, dp_shard = degrees.tp, degrees.dp_shard
    idle_ranks, beat, seeded = seeding.idle_ranks, seeding.beat, seeding.seeded

    def placed(d: int, pp: int) -> tuple[Machine, str]:
        return placed_machine(machine, tp=tp, dp=d, dp_shard=dp_shard, pp=max(pp, 1), ep=degrees.ep)

    degrees_dp = [d for d in (dps if dps is not None else range(1, devices + 1))
                  if 1 <= d <= devices and d % dp_shard == 0 and d % machine.dp_shard == 0
                  and (dps is not None or devices % d == 0)]
    groups: dict[tuple, tuple[Machine, list[int]]] = {}
    for d in degrees_dp:
        full = placed(d, devices // d)[0]
        groups.setdefault((_search_links(full), d > microbatches), (full, []))[1].append(d)
    if len({links for links, _ in groups}) <= 1:  # one set of links: the search as asked
        searches = [(next(iter(groups.values()))[0] if groups else machine, dps, devices)]
    else:
        searches = [(full, tuple(ds), devices) for full, ds in groups.values()]
    for d in (d for d in degrees_dp if d <= microbatches) if idle_ranks else ():
        full_links, fewer = _search_links(placed(d, devices // d)[0]), {}
        for pp in range(1, devices // d):
            fewer_machine = placed(d, pp)[0]
            if _search_links(fewer_machine) != full_links:
                fewer[_search_links(fewer_machine)] = (fewer_machine, pp)  # the most ranks with these links
        searches += [(fewer_machine, (d,), d * pp) for fewer_machine, pp in fewer.values()]
    # seeded: the searches with the largest DP degrees (the fewest pipeline ranks, the cheapest) first, for an
    # incumbent; each result kept in its search's place, so ties go as without seeding (the first search's plan)
    results: list[LayoutChoice | ValueError | None] = [None] * len(searches)
    order = sorted(range(len(searches)), key=lambda i: -max(searches[i][1] or [devices])) if seeded else \
        range(len(searches))
    for index in order:
        searched, ds, count = searches[index]
        fitting = [c.iteration_s for c in results if isinstance(c, LayoutChoice) and c.fits_memory]
        to_beat = min(beat, math.nextafter(min(fitting), math.inf)) if seeded and fitting else beat
        try:
            choice = run(searched, ds, count) if to_beat == math.inf else run(searched, ds, count, to_beat)
        except ValueError as exc:
            if len(searches) == 1:
                raise
            results[index] = exc
            continue
        if choice is None:  # nothing faster than the time to beat with these links
            continue
        own, rank_order = placed(choice.dp, choice.plan.num_ranks)
        if _search_links(own) != _search_links(searched):
            choice = time_again(choice, own)
        results[index] = dataclasses.replace(choice, rank_order=rank_order, devices=devices,
                                             lower_bound_s=choice.lower_bound_s * choice.devices / devices)
    found = [c for c in results if isinstance(c, LayoutChoice)]
    errors = [e for e in results if isinstance(e, ValueError)]
    if not found and (beat < math.inf and len(errors) < len(searches)):
        return None
    if not found:
        error = NoPlanFits if all(isinstance(e, NoPlanFits) for e in errors) else ValueError
        raise error("; ".join(str(e) for e in errors))
    best = min(found, key=lambda c: (not c.fits_memory, c.iteration_s))
    if len(found) > 1:
        best = dataclasses.replace(best, candidates=sum(c.candidates for c in found),
                                   simulated=sum(c.simulated for c in found))
    return best
