"""The layout search's model of a candidate: per-unit arrays, memoised partitions and concrete stages.

``plan_layout`` (``search``) weighs candidates (layout, stages per module, DP degree, LLM chunks per rank).
This module makes one candidate concrete, as numbers the bounds (``search_bounds``) and the timing
(``search_candidates``) read:

- ``SearchModel``: per-unit forward / backward seconds, static / activation / gradient bytes of one planning
  view (frozen-aware or not; memory always follows the true flags), with prefix sums;
- ``Partitions``: minimum-bottleneck partitions of each module chain (``partitioner.partition_chain``),
  memoised, memory-capped only when the plain one does not fit; the LLM cut cyclically over ranks for
  interleaved 1F1B (``Partitions.cyclic``, a heuristic); ``ChunkSums`` of unit ranges;
- ``CandidateStages``: the stages of one candidate (plan order) with their costs, edges, transfers and
  memory, from ``build_stages``; ``plan_from_chunks`` turns them into a ``PipelinePlan``.

``grad_sync_s`` is the gradient synchronisation every DP degree here is charged: the ring all-reduce
(``allreduce_s``), or with FSDP2 (``SearchModel.dp_shard``) a reduce-scatter then an all-reduce of the shards.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np

from plait.planner.cost.analytic import unit_activation_bytes, unit_static_bytes
from plait.planner.cost.types import ActionOverheads, OptimizerSpec
from plait.planner.pipeline.graph import check_grouping, consistent_units
from plait.planner.search.partitioner import partition_chain
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = [
    "CandidateStages",
    "ChunkSums",
    "Costs",
    "Partitions",
    "Ranges",
    "SearchModel",
    "allreduce_s",
    "build_stages",
    "cost_list",
    "fill_stages",
    "flush_s",
    "grad_sync_s",
    "grad_sync_terms",
    "in_flight",
    "plan_from_chunks",
]

Ranges = tuple[tuple[int, int], ...]
"""Unit index ranges ``[a, b)`` (absolute indices into the model's units), one per stage or chunk."""
Costs = Sequence[UnitCost] | Mapping[str, UnitCost]
"""Unit costs: one per unit in order, or a mapping from unit name."""


def allreduce_s(num_bytes: float, dp: int, link: P2PModel | None) -> float:
    """Ring all-reduce time (s) of ``num_bytes`` over ``dp`` ranks: ``2 (dp - 1)`` messages of latency plus
    ``2 (dp - 1) / dp * num_bytes / bandwidth`` (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms", JPDC 2009). 0 when ``dp == 1`` or ``link`` is None."""
    if link is None or dp <= 1:
        return 0.0
    volume = 2.0 * (dp - 1) / dp * num_bytes
    return 2 * (dp - 1) * link.latency_s + (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


def grad_sync_terms(dp: int, dp_shard: int, link: P2PModel | None) -> tuple[float, float]:
    """``(seconds, seconds per byte)`` of the gradient synchronisation of ``dp`` data-parallel ranks of which groups
    of ``dp_shard`` share one sharded copy (FSDP2; ``dp_shard`` divides ``dp``), per byte of a rank's gradient
    **shard**: a ring reduce-scatter over the ``dp_shard`` ranks of the whole gradient (``dp_shard`` shards:
    ``(s - 1)`` latencies and ``(s - 1) / s x s`` shard bytes) then a ring all-reduce of the shard over the
    ``r = dp / dp_shard`` replicas (``2 (r - 1)`` latencies and ``2 (r - 1) / r`` shard bytes). With
    ``dp_shard = 1`` this is the plain all-reduce. ``(0, 0)`` without a link.

    Raises:
        ValueError: when ``dp_shard`` does not divide ``dp``.
    """
    if dp % dp_shard:
        raise ValueError(f"dp_shard {dp_shard} must divide the data-parallel degree {dp}")
    if link is None:
        return 0.0, 0.0
    s, r = dp_shard, dp // dp_shard
    latency = ((s - 1) + 2 * (r - 1)) * link.latency_s
    volume = (s - 1) + 2.0 * (r - 1) / r
    return latency, (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


def grad_sync_s(num_bytes: float, dp: int, link: P2PModel | None, dp_shard: int = 1) -> float:
    """Seconds to synchronise a rank's ``num_bytes`` of gradient (its shard under FSDP2) over ``dp`` data-parallel
    ranks (``grad_sync_terms``); 0 for ``dp == 1`` or no link."""
    if dp_shard == 1:
        return allreduce_s(num_bytes, dp, link)
    if link is None or dp <= 1:
        return 0.0
    latency, per_byte = grad_sync_terms(dp, dp_shard, link)
    return latency + per_byte * num_bytes


def flush_s(num_bytes: float, dp: int, link: P2PModel | None, overheads: ActionOverheads,
            dp_shard: int = 1) -> float:
    """What a rank holding ``num_bytes`` trainable parameter bytes (its shard under FSDP2) spends after the pipeline
    flush: the DP gradient synchronisation (``grad_sync_s``: an all-reduce, or a reduce-scatter over ``dp_shard``
    ranks then an all-reduce over the replicas) and its optimizer step (``ActionOverheads.update_s``). Both grow
    with the bytes, so over a plan's ranks the maximum of the sum is the sum of the maxima."""
    return grad_sync_s(num_bytes, dp, link, dp_shard) + overheads.update_s(num_bytes)


def cost_list(units: Sequence[Unit], costs: Costs) -> list[UnitCost]:
    """Costs aligned with ``units`` from a sequence (same order) or a mapping by unit name.

    Raises:
        ValueError: on a length mismatch or a unit without a cost.
    """
    if isinstance(costs, Mapping):
        missing = [u.name for u in units if u.name not in costs]
        if missing:
            raise ValueError(f"costs has no UnitCost for unit(s) {missing[:5]}")
        return [costs[u.name] for u in units]
    costs = list(costs)
    if len(costs) != len(units):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    return costs


def _dyadic(values: Sequence[float]) -> list[float]:
    """``values`` rounded to multiples of a power of two ``q`` about ``2^-48`` of their sum, so that every
    prefix sum and difference is exact in floating point. ``partition_chain`` compares prefix differences
    with the largest single value; with inexact sums it can fail on a unit that is the bottleneck alone."""
    total = math.fsum(values)
    if total <= 0:
        return list(values)
    q = 2.0 ** (math.floor(math.log2(total)) - 48)
    return [round(v / q) * q for v in values]


class SearchModel:
    """Per-unit arrays of one planning view (``frozen_aware`` or not) plus the true memory."""

    def __init__(self, units: Sequence[Unit], costs: Costs, frozen_aware: bool, dtype: Any,
                 optimizer: OptimizerSpec, overheads: ActionOverheads = ActionOverheads(), dp_shard: int = 1) -> None:
        per_unit = cost_list(units, costs)
        self.overheads = overheads
        self.dp_shard = dp_shard  # FSDP2 shard degree: costs are per shard, gradients reduce-scattered
        self.modules = check_grouping(units)
        self.encoders = self.modules[:-1]
        self.units = consistent_units(units)
        view = self.units if frozen_aware else consistent_units(units, all_trainable=True)
        self.view = view
        self.forward = [c.forward_s for c in per_unit]
        self.backward = [c.backward_s(u, frozen_aware) for u, c in zip(view, per_unit)]
        self.work = [f + b for f, b in zip(self.forward, self.backward)]
        self.grid_work = _dyadic(self.work)
        self.runs_backward = [u.runs_backward for u in view]
        self.static = [unit_static_bytes(u, c, dtype, optimizer) for u, c in zip(self.units, per_unit)]
        self.activation = [unit_activation_bytes(u, c) for u, c in zip(self.units, per_unit)]
        self.output = [float(c.output_bytes) for c in per_unit]
        self.grad = [c.param_bytes * u.trained_fraction for u, c in zip(view, per_unit)]  # LoRA: adapters only
        self.span: dict[str, tuple[int, int]] = {}
        for index, unit in enumerate(self.units):
            start = self.span.get(unit.module, (index, index))[0]
            self.span[unit.module] = (start, index + 1)
        self.prefix = {name: [0.0, *accumulate(values)] for name, values in
                       (("F", self.forward), ("B", self.backward), ("W", self.work), ("S", self.static),
                        ("A", self.activation), ("G", self.grad))}

    def total(self, key: str, a: int, b: int) -> float:
        """Sum of array ``key`` (F, B, W, S, A, G) over units ``[a, b)``."""
        prefix = self.prefix[key]
        return prefix[b] - prefix[a]

    def size(self, module: str) -> int:
        """Number of units of ``module``."""
        a, b = self.span[module]
        return b - a

    def max_stages(self, module: str) -> int:
        """The most stages ``module`` may be cut into: its unit count, or 1 when some unit of it is
        ``Unit.joined`` (a tower that stays in one stage)."""
        a, b = self.span[module]
        return 1 if any(u.joined for u in self.units[a:b]) else b - a


class ChunkSums(NamedTuple):
    """Sums over a range of units ``[a, b)`` (``Partitions.chunk``)."""

    forward: float  # forward seconds per microbatch
    backward: float  # backward seconds per microbatch (planning view)
    runs_backward: bool  # some unit of the range runs a backward
    output: float  # output bytes of the range's last unit (what the range sends on)
    static: float  # parameters + gradients + optimizer state (bytes)
    activation: float  # activations kept per in-flight microbatch (bytes)
    grad: float  # trainable parameter bytes (the all-reduced gradient)


class Partitions:
    """Minimum-bottleneck partitions of each module chain, memoised; a memory-capped partition only when
    the plain one does not fit (the two coincide whenever the plain one fits: same exact optimum, same
    tie-break)."""

    def __init__(self, model: SearchModel, memory_cap: float | None) -> None:
        self.model, self.cap = model, memory_cap
        self._plain: dict[tuple[str, int], Ranges] = {}
        self._capped: dict[tuple[str, int, tuple[int, ...], float], Ranges | None] = {}
        self._cyclic: dict[tuple[int, int], Ranges] = {}
        self._grad_floor: dict[tuple[str, int], float] = {}
        self._sums: dict[tuple[int, int], ChunkSums] = {}
        self.llm_terms: dict[int, tuple[np.ndarray, ...]] = {}  # per microbatch count (search_bounds)

    def plain(self, module: str, stages: int) -> Ranges:
        """Unconstrained partition of ``module`` into ``stages`` (absolute unit ranges)."""
        key = (module, stages)
        if key not in self._plain:
            a, b = self.model.span[module]
            ranges = partition_chain(self.model.grid_work[a:b], stages)
            self._plain[key] = tuple((a + x, a + y) for x, y in ranges)
        return self._plain[key]

    def cyclic(self, ranks: int, v: int) -> Ranges:
        """The LLM cut into ``v * ranks`` chunks, chunk ``j`` on LLM rank ``j mod ranks``, balancing the ranks'
        summed work: the minimum-bottleneck chunks, then single-unit boundary moves that lower the busiest
        rank while it can be lowered (a local search: with a heavy LM head the chunk bottleneck and the
        rank bottleneck differ). Memoised; memory is checked by the caller."""
        key = (ranks, v)
        if key not in self._cyclic:
            self._cyclic[key] = _balance_cyclic(self.model.prefix["W"], list(self.plain(LLM_MODULE, v * ranks)),
                                                ranks)
        return self._cyclic[key]

    def grad_floor(self, module: str, stages: int) -> float:
        """Least possible largest stage gradient (bytes) over partitions of ``module`` into ``stages``: the
        min-max partition of its units' gradient bytes (memoised)."""
        key = (module, stages)
        if key not in self._grad_floor:
            a, b = self.model.span[module]
            grads = _dyadic(self.model.grad[a:b])
            ranges = partition_chain(grads, stages)
            self._grad_floor[key] = max(math.fsum(grads[x:y]) for x, y in ranges)
        return self._grad_floor[key]

    def chunk(self, a: int, b: int) -> ChunkSums:
        """Memoised ``ChunkSums`` of units ``[a, b)``."""
        key = (a, b)
        found = self._sums.get(key)
        if found is None:
            m = self.model
            found = ChunkSums(m.total("F", a, b), m.total("B", a, b), any(m.runs_backward[a:b]), m.output[b - 1],
                              m.total("S", a, b), m.total("A", a, b), m.total("G", a, b))
            self._sums[key] = found
        return found

    def memory(self, ranges: Ranges, in_flight: Sequence[int]) -> list[float]:
        """Per-range memory (bytes): static + in-flight x activations."""
        sums = [self.chunk(a, b) for a, b in ranges]
        return [c.static + f * c.activation for c, f in zip(sums, in_flight)]

    def fitted(self, module: str, stages: int, in_flight: tuple[int, ...], cap: float | None = None) -> Ranges | None:
        """Partition of ``module`` fitting ``cap`` (default the search's cap) with ``in_flight`` microbatches
        per stage; None when none fits."""
        cap = self.cap if cap is None else cap
        ranges = self.plain(module, stages)
        if cap is None or max(self.memory(ranges, in_flight)) <= cap:
            return ranges
        key = (module, stages, in_flight, cap)
        if key not in self._capped:
            a, b = self.model.span[module]
            m = self.model
            try:
                found = partition_chain(m.grid_work[a:b], stages, m.static[a:b], cap, 0.0, m.activation[a:b],
                                        list(in_flight))
                self._capped[key] = tuple((a + x, a + y) for x, y in found)
            except ValueError:
                self._capped[key] = None
        return self._capped[key]


def _balance_cyclic(prefix: Sequence[float], ranges: list[tuple[int, int]], ranks: int) -> Ranges:
    """Chunks of ``[ranges[0][0], ranges[-1][1])`` (as many as ``ranges``) lowering the busiest rank's summed
    work, chunk ``j`` on rank ``j mod ranks`` (``Partitions.cyclic``): the better of ``ranges`` and the
    smallest rank bound (bisection) for which ``_cyclic_from_end`` succeeds. A heuristic, not exact."""
    def worst(candidate: Sequence[tuple[int, int]]) -> float:
        return max(sum(prefix[b] - prefix[a] for a, b in candidate[r::ranks]) for r in range(ranks))

    lo, hi = 0.0, worst(ranges)
    found = None
    for _ in range(40):
        mid = (lo + hi) / 2
        attempt = _cyclic_from_end(prefix, ranges[0][0], ranges[-1][1], len(ranges), ranks, mid)
        if attempt is None:
            lo = mid
        else:
            hi, found = mid, attempt
    return tuple(found) if found is not None and worst(found) < worst(ranges) else tuple(ranges)


def _cyclic_from_end(prefix: Sequence[float], start: int, end: int, chunks: int, ranks: int,
                     bound: float) -> list[tuple[int, int]] | None:
    """Chunks built from the last one backwards: each takes the fewest units reaching up to an even share of
    its rank's remaining budget (the rank's chunks still to build share ``bound`` minus its load; the
    rank's first chunk takes all that is left), leaving one unit per earlier chunk. None when some rank
    exceeds ``bound``. Building from the end gives the rank holding a heavy last unit (an LM head) light
    other chunks."""
    loads = [0.0] * ranks
    out: list[tuple[int, int]] = []
    for j in range(chunks - 1, -1, -1):
        r, left = j % ranks, j // ranks + 1  # chunks of rank r still to build, this one included
        budget = (bound - loads[r]) / left if left > 1 else bound - loads[r]
        first = start + j  # leave one unit per earlier chunk
        if j == 0:
            a = start
        else:
            a = max(first, bisect.bisect_left(prefix, prefix[end] - budget, first, end))
            a = min(a, end - 1)
        loads[r] += prefix[end] - prefix[a]
        if loads[r] > bound:
            return None
        out.append((a, end))
        end = a
    return out[::-1]


@dataclass
class CandidateStages:
    """One candidate made concrete: per stage (plan order) its unit chunks and what the search needs.

    Attributes:
        chunks: per stage, its unit ranges (one per module; several for a colocated encoder stage).
        depth: per stage, the stages on its path to the last one, itself included (1F1B warm-up + 1).
        succ: per stage, the stage it sends its output to (-1 for the last).
        preds: per stage, the stages it receives from.
        forward, backward: per stage, seconds per microbatch (planning view).
        runs_backward: per stage, whether it has a backward (planning view).
        send: per stage, seconds to move its output (or its gradient) to the next rank.
        memory: per stage, static bytes + 1F1B in-flight microbatches x activation bytes.
        grad: per stage, gradient bytes all-reduced over DP replicas.
        activation: per stage, activation bytes per in-flight microbatch.
    """

    chunks: list[list[tuple[int, int]]]
    depth: list[int]
    succ: list[int]
    preds: list[list[int]]
    forward: list[float]
    backward: list[float]
    runs_backward: list[bool]
    send: list[float]
    memory: list[float]
    grad: list[float]
    activation: list[float] = dataclasses.field(default_factory=list)


def in_flight(stages: int, extra_depth: int, microbatches: int) -> tuple[int, ...]:
    """1F1B peak in-flight microbatches ``min(depth, M_r)`` of a chain's stages, depth ``stages - i + extra``."""
    return tuple(min(stages - i + extra_depth, microbatches) for i in range(stages))


def _module_chunks(parts: Partitions, layout: str, counts: Sequence[int], nb: int,
                   llm: Ranges | None = None) -> list[list[Ranges]] | None:
    """Per module (plan order), its ranges (the LLM's ``llm`` when given); None when memory rules a module
    out. Colocated encoders are partitioned one by one; if together they do not fit, each is capped at its
    share of the cap (proportional to its static + activation bytes)."""
    model = parts.model
    s_llm = counts[-1]
    llm = llm or parts.fitted(LLM_MODULE, s_llm, in_flight(s_llm, 0, nb))
    if llm is None:
        return None
    chunks: list[Ranges] = []
    for module, s in zip(model.encoders, counts):
        ranges = parts.fitted(module, s, in_flight(s, s_llm, nb))
        if ranges is None:
            return None
        chunks.append(ranges)
    if layout == "encoders_colocated" and len(chunks) > 1 and parts.cap is not None:
        flights = in_flight(counts[0], s_llm, nb)
        joint = [sum(v) for v in zip(*(parts.memory(r, flights) for r in chunks))]
        if max(joint) > parts.cap:
            chunks = _shared_cap_chunks(parts, counts[0], flights)
            if chunks is None:
                return None
    return [list(c) for c in chunks] + [list(llm)]


def _shared_cap_chunks(parts: Partitions, stages: int, flights: tuple[int, ...]) -> list[Ranges] | None:
    """Colocated encoders, each partitioned under its share of the memory cap."""
    model = parts.model
    need = {m: model.total("S", *model.span[m]) + max(flights) * model.total("A", *model.span[m])
            for m in model.encoders}
    whole = sum(need.values()) or 1.0
    out = []
    for module in model.encoders:
        ranges = parts.fitted(module, stages, flights, parts.cap * need[module] / whole)
        if ranges is None:
            return None
        out.append(ranges)
    return out


def build_stages(parts: Partitions, layout: str, counts: Sequence[int], nb: int,
                  p2p: P2PModel, check_memory: bool = True, llm: Ranges | None = None) -> CandidateStages | None:
    """The candidate's stages (LLM ranges ``llm`` when given), or None when it does not fit memory."""
    modules = _module_chunks(parts, layout, counts, nb, llm)
    if modules is None:
        return None
    s_llm = counts[-1]
    groups: list[list[tuple[int, int]]] = []
    depth, succ = [], []
    if layout == "encoders_colocated" and parts.model.encoders:
        for i in range(counts[0]):
            groups.append([ranges[i] for ranges in modules[:-1]])
            depth.append(counts[0] - i + s_llm)
            succ.append(len(groups))
    else:
        for ranges in modules[:-1]:
            for i, r in enumerate(ranges):
                groups.append([r])
                depth.append(len(ranges) - i + s_llm)
                succ.append(len(groups))
    first_llm = len(groups)
    for ranges_end in range(first_llm):
        if depth[ranges_end] == s_llm + 1:  # last stage of a branch (or of the colocated encoders)
            succ[ranges_end] = first_llm
    for j, r in enumerate(modules[-1]):
        groups.append([r])
        depth.append(s_llm - j)
        succ.append(len(groups) if j < s_llm - 1 else -1)
    return fill_stages(parts, groups, depth, succ, nb, p2p, check_memory)


def fill_stages(parts: Partitions, groups: list[list[tuple[int, int]]], depth: list[int], succ: list[int],
                 nb: int, p2p: P2PModel, check_memory: bool = True) -> CandidateStages | None:
    """Costs, flags, transfers and memory of the stage groups; None when a stage exceeds the cap."""
    preds: list[list[int]] = [[] for _ in groups]
    for s, t in enumerate(succ):
        if t >= 0:
            preds[t].append(s)
    stages = CandidateStages(groups, depth, succ, preds, [], [], [], [], [], [])
    for chunks, d in zip(groups, depth):
        if len(chunks) == 1:
            f, b, rb, out, static, act, grad = parts.chunk(*chunks[0])
        else:
            sums = [parts.chunk(a, b) for a, b in chunks]
            f, b, out, static, act, grad = (sum(getattr(c, name) for c in sums) for name in
                                            ("forward", "backward", "output", "static", "activation", "grad"))
            rb = any(c.runs_backward for c in sums)
        stages.forward.append(f)
        stages.backward.append(b)
        stages.runs_backward.append(rb)
        stages.send.append(p2p.transfer_s(out))
        stages.memory.append(static + min(d, nb) * act)
        stages.activation.append(act)
        stages.grad.append(grad)
    _add_overheads(parts, stages, p2p)
    if check_memory and parts.cap is not None and max(stages.memory) > parts.cap:
        return None
    return stages



def _add_overheads(parts: Partitions, stages: CandidateStages, p2p: P2PModel) -> None:
    """Add the runtime's fixed costs to the stages' forward and backward seconds, as the simulator times a plan:
    ``ActionOverheads.stage_s`` of each stage's module chunks (``SearchModel.overheads``) and the LogP message
    overheads of ``p2p`` (``simulator``: a send overhead on the action sending, a receive overhead on the action
    receiving, per edge; the gradient goes back when both ends run a backward). Every edge is taken to cross
    ranks: exact for one stage per rank and for interleaved LLM chunks, one message pair too many per encoder
    attached to the first LLM rank (the search then rates attached candidates slightly slower than
    ``evaluate_plan`` times them)."""
    model, over = parts.model, parts.model.overheads
    if not over.zero:
        for s, chunks in enumerate(stages.chunks):
            pairs = [(model.units[a].module, parts.chunk(a, b).runs_backward) for a, b in chunks]
            stages.forward[s] += over.stage_s("F", pairs)
            stages.backward[s] += over.stage_s("B", pairs)
    send, recv = p2p.send_overhead_s, p2p.recv_overhead_s
    if not (send or recv):
        return
    rb = stages.runs_backward
    for s, t in enumerate(stages.succ):
        if t < 0:
            continue
        stages.forward[s] += send
        stages.forward[t] += recv
        if rb[s] and rb[t]:
            stages.backward[t] += send
            stages.backward[s] += recv


def plan_from_chunks(model: SearchModel, units: Sequence[Unit], layout: str,
                     chunks: Sequence[Sequence[tuple[int, int]]], ranks: Sequence[int] | None = None) -> PipelinePlan:
    """``plan_pipeline`` of ``units`` (true or planning view) split at the starts of ``chunks``."""
    starts: dict[str, list[str]] = {m: [] for m in model.modules}
    for stage_chunks in chunks:
        for a, _ in stage_chunks:
            unit = units[a]
            if a != model.span[unit.module][0]:
                starts[unit.module].append(unit.name)
    return plan_pipeline(units, layout, splits=starts, ranks=ranks)
