"""Reconfiguration after losing ranks: the survivors' new pipelines and the state each must receive (Oobleck,
SOSP 2023, section 5).

:func:`plan_reconfiguration` takes the running :class:`~plait.planner.resilience.types.Instantiation` and the failed
ranks and, as the paper does:

1. refuses when some unit has lost every copy (more than ``f`` failures hit all its holders), naming the lost
   units and pointing to the last checkpoint;
2. keeps each pipeline's survivors in their order and **shrinks** it to the template of its new size;
3. a pipeline left below the minimum ``n0`` **borrows** ranks from the largest pipeline that stays at ``n0`` or
   more after lending; when none can lend, it **merges** with the smallest other pipeline;
4. a pipeline above the largest template (after a merge) is split in two when both halves fit a template, else
   keeps its extra ranks as spares;
5. redistributes the global batch's microbatches over the new pipelines (water-filling; the global batch and
   its loss normalisation are unchanged);
6. lists, for every rank, the units whose parameters and optimizer state it must receive and from which
   surviving holder (load spread over holders), with the bytes.

Everything is pure: the runtime (``plait.parallel``) executes the transfers and rebuilds its stages and groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from plait.planner.resilience.templates import instantiate, plan_instantiation
from plait.planner.resilience.types import Instantiation, LostUnitsError, Reconfiguration, TemplateSet, Transfer

__all__ = ["check_instantiation", "plan_reconfiguration", "plan_rejoin"]


def plan_reconfiguration(templates: TemplateSet, current: Instantiation, failed: Iterable[int]) -> Reconfiguration:
    """The survivors' new instantiation after ``failed`` ranks are lost, and the copies it needs (module
    docstring).

    Raises:
        ValueError: when a failed rank is not in ``current``, or fewer than ``n0`` ranks survive.
        LostUnitsError: (a ``ValueError``) when some unit has no surviving copy, naming the units.
    """
    failed_set = {int(r) for r in failed}
    unknown = sorted(failed_set - set(current.ranks))
    if unknown:
        raise ValueError(f"failed ranks {unknown} are not in the instantiation (ranks {list(current.ranks)})")
    failed_t = tuple(sorted(failed_set))
    _check_copies(templates, current, failed_set, failed_t)
    groups = [[r for r in p.ranks if r not in failed_set] for p in current.pipelines]
    noun = templates.rank_noun  # ranks, or shard groups of dp_shard workers
    actions = [f"pipeline {i} shrinks {len(p.ranks)} -> {len(g)} {noun}"
               for i, (p, g) in enumerate(zip(current.pipelines, groups)) if 0 < len(g) < len(p.ranks)]
    actions += [f"pipeline {i} lost every {noun[:-1]}" for i, g in enumerate(groups) if not g]
    groups = [g for g in groups if g]
    _fix_small(templates, groups, actions)
    groups = _split_large(templates, groups, actions)
    after = instantiate(templates, groups)
    return Reconfiguration(failed_t, current, after, _transfers(templates, current, after), tuple(actions))


def plan_rejoin(templates: TemplateSet, current: Instantiation, joined: Iterable[int],
                domains: Mapping[int, int] | None = None) -> Reconfiguration:
    """Scale back up: ranks ``joined`` (restarted or new, holding nothing) join at a step boundary; the job
    re-instantiates over every rank (``plan_instantiation``, with ``domains``: every unit's copies on ``f + 1``
    failure domains when some instantiation can, else the fastest) and each rank receives the units it now holds
    but did not hold before from a current holder (a joiner receives all of its units).

    Raises:
        ValueError: when a joining rank is already in ``current``, or no instantiation covers the ranks.
    """
    joined_t = tuple(sorted({int(r) for r in joined}))
    again = sorted(set(joined_t) & set(current.ranks))
    if again:
        raise ValueError(f"ranks {again} are already in the instantiation and cannot join")
    ranks = sorted(current.ranks + joined_t)
    try:
        after = plan_instantiation(templates, ranks, domains=domains)
        spread = "" if domains is None else f", every unit on {templates.failures + 1} failure domains"
    except ValueError:
        if domains is None:
            raise
        after = plan_instantiation(templates, ranks)
        spread = f", some unit on fewer than {templates.failures + 1} failure domains (none can be spread)"
    action = f"ranks {list(joined_t)} join; re-instantiated over {len(after.ranks)} ranks{spread}"
    return Reconfiguration((), current, after, _transfers(templates, current, after), (action,))


def _check_copies(templates: TemplateSet, current: Instantiation, failed: set[int], failed_t: tuple[int, ...]) -> None:
    lost = tuple(u.name for u in templates.units if all(h in failed for h in current.holders(u.name)))
    if lost:
        raise LostUnitsError(lost, failed_t)
    survivors = len(current.ranks) - len(failed)
    if survivors < templates.min_ranks:
        raise ValueError(f"only {survivors} ranks survive ranks {list(failed_t)} failing: a pipeline needs "
                         f"{templates.min_ranks}; resume from the last checkpoint")


def _fix_small(templates: TemplateSet, groups: list[list[int]], actions: list[str]) -> None:
    """Borrow ranks for groups below ``n0`` from the largest group that can lend, else merge (in place)."""
    n0 = templates.min_ranks
    while (small := next((i for i, g in enumerate(groups) if len(g) < n0), None)) is not None:
        need = n0 - len(groups[small])
        lenders = [i for i, g in enumerate(groups) if i != small and len(g) - need >= n0]
        if lenders:
            lender = max(lenders, key=lambda i: (len(groups[i]), -i))
            moved = groups[lender][-need:]
            del groups[lender][-need:]
            groups[small].extend(moved)
            actions.append(f"a pipeline borrows {templates.rank_noun} {moved} from one of "
                           f"{len(groups[lender]) + need} {templates.rank_noun}")
            continue
        others = [i for i in range(len(groups)) if i != small]
        partner = min(others, key=lambda i: (len(groups[i]), i))  # _check_copies: the survivors fill one
        actions.append(f"pipelines of {len(groups[small])} and {len(groups[partner])} {templates.rank_noun} merge")
        first, second = sorted((small, partner))
        groups[first].extend(groups.pop(second))


def _split_large(templates: TemplateSet, groups: list[list[int]], actions: list[str]) -> list[list[int]]:
    """Split a group above the largest template in two when both parts fit templates (else it keeps spares)."""
    out = []
    for g in groups:
        if len(g) > templates.max_ranks and len(g) - templates.max_ranks >= templates.min_ranks:
            cut = max(templates.min_ranks, len(g) - templates.max_ranks, len(g) // 2)
            cut = min(cut, templates.max_ranks)
            actions.append(f"a merged pipeline of {len(g)} {templates.rank_noun} splits into {cut} + {len(g) - cut}")
            out += [g[:cut], g[cut:]]
        else:
            out.append(g)
    return out


def _transfers(templates: TemplateSet, before: Instantiation, after: Instantiation) -> tuple[Transfer, ...]:
    """For every rank of ``after``, each unit it holds but did not hold ``before``, from the surviving holder
    that has sent the fewest bytes so far (ties: the lowest rank)."""
    sizes = templates.unit_bytes()
    alive = set(after.ranks)
    order = {u.name: i for i, u in enumerate(templates.units)}
    sent: dict[int, int] = {}
    out = []
    for rank in after.ranks:
        had = set(before.units_of(rank)) if rank in before.ranks else set()  # a joiner holds nothing
        for unit in sorted(set(after.units_of(rank)) - had, key=order.__getitem__):
            sources = [h for h in before.holders(unit) if h in alive]
            src = min(sources, key=lambda h: (sent.get(h, 0), h))
            size = sizes[unit]
            sent[src] = sent.get(src, 0) + size.param_bytes + size.state_bytes
            out.append(Transfer(unit, src, rank, size.param_bytes, size.state_bytes))
    return tuple(out)


def check_instantiation(templates: TemplateSet, inst: Instantiation) -> None:
    """Check that ``inst`` is a valid plan over ``templates``: every pipeline's template is the set's for its
    size, every pipeline holds every unit exactly once, and the microbatches sum to the global batch's.

    Raises:
        ValueError: naming the first violation.
    """
    names = [u.name for u in templates.units]
    for index, pipeline in enumerate(inst.pipelines):
        if pipeline.template != templates.template(len(pipeline.ranks)):
            raise ValueError(f"pipeline {index} ({len(pipeline.ranks)} ranks) does not use the set's template")
        held = sorted(u for r in pipeline.ranks for u in pipeline.units_of(r))
        if held != sorted(names):
            raise ValueError(f"pipeline {index} does not hold every unit exactly once")
    if inst.microbatches != templates.microbatches:
        raise ValueError(f"the pipelines run {inst.microbatches} microbatches, the global batch has "
                         f"{templates.microbatches}")
