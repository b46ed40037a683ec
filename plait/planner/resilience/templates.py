"""Pipeline templates and their instantiation: the plans of resilient training (Oobleck, SOSP 2023).

- A **pipeline template** is the best plan for one pipeline on exactly ``n`` ranks, from plait's own layout
  search (``search.plan_layout`` with DP degree 1: encoder branches, colocated encoders, interleaved and attached
  schedules alike), with its predicted time ``T(nb) = fixed_s + per_microbatch_s * nb`` for ``nb``
  microbatches. When the search's best plan for ``n`` ranks uses fewer (more ranks do not help), the remaining
  ranks are the pipeline's spares: they hold nothing and a failure there loses nothing.
- :func:`plan_templates` makes one template for every ``n`` from the memory minimum ``n0`` (the fewest ranks
  any plan fits on) to ``N - f * n0``: any ``N'`` with ``(f + 1) n0 <= N' <= N`` ranks is then covered by
  ``f`` pipelines of ``n0`` and one of ``N' - f n0`` (Oobleck's f+1 rule: with at least ``f + 1`` pipelines
  every unit has ``f + 1`` copies, so any ``f`` failures leave one).
- :func:`plan_instantiation` picks pipelines (templates) that use all the given ranks, at least ``f + 1`` of
  them, minimising the predicted iteration time; :func:`distribute_microbatches` spreads the global batch's
  ``M`` microbatches over the pipelines so that they finish together (water-filling: each microbatch to the
  pipeline whose time grows least, exact for the min-max with increasing times). The global batch and its loss
  normalisation (sum of token losses over the target tokens of the whole global batch) never change, so the
  gradients do not depend on the split.

Every rank of an :class:`Instantiation` holds the units of its pipeline's plan rank; a unit's holders (one per
pipeline) are the group its gradients are summed over (``plait.parallel.hetero_dp``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.cost.analytic import trained_params
from plait.planner.cost.sharding import pipelined_optimizer, pipelined_overheads
from plait.planner.cost.types import OptimizerSpec
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.model import Costs, allreduce_s, cost_list
from plait.planner.resilience.types import Instantiation, PipelineInstance, PipelineTemplate, TemplateSet, UnitBytes
from plait.planner.types import Unit

__all__ = ["distribute_microbatches", "instantiate", "node_domains", "plan_instantiation", "plan_templates",
           "units_on_few_domains"]

BEAM = 12
"""Partial pipeline sets kept per (ranks used, pipelines) state of :func:`plan_instantiation`'s search."""

ORDERS = 720
"""Orders of one candidate's pipeline sizes :func:`plan_instantiation` tries when placing them on failure domains."""


