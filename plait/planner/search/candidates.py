"""The layout search's branch and bound, and the timing of its candidates with the simulator's core.

Candidates come from the sorted ``search_bounds.Stream`` s, taken in increasing bound (a heap of
``HeapEntry``). A 1F1B candidate with one stage per rank is made concrete (``search_model.build_stages``,
memory caps included) and gets the tighter bound ``LB2`` (its per-stage bounds plus its all-reduce); only
when that is again the smallest bound is it timed (``time_1f1b``). An interleaved or attached candidate is
timed at once on the real per-rank orders of ``schedules_interleaved.interleaved_1f1b`` (``interleaved_candidate``,
``time_orders``), with its per-rank memory peak checked against the cap. The search stops when the
smallest remaining bound is at least ``best / (1 + rel_tol)``: with ``rel_tol = 0`` the result is optimal
over the search space, otherwise within ``rel_tol`` of it.

Timing is the simulator's: ``time_1f1b`` and ``time_orders`` call ``simulator.time_actions`` (and
``simulator.activation_peaks``) on plain lists, the same core ``simulator.simulate`` runs; tests check they
equal ``simulate`` on the candidates' plans. Ties between equal times go to fewer devices, then fewer
chunks per rank, then layout, stage counts and attachment (``CandidateKey``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from plait.planner.cost.types import ActionOverheads
from plait.planner.pipeline.plan import stage_ranks
from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.pipeline.schedule_ir import Action, one_f_one_b_order
from plait.planner.pipeline.interleaved import interleaved_1f1b, interleaved_orders
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.search.bounds import Stream, stage_bounds
from plait.planner.search.model import (
    CandidateStages,
    Partitions,
    SearchModel,
    flush_s,
    build_stages,
    in_flight,
    plan_from_chunks,
)
from plait.planner.pipeline.simulator import ActionDurations, StageGraph, activation_peaks, stage_graph, time_actions
from plait.planner.types import LLM_MODULE

__all__ = [
    "Best",
    "CandidateKey",
    "HeapEntry",
    "TimedCandidate",
    "branch_and_bound",
    "counts_tuple",
    "interleaved_candidate",
    "sync_s",
    "time_1f1b",
    "time_orders",
]


class CandidateKey(NamedTuple):
    """What ranks two timed candidates: time first, then the tie-breaks (fewer devices first)."""

    time: float  # planning-view iteration time (s)
    devices: int  # devices used: DP degree x pipeline ranks
    v: int  # LLM chunks per LLM rank
    layout: str
    counts: tuple[int, ...]  # stage count per module (LLM: ranks when v > 1, attached or in the bubbles)
    attached: bool
    in_bubble: bool = False


class HeapEntry(NamedTuple):
    """One entry of the branch and bound's heap (ordered by ``bound``, then fewer devices, then insertion).

    ``refined`` entries carry a concrete candidate (``counts``, ``stages``) with its second bound; the others
    stand for the next candidate of stream ``stream``."""

    bound: float
    devices: int
    seq: int  # insertion order: unique, so the fields after it are never compared
    refined: bool
    stream: int
    counts: tuple[int, ...] = ()
    stages: CandidateStages | None = None


class TimedCandidate(NamedTuple):
    """A timed candidate: its planning-view iteration time (s, with the all-reduce) and its stages."""

    time: float
    stages: CandidateStages


@dataclass
class Best:
    """The best candidate so far (``stages`` None until one is timed)."""

    key: CandidateKey | None = None
    stages: CandidateStages | None = None
    layout: str = ""
    dp: int = 0
    counts: tuple[int, ...] = ()
    v: int = 1
    attached: bool = False
    in_bubble: bool = False

    @property
    def time(self) -> float:
        """Planning-view iteration time (s); inf before any candidate."""
        return math.inf if self.key is None else self.key.time


def counts_tuple(model: SearchModel, layout: str, row: np.ndarray) -> tuple[int, ...]:
    """Stage count per module (encoders in order, LLM last) of a stream row."""
    values = [int(v) for v in row]
    if layout == "encoders_colocated" and model.encoders:
        return tuple([values[0]] * len(model.encoders) + [values[1]])
    return tuple(values)


def branch_and_bound(parts: Partitions, streams: list[Stream], p2p: P2PModel, link: P2PModel | None,
                     rel_tol: float, budget: int = 10**9, beat: float = math.inf) -> tuple[Best, int, int]:
    """Branch and bound over the streams (module docstring); at most ``budget`` interleaved / attached
    candidates are timed. Returns the best, the candidates considered and the candidates timed. ``beat``: an
    incumbent time (seconds) the search stops at as at a best found: the best is the same as without it whenever
    it is faster than ``beat`` (the candidates are taken in the same order), else none or one not faster."""
    heap = [HeapEntry(float(s.bounds[0]), 0, index, False, index) for index, s in enumerate(streams) if len(s.bounds)]
    heapq.heapify(heap)
    seq = len(streams)
    best, considered, timed = Best(), 0, 0
    while heap and heap[0].bound * (1 + rel_tol) < min(best.time, beat):
        entry = heapq.heappop(heap)
        stream = streams[entry.stream]
        if entry.refined:
            timed += 1
            total = time_1f1b(entry.stages, stream.nb) + sync_s(entry.stages, stream.dp, link, parts.model.overheads,
                                                                 parts.model.dp_shard)
            key = CandidateKey(total, entry.devices, 1, stream.layout, entry.counts, False)
            best = _better(best, key, stream, entry.stages)
            continue
        counts = counts_tuple(parts.model, stream.layout, stream.counts[stream.position])
        stream.position += 1
        if stream.position < len(stream.bounds):
            heapq.heappush(heap, HeapEntry(float(stream.bounds[stream.position]), 0, seq, False, entry.stream))
            seq += 1
        considered += 1
        if stream.v > 1 or stream.attached or stream.in_bubble:  # timed at once on the real orders (no second bound)
            if budget > 0:
                budget, timed = budget - 1, timed + 1
                found = interleaved_candidate(parts, stream, counts, p2p, link)
                if found is not None:
                    ranks = counts[-1] if stream.attached or stream.in_bubble else sum(counts)
                    key = CandidateKey(found.time, ranks * stream.dp, stream.v, stream.layout, counts, stream.attached,
                                       stream.in_bubble)
                    best = _better(best, key, stream, found.stages)
            continue
        st = build_stages(parts, stream.layout, counts, stream.nb, p2p)
        if st is not None:
            tight = max(entry.bound, max(stage_bounds(st, stream.nb)) + sync_s(st, stream.dp, link,
                                                                                parts.model.overheads,
                                                                                parts.model.dp_shard))
            heapq.heappush(heap, HeapEntry(tight, sum(counts) * stream.dp, seq, True, entry.stream, counts, st))
            seq += 1
    return best, considered, timed


def _better(best: Best, key: CandidateKey, stream: Stream, stages: CandidateStages) -> Best:
    """``best``, or the candidate ``key`` of ``stream`` when it ranks before it."""
    if best.key is not None and not key < best.key:
        return best
    return Best(key, stages, stream.layout, stream.dp, key.counts, stream.v, stream.attached, stream.in_bubble)


def interleaved_candidate(parts: Partitions, stream: Stream, counts: tuple[int, ...], p2p: P2PModel,
                           link: P2PModel | None) -> TimedCandidate | None:
    """(planning-view iteration time, stages) of a candidate with ``counts[-1]`` LLM ranks holding
    ``stream.v`` chunks each (``interleaved_1f1b``, which is 1F1B when ``v = 1``), its encoder stages on their own
    ranks or, for ``stream.attached``, on LLM rank 0, or, for ``stream.in_bubble``, on the last LLM rank (ordered
    by ``schedules.one_f_one_b``'s list scheduling: an encoder action where the rank would otherwise wait); None
    when it does not fit memory (the simulated per-rank peak, checked exactly)."""
    p, v, nb = counts[-1], stream.v, stream.nb
    llm = parts.cyclic(p, v) if v > 1 else parts.fitted(LLM_MODULE, p, in_flight(p, 0, nb))
    st = None if llm is None else build_stages(parts, stream.layout, counts[:-1] + (v * p,), nb, p2p, False, llm)
    if st is None:
        return None
    n_enc = len(st.forward) - v * p
    shared = stream.attached or stream.in_bubble
    if parts.cap is not None and not shared and max(st.memory[:n_enc], default=0.0) > parts.cap:
        return None
    plan = plan_from_chunks(parts.model, parts.model.view, stream.layout, st.chunks,
                             stage_ranks(n_enc, p, v, stream.attached, in_bubble=stream.in_bubble))
    orders = one_f_one_b(plan, nb).actions if stream.in_bubble else interleaved_orders(plan, nb)
    timing = time_orders(plan, orders, st, nb)
    if timing is None:  # the unchecked orders stalled: take the generator's safety net
        timing = time_orders(plan, interleaved_1f1b(plan, nb).actions, st, nb)
    makespan, live = timing
    memory = [0.0] * plan.num_ranks
    grads = [0.0] * plan.num_ranks
    for stage in plan.stages:
        memory[stage.rank] += sum(parts.chunk(a, b).static for a, b in st.chunks[stage.index])
        grads[stage.rank] += st.grad[stage.index]
    if parts.cap is not None and max(m + x for m, x in zip(memory, live)) > parts.cap:
        return None
    model = parts.model
    return TimedCandidate(makespan + max(flush_s(g, stream.dp, link, model.overheads, model.dp_shard) for g in grads),
                          st)


def time_orders(plan: PipelinePlan, orders: Sequence[Sequence[Action]], st: CandidateStages,
                 nb: int) -> tuple[float, list[float]] | None:
    """Makespan (s) and per-rank peak live activation bytes of per-rank ``orders``: ``simulator.time_actions``
    and ``simulator.activation_peaks`` (the simulator's core) with the candidate's stage costs, transfers and
    activation bytes; None when the orders stall. Tests check equality with ``simulator.simulate``."""
    graph = stage_graph(plan)
    rows = [[(a.kind, a.stage, a.microbatch) for a in actions] for actions in orders]
    times = time_actions(rows, graph, _durations(st, nb), st.send, nb)
    if times is None:
        return None
    freed = [times.backward_end[s] if back else times.forward_end[s] for s, back in enumerate(graph.runs_backward)]
    live = activation_peaks(graph.rank, plan.num_ranks, times.forward_start, freed,
                            [[a] * nb for a in st.activation])
    return times.makespan_s, live


def time_1f1b(st: CandidateStages, nb: int) -> float:
    """1F1B makespan (s) of ``st`` with ``nb`` microbatches, one stage per rank: ``simulator.time_actions`` (the
    simulator's timing core) on each stage's 1F1B order (``schedule_ir.one_f_one_b_order``), with the
    candidate's stage costs and transfers. Tests check equality with ``simulator.simulate``."""
    n = len(st.forward)
    orders = [[(kind, s, i) for kind, i in one_f_one_b_order(nb, st.depth[s], st.runs_backward[s])]
              for s in range(n)]
    times = time_actions(orders, StageGraph(range(n), st.preds, st.succ, st.runs_backward), _durations(st, nb),
                         st.send, nb)
    if times is None:
        raise RuntimeError("1F1B timing stalled (a plait bug)")
    return times.makespan_s


def _durations(st: CandidateStages, nb: int) -> ActionDurations:
    """The candidate's per-stage forward and backward seconds, the same for every microbatch."""
    return ActionDurations([[f] * nb for f in st.forward], [[b] * nb for b in st.backward], ())


def sync_s(st: CandidateStages, dp: int, link: P2PModel | None,
           overheads: ActionOverheads = ActionOverheads(), dp_shard: int = 1) -> float:
    """Gradient synchronisation and optimizer step after the flush (``search_model.flush_s``; a reduce-scatter over
    ``dp_shard`` ranks under FSDP2): the slowest stage's (one stage per rank)."""
    return max(flush_s(g, dp, link, overheads, dp_shard) for g in st.grad)
