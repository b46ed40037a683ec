"""Per-encoder data-parallel degrees: plans whose encoder stages are replicated over several ranks.

A frozen 0.4B vision tower does not need the LLM's pipeline degrees; it needs enough replicas to keep up. With
``[parallel.pp] encoder_dp = {vision = r}`` each stage of the branch runs on ``r`` ranks (``plan.plan_pipeline(...,
replicas=)``: ``r`` stages with the same units, ``Stage.replica`` ``0..r-1``), each taking an equal share of every
microbatch's rows of the branch and sending its share of the features to the same successor (heterogeneous degrees
per submodule: DistMM, NSDI'24; MegatronMIMO's encoder beside the LLM under its own parallelism). The cost model
of a replica (``simulator.stage_costs_from_units``, ``search.evaluate_plan``):

- compute (forward, input and weight gradients, recomputation) and activations of its branch divided by ``r``
  (:func:`replicated_costs`; the features it sends too); parameters, gradients and optimizer state whole on each
  replica rank;
- a trainable replicated stage's gradients all-reduced over its ``r`` replicas times the ``dp`` pipeline replicas
  (``search.model.grad_sync_s`` over ``r x dp`` ranks on ``Machine.dp_link``) after the flush, with the optimizer
  step of its whole gradient.

A branch may instead run each stage as a tensor-parallel group (``[parallel.pp] encoder_tp = {vision = t}``,
``plan_pipeline(..., tensor_parallel=)``; Megatron-LM's split, Shoeybi et al. 2019, section 3): each of its ``t`` ranks
runs every row with its layers' passes, parameters and split activations divided by ``t`` plus two all-reduces of the
layer's output per pass (``cost.sharding.tp_unit_cost``, the rule of ``parallel.tp``), sends (receives) the whole
features (their gradient), and its shards' gradients are all-reduced over the ``dp`` pipeline replicas only. It pays
where rows cannot be split (one sample per microbatch) or one heavy layer is the bottleneck no pipeline cut splits.

The search (:func:`plan_replicated`, called by ``search.plan_layout`` when ``SearchSpace.encoder_dp`` or
``SearchSpace.encoder_tp`` allows a degree above 1) weighs, for ``encoder_parallel`` plans with every stage on its own rank and 1F1B, every vector of
per-branch degrees (:func:`copy_vectors`: replicas or a TP group, powers of two up to the branch's bounds), DP degree, stages per encoder and LLM ranks with
``dp x (sum of encoder stages x their degree + LLM ranks) <= devices``. One replica of a stage in lockstep with the
others is timed as one stage with the divided costs (the replicas run in parallel, each on its own rank), so each
candidate is a ``search.model`` candidate on the divided costs (minimum-bottleneck partitions, memory caps) timed
with ``candidates.time_1f1b``, plus the first LLM stage's receive overheads of the extra messages. Candidates go in
increasing lower bound (``microbatches per replica x`` the largest stage's work of the plain partitions) and then
``bounds.stage_bounds`` plus the gradient synchronisation; the search stops when a bound reaches the best time or
when ``SearchSpace.max_timed`` candidates were made concrete (exact over the candidates below that many bounds). The
chosen plan is timed again with ``evaluate_plan`` (the simulator itself) by ``plan_layout``, which
keeps the homogeneous plan (every degree 1) when it is not slower. Pure: no torch, no files.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from plait.planner.cost.sharding import tp_unit_cost
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.plan import plan_pipeline, stage_ranks
from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.search.bounds import stage_bounds
from plait.planner.search.candidates import time_1f1b
from plait.planner.search.model import (CandidateStages, Costs, Partitions, SearchModel, build_stages, cost_list,
                                        flush_s, in_flight)
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["IN_BUBBLE_TIMED", "Copies", "InBubble", "Replicated", "copy_vectors", "degree_vectors", "encoder_dp_bounds",
           "encoder_tp_bounds", "in_bubble_candidates", "plan_replicated", "replicated_costs"]


def replicated_costs(units: Sequence[Unit], costs: Costs, replicas: Mapping[str, int], tp: Collection[str] = (),
                     tp_link: P2PModel | None = None) -> list[UnitCost]:
    """The per-replica costs of ``units`` when encoder branch ``m`` runs on ``replicas[m]`` ranks: its units'
    forward, input- and weight-gradient and recomputation seconds, activation and output bytes divided by the degree
    (a replica's equal share of every microbatch's rows); parameter bytes whole (each replica holds the branch).
    A branch in ``tp`` runs as a tensor-parallel group of ``replicas[m]`` ranks instead: each rank's costs by the TP
    rule (``cost.sharding.tp_unit_cost`` on ``tp_link``: its layers divided, their all-reduces added; every row).

    Raises:
        ValueError: on a degree below 1, a branch that is not an encoder module of ``units``, or as ``cost_list``.
    """
    per_unit = cost_list(units, costs)
    encoders = {u.module for u in units if u.module != LLM_MODULE}
    unknown = sorted(set(replicas) - encoders)
    if unknown or any(int(r) < 1 for r in replicas.values()):
        raise ValueError(f"encoder_dp names {unknown or dict(replicas)}: degrees must be >= 1 for encoder branches "
                         f"of the model ({sorted(encoders)})")
    out = []
    for unit, cost in zip(units, per_unit):
        r = int(replicas.get(unit.module, 1))
        if unit.module in tp:
            out.append(tp_unit_cost(unit, cost, r, tp_link))
            continue
        out.append(cost if r == 1 else dataclasses.replace(
            cost, forward_s=cost.forward_s / r, input_grad_s=cost.input_grad_s / r,
            weight_grad_s=cost.weight_grad_s / r, recompute_s=cost.recompute_s / r,
            activation_bytes=-(-cost.activation_bytes // r), output_bytes=-(-cost.output_bytes // r),
            **cost.split_mapped(lambda b: b / r, lambda w: w / r)))
    return out


def encoder_dp_bounds(units: Sequence[Unit], rows: int) -> tuple[tuple[str, int], ...]:
    """``SearchSpace.encoder_dp`` for a job whose microbatches hold ``rows`` samples: every encoder branch of
    ``units`` bounded by them (a replica takes at least one row); ``()`` for one row per microbatch."""
    if rows <= 1:
        return ()
    return tuple((m, int(rows)) for m in dict.fromkeys(u.module for u in units) if m != LLM_MODULE)


def encoder_tp_bounds(heads: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """``SearchSpace.encoder_tp`` from each encoder branch's attention heads: the largest power of two dividing them
    (every TP degree searched, a power of two up to it, then divides the heads: whole heads per TP rank); branches
    whose heads are odd (or unknown, 0) are left out."""
    out = []
    for m, h in heads.items():
        top = int(h) & -int(h) if int(h) > 0 else 0  # the largest power of two dividing h
        if top > 1:
            out.append((m, top))
    return tuple(out)


def degree_vectors(encoders: Sequence[str], limits: Mapping[str, int], most: int) -> list[dict[str, int]]:
    """Every vector of per-branch degrees searched: for each encoder, the powers of two up to ``limits`` (1 for a
    branch not named) and up to ``most`` (the devices less one for the LLM on own ranks; the devices in the LLM's
    bubbles), except all ones."""
    options = [[1 << k for k in range(32) if (1 << k) <= min(int(limits.get(m, 1)), max(most, 1))]
               for m in encoders]
    return [dict(zip(encoders, combo)) for combo in itertools.product(*options) if max(combo, default=1) > 1]


Copies = tuple[dict[str, int], frozenset[str]]
"""A degree vector: per encoder branch its ranks per stage, and the branches whose copies form a TP group."""


def copy_vectors(encoders: Sequence[str], dp_limits: Mapping[str, int], tp_limits: Mapping[str, int],
                 most: int) -> list[Copies]:
    """Every degree vector of the search on own ranks: for each encoder, degree 1, its data-parallel degrees (powers
    of two up to ``dp_limits``) and its tensor-parallel degrees (powers of two up to ``tp_limits``), each at most
    ``most``; except all ones. Replicas first, as :func:`degree_vectors` lists them."""
    options = []
    for m in encoders:
        top = max(most, 1)
        dp = [(1 << k, False) for k in range(1, 32) if (1 << k) <= min(int(dp_limits.get(m, 1)), top)]
        tp = [(1 << k, True) for k in range(1, 32) if (1 << k) <= min(int(tp_limits.get(m, 1)), top)]
        options.append([(1, False), *dp, *tp])
    return [({m: d for m, (d, _) in zip(encoders, combo)}, frozenset(m for m, (_, t) in zip(encoders, combo) if t))
            for combo in itertools.product(*options) if max(d for d, _ in combo) > 1]


def plan_replicated(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int, machine: Machine,
                    space: SearchSpace, dps: Sequence[int], beat: float = math.inf) -> Replicated | None:
    """The fastest ``encoder_parallel`` 1F1B plan with some encoder branch replicated or tensor-parallel (module
    docstring) whose time is below ``beat`` seconds; None when there is none, the model has no encoder,
    ``space.encoder_dp`` and ``space.encoder_tp`` allow only degree 1 or the costs are FSDP2 shards
    (``machine.dp_shard > 1``: not searched).

    Args:
        units, costs: as ``plan_layout``; devices: the devices searched (``dp x ranks <= devices``).
        microbatches: global per step; machine: cap, links, dtype, optimizer, overheads (``p2p`` set).
        space: ``encoder_dp`` (the most replicas per branch), ``encoder_tp`` (the most TP degree per branch),
            ``frozen_aware``, ``rel_tol``.
        dps: the DP degrees searched (``plan_layout``'s).

    Returns:
        The best plan with its DP degree and the search's time (``Replicated``; ``plan_layout`` times it again with
        ``evaluate_plan``), or None.
    """
    units = consistent_units(units)
    encoders = [m for m in dict.fromkeys(u.module for u in units) if m != LLM_MODULE]
    vectors = copy_vectors(encoders, dict(space.encoder_dp), dict(space.encoder_tp), devices - 1)
    if not vectors or machine.dp_shard != 1 or not space.frozen_aware:
        return None
    p2p = machine.p2p or P2PModel()
    searched = _searched(units, costs, vectors, machine)
    streams = [(index, dp, found) for index, (replicas, _, parts) in enumerate(searched) for dp in dps
               if (found := _first_bounds((parts, searched[0][2]), replicas, dp, devices, microbatches,
                                       beat / (1 + space.rel_tol))) is not None]
    # (bound, devices used, stream, position, counts): each stream's next candidate, or a concrete one (counts -1)
    heap: list[tuple[float, int, int, int, tuple[int, ...]]] = [
        (float(bounds[0]), 0, k, 0, ()) for k, (_, _, (bounds, _)) in enumerate(streams)]
    heapq.heapify(heap)
    refined: dict[tuple[int, int], CandidateStages] = {}  # concrete candidates in the heap
    best: tuple[float, int, int, int, CandidateStages] | None = None
    budget = space.max_timed  # candidates made concrete, in increasing bound (exact over them)
    while heap and heap[0][0] * (1 + space.rel_tol) < (beat if best is None else min(beat, best[0])):
        bound, used, k, position, counts = heapq.heappop(heap)
        index, dp, (bounds, grid) = streams[k]
        replicas, tp, parts = searched[index]
        summed = {m: r for m, r in replicas.items() if m not in tp}  # a TP stage's shards: over the DP replicas only
        nb = -(-microbatches // dp)
        if counts:  # a concrete candidate whose second bound is again the smallest: time it
            st = refined.pop((k, position))
            total = time_1f1b(st, nb) + _sync(parts, st, summed, dp, machine)
            if best is None or (total, used) < best[:2]:
                best = (total, used, index, dp, st)
            continue
        if position + 1 < len(bounds):
            heapq.heappush(heap, (float(bounds[position + 1]), 0, k, position + 1, ()))
        if budget <= 0:
            break
        budget -= 1
        counts = tuple(int(x) for x in grid[position])
        st = build_stages(parts, "encoder_parallel", counts, nb, p2p)
        if st is None:
            continue
        _add_messages(parts, st, replicas, p2p)
        tight = max(bound, max(stage_bounds(st, nb)) + _sync(parts, st, summed, dp, machine))
        refined[(k, position)] = st
        heapq.heappush(heap, (tight, dp * _ranks(encoders, replicas, counts), k, position, counts))
    if best is None:
        return None
    planned, _, index, dp, st = best
    replicas, tp, parts = searched[index]
    return Replicated(_plan_of(parts.model, st, replicas, tp), dp, planned, len(heap), len(searched))


class Replicated(NamedTuple):
    """The best replicated candidate of :func:`plan_replicated`."""

    plan: PipelinePlan  # its stages, replicated encoder stages included
    dp: int  # pipeline replicas
    planned_s: float  # the search's iteration time (s)
    left: int  # candidates left unexamined in the heap (bounded out)
    vectors: int  # degree vectors searched


IN_BUBBLE_TIMED = 8
"""The most in-bubble candidates with replicated encoders ``plan_layout`` times (in increasing bound)."""


class InBubble(NamedTuple):
    """A candidate of :func:`in_bubble_candidates`: its lower bound (s), devices used, DP degree, per-branch degrees
    and the LLM's stage boundaries (``plan_pipeline``'s ``splits``); :meth:`plan` builds it."""

    bound: float
    devices: int
    dp: int
    replicas: tuple[tuple[str, int], ...]
    llm_ranks: int
    llm_splits: tuple[str, ...]

    def plan(self, units: Sequence[Unit]) -> PipelinePlan:
        """The candidate's ``PipelinePlan``: each encoder branch one stage of its replicas, on the LLM ranks from the
        last (``plan.stage_ranks(..., in_bubble=True)``), the LLM one stage per rank."""
        encoder_stages = sum(r for _, r in self.replicas)
        return plan_pipeline(units, "encoder_parallel", splits={LLM_MODULE: list(self.llm_splits)},
                             replicas={m: r for m, r in self.replicas if r > 1},
                             ranks=stage_ranks(encoder_stages, self.llm_ranks, in_bubble=True))


def in_bubble_candidates(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int, machine: Machine,
                         space: SearchSpace, dps: Sequence[int]) -> list[InBubble]:
    """Plans whose encoder branches are one stage each, replicated over the LLM ranks (``stage_ranks(...,
    in_bubble=True)``: replica ``k`` of the encoder stages on LLM rank ``p - 1 - k``, its work in that rank's
    bubbles, Optimus, ATC'25) with some degree above 1 (at most ``p`` replicas per branch), for every degree vector,
    DP degree and LLM rank count ``p >= 2``, the LLM in its minimum-bottleneck partition; sorted by a lower bound valid
    for the in-bubble schedules (each LLM stage's actions in 1F1B order): per LLM rank, microbatch 0's encoder forward
    and the LLM forwards before the rank, ``microbatches per replica x`` its work (its LLM stage and the encoder
    replicas on it), then the LLM backwards before it. ``plan_layout`` times them with the in-bubble schedules in that
    order while a bound is below its best time, at most ``IN_BUBBLE_TIMED`` of them (the list-scheduled orders take
    tenths of a second each on a large plan).
    Empty under ``space.encoder_dp`` of degree 1 only, without ``space.in_bubble`` or with FSDP2 shard costs."""
    units = consistent_units(units)
    encoders = [m for m in dict.fromkeys(u.module for u in units) if m != LLM_MODULE]
    vectors = degree_vectors(encoders, dict(space.encoder_dp), devices)
    if not vectors or not space.in_bubble or machine.dp_shard != 1 or not space.frozen_aware:
        return []
    out = []
    searched = _searched(units, costs, [(v, frozenset()) for v in vectors], machine)
    llm_parts = searched[0][2]  # the LLM's units are not replicated: one set of its partitions for every vector
    for replicas, _, parts in searched:
        model = parts.model
        shares = [(model.total("W", *model.span[m]), replicas[m]) for m in encoders]
        arrive = max(model.total("F", *model.span[m]) for m in encoders)  # microbatch 0's features reach the LLM
        for dp in dps:
            nb, pipe = -(-microbatches // dp), devices // dp
            for p in range(max(2, max(replicas.values())), min(model.size(LLM_MODULE), pipe) + 1):
                ranges = llm_parts.fitted(LLM_MODULE, p, in_flight(p, 0, nb))
                if ranges is None:
                    continue
                busy = [model.total("W", a, b) for a, b in ranges]
                k = 0
                for work, r in shares:
                    for _ in range(r):
                        busy[p - 1 - k % p] += work
                        k += 1
                # LLM rank j: microbatch 0's forwards before it, its busy time, the backwards before it after
                fill = drain = 0.0
                bound = 0.0
                for j, (a, b) in enumerate(ranges):
                    bound = max(bound, arrive + fill + nb * busy[j] + drain)
                    fill += model.total("F", a, b)
                    drain += model.total("B", a, b)
                splits = tuple(model.units[a].name for a, _ in ranges[1:])
                out.append(InBubble(bound, dp * p, dp, tuple(replicas.items()), p, splits))
    return sorted(out, key=lambda c: (c.bound, c.devices))


def _searched(units: Sequence[Unit], costs: Costs, vectors: Sequence[Copies],
              machine: Machine) -> list[tuple[dict[str, int], frozenset[str], Partitions]]:
    """Per degree vector, the search model of its per-replica (per TP rank) costs (frozen-aware) and its partitions;
    TP all-reduces on ``machine.tp_link`` (default ``p2p``, as ``evaluate_plan``)."""
    out = []
    link = machine.tp_link or machine.p2p or P2PModel()
    for replicas, tp in vectors:
        model = SearchModel(units, replicated_costs(units, costs, replicas, tp, link), True, machine.dtype,
                            machine.optimizer, machine.overheads)
        out.append((replicas, tp, Partitions(model, machine.memory_cap)))
    return out


def _ranks(encoders: Sequence[str], replicas: Mapping[str, int], counts: Sequence[int]) -> int:
    """Pipeline ranks of a candidate: every encoder stage times its branch's degree, plus the LLM ranks."""
    return sum(s * replicas[m] for m, s in zip(encoders, counts)) + counts[-1]


def _first_bounds(both: tuple[Partitions, Partitions], replicas: Mapping[str, int], dp: int, devices: int,
                  microbatches: int, below: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Every (stages per encoder, LLM ranks) of one degree vector and DP degree fitting ``devices // dp`` ranks whose
    lower bound is below ``below`` seconds: ``(bounds, counts)`` sorted by bound (None when none is). The bound,
    vectorised over the grid of stage counts, is the largest of: per encoder branch, the microbatches per replica
    ``nb`` times the largest stage's work of its plain minimum-bottleneck partition (no partition has a smaller
    one), plus, for a forward-only branch, the LLM's forward and backward of the last microbatch after it; ``nb`` x
    the LLM's largest stage plus microbatch 0's slowest encoder forward before it. ``both``: the degree vector's
    partitions and those shared for the LLM (its units are never replicated)."""
    parts, llm_parts = both
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    encoders = model.encoders
    llm_path = model.total("F", *model.span[LLM_MODULE]) + model.total("B", *model.span[LLM_MODULE])
    arrive = max(model.total("F", *model.span[m]) for m in encoders)
    grids, terms, ranks = [], [], []
    axes = len(encoders) + 1
    for axis, module in enumerate([*encoders, LLM_MODULE]):
        r = replicas.get(module, 1)
        room = pipe - sum(replicas[m] for m in encoders if m != module) - (1 if module != LLM_MODULE else 0)
        top = min(model.max_stages(module), room // r)
        if top < 1:
            return None
        shape = [1] * axes
        shape[axis] = top
        stages = np.arange(1, top + 1)
        grids.append(stages.reshape(shape))
        ranks.append((stages * r).reshape(shape))
        chains = llm_parts if module == LLM_MODULE else parts
        neck = nb * np.array([max(model.total("W", a, b) for a, b in chains.plain(module, s)) for s in stages])
        a, b = model.span[module]
        after = arrive if module == LLM_MODULE else (0.0 if any(model.runs_backward[a:b]) else llm_path)
        terms.append((neck + after).reshape(shape))
    bound = np.maximum.reduce(np.broadcast_arrays(*terms))
    keep = (np.broadcast_to(sum(ranks) <= pipe, bound.shape) & (bound < below)).ravel()
    if not keep.any():
        return None
    counts = np.stack([g.ravel() for g in np.broadcast_arrays(*grids)], axis=1)[keep]
    bounds = bound.ravel()[keep]
    order = np.lexsort((counts.sum(axis=1), bounds))
    return bounds[order], counts[order]


def _module_of(parts: Partitions, st: CandidateStages, stage: int) -> str:
    return parts.model.units[st.chunks[stage][0][0]].module


def _add_messages(parts: Partitions, st: CandidateStages, replicas: Mapping[str, int], p2p: P2PModel) -> None:
    """The LogP overheads of the extra messages (``simulator``): the first LLM stage receives one message per
    replica of each branch's last stage (and, when both run a backward, sends its gradient to each); the search's
    stages count one (``model._add_overheads``)."""
    first = next(s for s in range(len(st.chunks)) if _module_of(parts, st, s) == LLM_MODULE)
    for s in st.preds[first]:
        extra = replicas.get(_module_of(parts, st, s), 1) - 1
        st.forward[first] += extra * p2p.recv_overhead_s
        if st.runs_backward[s] and st.runs_backward[first]:
            st.backward[first] += extra * p2p.send_overhead_s


def _sync(parts: Partitions, st: CandidateStages, replicas: Mapping[str, int], dp: int, machine: Machine) -> float:
    """After the flush: the slowest stage's gradient synchronisation (an encoder stage's over its degree x ``dp``
    ranks) and optimizer step (``model.flush_s``; one stage per rank)."""
    return max(flush_s(g, dp * replicas.get(_module_of(parts, st, s), 1), machine.dp_link, machine.overheads)
               for s, g in enumerate(st.grad))


def _plan_of(model: SearchModel, st: CandidateStages, replicas: Mapping[str, int],
             tp: Collection[str] = ()) -> PipelinePlan:
    """The candidate as a ``PipelinePlan`` with its replicated encoder stages (``plan_pipeline(..., replicas=)``) and
    tensor-parallel ones (the branches in ``tp``, ``plan_pipeline(..., tensor_parallel=)``)."""
    starts: dict[str, list[str]] = {}
    for chunks in st.chunks:
        a = chunks[0][0]
        module = model.units[a].module
        if a != model.span[module][0]:
            starts.setdefault(module, []).append(model.units[a].name)
    return plan_pipeline(model.units, "encoder_parallel", splits=starts,
                         replicas={m: r for m, r in replicas.items() if r > 1 and m not in tp},
                         tensor_parallel={m: r for m, r in replicas.items() if r > 1 and m in tp})