def plan_templates(
    units: Sequence[Unit],
    costs: Costs,
    num_ranks: int,
    failures: int,
    *,
    microbatches: int,
    machine: Machine = Machine(),
    space: SearchSpace = SearchSpace(),
    dp_shard: int = 1,
) -> TemplateSet:
    """Pipeline templates for every size from the memory minimum ``n0`` to ``num_ranks - failures * n0``.

    Each template is ``search.plan_layout`` on ``n`` devices with DP degree 1 (``space``: ``layouts``,
    ``virtual_stages``, ``attach_encoders``, ...), fitted to ``fixed_s + per_microbatch_s * nb`` by timing its plan
    (``search.evaluate_plan``) with ``microbatches`` and ``2 * microbatches`` microbatches.

    With ``dp_shard`` > 1 (FSDP2 inside every pipeline, :class:`~plait.planner.resilience.types.TemplateSet`) the
    templates are planned over shard groups: ``num_ranks / dp_shard`` of them, ``microbatches / dp_shard`` per
    shard row, each stage holding whole parameters and gradients during a step and a ``1 / dp_shard`` share of the
    optimizer state and step (``cost.sharding.pipelined_optimizer``, ``pipelined_overheads``: what ``plait train``
    charges FSDP2 under pipeline stages).

    Args:
        units, costs: the model's pipeline units and their costs (as ``plan_layout``).
        num_ranks: worker ranks of the job (``N``; ``N / dp_shard`` shard groups).
        failures: simultaneous failures to tolerate (``f >= 0``; of shard groups when ``dp_shard`` > 1).
        microbatches: microbatches of the global batch (``M``).
        machine: memory cap, ``p2p``, dtype, optimizer, overheads as ``plan_layout``; ``dp_link``: the link of
            the gradient all-reduce between pipelines (not charged within a template).
        space: as ``plan_layout`` (its ``dp_degrees`` replaced by ``(1,)``).
        dp_shard: FSDP2 shard degree inside every pipeline (>= 1).

    Raises:
        ValueError: on bad numbers, ``dp_shard`` not dividing ``N`` and ``M``, when no plan fits on ``N`` ranks,
            or when ``N < (f + 1) n0`` (naming both).
    """
    if int(num_ranks) != num_ranks or num_ranks < 1 or int(failures) != failures or failures < 0:
        raise ValueError(f"num_ranks must be >= 1 and failures >= 0 (integers), got {num_ranks} and {failures}")
    if int(microbatches) != microbatches or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if int(dp_shard) != dp_shard or dp_shard < 1 or num_ranks % dp_shard or microbatches % dp_shard:
        raise ValueError(f"dp_shard {dp_shard!r} must be a positive integer dividing the {num_ranks} ranks and the "
                         f"{microbatches} microbatches of the global batch (each shard row runs its own)")
    num_ranks, microbatches = num_ranks // dp_shard, microbatches // dp_shard
    searched = Machine(memory_cap=machine.memory_cap, p2p=machine.p2p, dtype=machine.dtype,
                       optimizer=pipelined_optimizer(machine.optimizer, dp_shard),
                       overheads=pipelined_overheads(machine.overheads, dp_shard))
    space = dataclasses.replace(space, dp_degrees=(1,))
    true_units = consistent_units(units)
    cost_seq = cost_list(units, costs)
    templates: list[PipelineTemplate] = []
    for n in range(1, num_ranks + 1):
        if templates and n > num_ranks - failures * templates[0].num_ranks:
            break
        try:
            choice = plan_layout(true_units, cost_seq, n, microbatches=microbatches, machine=searched, space=space)
        except ValueError:
            if templates:
                raise
            continue
        templates.append(_template(n, choice.plan, choice.schedule, true_units, cost_seq, microbatches,
                                   dataclasses.replace(searched, memory_cap=None)))
    if not templates:
        raise ValueError(f"no pipeline plan fits on {num_ranks} ranks (memory_cap={machine.memory_cap} bytes)")
    n0 = templates[0].num_ranks
    if num_ranks < (failures + 1) * n0:
        raise ValueError(f"{num_ranks} ranks cannot hold failures + 1 = {failures + 1} pipelines of at least "
                         f"n0 = {n0} ranks (the smallest that fits memory)")
    unit_bytes = tuple(_unit_bytes(u, c, machine.dtype, machine.optimizer) for u, c in zip(true_units, cost_seq))
    return TemplateSet(num_ranks, failures, microbatches, tuple(templates), unit_bytes, machine.dp_link, dp_shard)


def _template(n: int, plan: PipelinePlan, schedule: str, units: Sequence[Unit], costs: Sequence[Any],
              microbatches: int, machine: Machine) -> PipelineTemplate:
    """Time ``plan`` at ``M`` and ``2 M`` microbatches (on ``machine``: the link, dtype, optimizer and runtime
    ``overheads`` it was searched with) and fit the linear makespan."""
    timing = dict(dp=1, machine=machine, schedule=schedule)
    one = evaluate_plan(plan, units, costs, microbatches=microbatches, **timing).makespan_s
    two = evaluate_plan(plan, units, costs, microbatches=2 * microbatches, **timing).makespan_s
    per = max(0.0, (two - one) / microbatches)
    by_name = {u.name: (u, c) for u, c in zip(units, costs)}
    grads = tuple(float(sum(by_name[name][1].param_bytes * by_name[name][0].trained_fraction
                            for s in plan.stages_on_rank(r) for name in plan.stages[s].units))
                  for r in range(plan.num_ranks))
    return PipelineTemplate(n, plan.replace(num_microbatches=1), schedule, max(0.0, one - per * microbatches), per,
                            grads)


def _unit_bytes(unit: Unit, cost: Any, dtype: Any, optimizer: OptimizerSpec) -> UnitBytes:
    """Parameters and optimizer state of one unit (gradients are not copied: the interrupted step is replayed)."""
    state = trained_params(unit, cost, dtype) * optimizer.state_bytes_per_param
    return UnitBytes(unit.name, int(cost.param_bytes), int(round(state)))


def distribute_microbatches(templates: Sequence[PipelineTemplate], microbatches: int) -> tuple[int, ...]:
    """Microbatches per pipeline so that the pipelines finish together: water-filling, one microbatch at a
    time to the pipeline whose makespan after taking it is least (ties: the lower index). Exact for minimising
    the largest makespan, each makespan being increasing in its microbatches (Oobleck section 4.2).

    Raises:
        ValueError: on no pipeline or a negative count.
    """
    if not templates or microbatches < 0:
        raise ValueError(f"need at least one pipeline and microbatches >= 0, got {len(templates)} and "
                         f"{microbatches}")
    counts = [0] * len(templates)
    for _ in range(microbatches):
        best = min(range(len(templates)), key=lambda i: (templates[i].makespan_s(counts[i] + 1), i))
        counts[best] += 1
    return tuple(counts)


def instantiate(templates: TemplateSet, groups: Sequence[Sequence[int]]) -> Instantiation:
    """The instantiation with one pipeline per rank group (``templates.template(len(group))``), microbatches
    water-filled and its predicted iteration time."""
    chosen = [templates.template(len(g)) for g in groups]
    counts = distribute_microbatches(chosen, templates.microbatches)
    pipelines = tuple(PipelineInstance(t, tuple(g), c) for t, g, c in zip(chosen, groups, counts))
    return Instantiation(pipelines, _iteration_s(templates, chosen, counts))


def _iteration_s(templates: TemplateSet, chosen: Sequence[PipelineTemplate], counts: Sequence[int]) -> float:
    """Slowest makespan plus the slowest rank's all-reduce of its gradients over the pipelines (of its shard: a
    ``1 / dp_shard`` share under FSDP2)."""
    makespan = max(t.makespan_s(c) for t, c in zip(chosen, counts))
    grads = max((g for t in chosen for g in t.rank_grad_bytes), default=0.0) / templates.dp_shard
    return makespan + allreduce_s(grads, len(chosen), templates.dp_link)


def plan_instantiation(templates: TemplateSet, ranks: Sequence[int] | None = None,
                       min_pipelines: int | None = None, domains: Mapping[int, int] | None = None) -> Instantiation:
    """Pipelines that use every one of ``ranks`` (default ``0..N-1``), at least ``min_pipelines`` of them
    (default ``f + 1``) and at most ``M``, with the least predicted iteration time. A pipeline of more ranks than
    the largest template (only when no split into templates exists: below ``2 n0`` ranks) runs the largest
    template and keeps the rest as spares.

    Search: a dynamic program over (ranks used, pipelines) that keeps the :data:`BEAM` best multisets of
    template sizes per state by their fluid iteration time (``(M + sum fixed/per) / sum 1/per``, what
    water-filling approaches), then water-fills each complete candidate and keeps the fastest. Ranks are given
    to pipelines in order, largest pipeline first.

    With ``domains`` (rank -> failure domain, e.g. its node), ``f`` counts domains: every unit's copies must lie
    in at least ``f + 1`` domains (:func:`units_on_few_domains`), so that losing any ``f`` nodes at once leaves a
    copy. The ranks (sorted by domain, then rank) are given to the pipelines in order, each candidate's sizes tried
    in up to :data:`ORDERS` orders; the fastest candidate with a valid order wins.

    Raises:
        ValueError: when no set of templates covers the ranks with enough pipelines (naming the counts), or no
            candidate spreads every unit over ``f + 1`` domains (naming the domains' sizes).
    """
    ranks = list(range(templates.num_ranks)) if ranks is None else sorted(int(r) for r in ranks)
    need = templates.failures + 1 if min_pipelines is None else int(min_pipelines)
    total = len(ranks)
    cap = min(total // templates.min_ranks, templates.microbatches)
    if need < 1 or need > cap:
        raise ValueError(f"{total} ranks cannot hold {need} pipelines of at least {templates.min_ranks} ranks "
                         f"(and at most {templates.microbatches}, one microbatch each)")
    candidates = _size_multisets(templates, total, need, cap)
    if not candidates:
        raise ValueError(f"no set of templates ({templates.min_ranks}..{templates.max_ranks} ranks) covers "
                         f"{total} ranks with at least {need} pipelines")
    if domains is not None:
        ranks.sort(key=lambda r: (domains[r], r))
    timed = sorted((instantiate(templates, _groups(ranks, sorted(sizes, reverse=True))) for sizes in candidates),
                   key=lambda inst: inst.iteration_s)
    if domains is None:
        return timed[0]
    for inst in timed:
        sizes = [len(p.ranks) for p in inst.pipelines]
        for order in itertools.islice(dict.fromkeys(itertools.permutations(sizes)), ORDERS):
            placed = instantiate(templates, _groups(ranks, order))
            if not units_on_few_domains(placed, domains, templates.failures + 1):
                return placed
    per_domain = {d: sum(1 for r in ranks if domains[r] == d) for d in sorted({domains[r] for r in ranks})}
    raise ValueError(f"no instantiation over {total} ranks puts every unit's copies on {templates.failures + 1} "
                     f"failure domains (f = {templates.failures} counts domains; ranks per domain {per_domain})")


def _groups(ranks: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """``ranks`` cut into consecutive groups of ``sizes``."""
    starts = list(itertools.accumulate(sizes, initial=0))
    return [list(ranks[a:a + n]) for a, n in zip(starts, sizes)]


def node_domains(num_ranks: int, nodes: int) -> dict[int, int] | None:
    """Rank -> node of ``num_ranks`` ranks numbered node by node over ``nodes`` nodes of ``num_ranks / nodes`` each
    (the failure domains of :func:`plan_instantiation`); None on one node."""
    per_node = num_ranks // nodes
    return None if nodes == 1 else {r: r // per_node for r in range(num_ranks)}


def units_on_few_domains(inst: Instantiation, domains: Mapping[int, int], copies: int) -> tuple[str, ...]:
    """The units whose holders (one per pipeline) lie in fewer than ``copies`` failure domains (``domains``: rank
    -> domain, e.g. its node): losing ``copies - 1`` such domains at once could take every copy. Empty when each
    unit is spread far enough. Units in the first pipeline's order.

    Raises:
        KeyError: when a rank has no domain.
    """
    if not inst.pipelines:
        return ()
    names = [u for r in inst.pipelines[0].ranks for u in inst.pipelines[0].units_of(r)]
    return tuple(u for u in names if len({domains[r] for r in inst.holders(u)}) < copies)


def _size_multisets(templates: TemplateSet, total: int, need: int, cap: int) -> list[tuple[int, ...]]:
    """Candidate multisets of template sizes summing to ``total`` with ``need..cap`` members (beam DP)."""
    # a group between the largest template and 2 n0 - 1 ranks cannot be split into templates: it runs the largest
    # one with spares (larger groups split)
    sizes = [t.num_ranks for t in templates.templates] + list(range(templates.max_ranks + 1, 2 * templates.min_ranks))
    by_size = {n: templates.template(n) for n in sizes}
    states: dict[tuple[int, int], list[tuple[int, ...]]] = {(0, 0): [()]}
    for used in range(total):
        for count in range(cap):
            for partial in _prune(states.get((used, count), []), by_size, templates.microbatches):
                for size in sizes:
                    if used + size <= total and (not partial or size <= partial[-1]):  # each multiset once
                        states.setdefault((used + size, count + 1), []).append(partial + (size,))
    return [s for count in range(need, cap + 1)
            for s in _prune(states.get((total, count), []), by_size, templates.microbatches)]


def _prune(multisets: list[tuple[int, ...]], by_size: dict[int, PipelineTemplate], microbatches: int
           ) -> list[tuple[int, ...]]:
    """The :data:`BEAM` best distinct multisets by fluid iteration time."""
    unique = list(dict.fromkeys(multisets))
    if len(unique) <= BEAM:
        return unique
    return sorted(unique, key=lambda s: _fluid_s([by_size[n] for n in s], microbatches))[:BEAM]


def _fluid_s(chosen: Sequence[PipelineTemplate], microbatches: int) -> float:
    """Iteration time if microbatches were divisible: ``T`` with ``sum (T - fixed_i) / per_i = M``."""
    if any(t.per_microbatch_s <= 0 for t in chosen):
        return max(t.fixed_s for t in chosen)
    rate = math.fsum(1.0 / t.per_microbatch_s for t in chosen)
    return (microbatches + math.fsum(t.fixed_s / t.per_microbatch_s for t in chosen)) / rate
