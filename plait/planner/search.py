"""Automatic layout search: modality layout, stages per module and DP degree of an MLLM pipeline.

Given the pipeline units of a model and their costs, ``plan_layout`` chooses, for ``devices`` accelerators
and a global batch of ``microbatches`` microbatches:

- the layout (../shared/REFERENCES.md section 1, "Modality parallelism"): ``"encoder_parallel"`` (each
  encoder branch its own chain of stages, all feeding the first LLM stage) or ``"encoders_colocated"``
  (encoder stage ``s`` runs the ``s``-th chunk of every encoder, then the LLM stages: a line);
- the number of stages of each module (each encoder branch, the LLM);
- the DP degree ``d``: ``d`` identical pipeline replicas, each running ``ceil(M / d)`` microbatches (the
  global microbatches split over the replicas; the slowest replica sets the iteration time), with
  ``d * stages <= devices``.

Each candidate is made concrete with the exact partitioner (``partitioner.partition_chain``: minimum
bottleneck per module chain, under the memory cap with 1F1B in-flight counts ``min(depth, M_r)``) and timed
with the multimodal 1F1B schedule (``schedules.one_f_one_b``) as the simulator times it, plus an optional
data-parallel gradient all-reduce after the pipeline flush (``dp_link``).

Search (exact branch and bound). The space is small per module but its product is large (1,024 GPUs and
three modules: about 10^6 candidates), and timing one candidate costs milliseconds, so:

1. Per module and stage count the minimum-bottleneck partition is computed once (memoised; a memory-capped
   one only when the plain one does not fit). Per (layout, DP degree), a vectorised lower bound ``LB1`` of
   every candidate is computed (numpy over the grid of stage counts), the largest of: ``M_r`` times the
   least possible encoder bottleneck; the LLM partition's per-stage bounds (below) after the encoder
   paths (forwards and transfers in, backwards and transfers out); each encoder chain's last-microbatch
   exit (its path plus ``M_r - 1`` times its least possible largest stage forward) followed by one
   microbatch's whole LLM path; plus the least possible gradient all-reduce (the LLM partition's largest
   stage gradient, and per encoder the min-max partition of its gradient bytes).
2. Candidates are taken in increasing ``LB1``. A taken candidate is partitioned for real (memory caps
   included) and gets the tighter bound ``LB2`` (the per-stage bounds of all its stages plus its
   all-reduce); only when it is again the smallest bound is it timed.
3. The search stops when the smallest remaining bound is at least ``best / (1 + rel_tol)``: with
   ``rel_tol = 0`` the result is optimal over the search space, otherwise within ``rel_tol`` of it.

The search space also holds the no-pipeline candidate (every module on one rank, largest DP degree). It
does not hold plans whose stages share ranks across modules (``megatron_even_split`` makes such plans),
nor partitions other than the minimum-bottleneck one per module and stage count (these are not always
makespan-optimal: a different split can occasionally be faster by a fraction of a percent).

Per-stage bound (valid for the 1F1B order of ``schedules.one_f_one_b`` with one stage per rank): stage
``k`` cannot start before microbatch 0 has crossed its upstream path (``A_k``, forwards and transfers); it
is then busy ``M_r (F_k + B_k)``; its first backward waits for ``min(w + 1, M_r)`` forwards (``w`` the
warm-up ``min(depth - 1, M_r)``) and for the round trip through the downstream stages; after its last
backward, the upstream stages still run theirs (``Z_k``). For a balanced chain this is exactly the 1F1B
makespan ``(M_r + S - 1)(F + B)``.

Timing inside the search uses ``_fast_makespan``, an array implementation of the simulator's rules for
one stage per rank (tests check it equals ``simulator.simulate``); the chosen plan is then simulated with
``simulator.simulate`` itself (``evaluate_plan``), always with the true frozen-aware costs.

Frozen-unaware baseline: with ``frozen_aware=False`` the search believes every unit trains (work
``f + dX + dW`` everywhere, every stage runs a backward, every parameter is all-reduced), as a planner that
ignores frozen-ness would (REFERENCES.md section 1); memory always follows the real flags (it is the limit
the runtime meets). The chosen plan is evaluated with the true costs. ``megatron_even_split`` is the
Megatron-style baseline: units spread evenly by count over the pipeline ranks, encoders first.

More schedules (``virtual_stages``, ``attach_encoders``): with ``v > 1`` a candidate cuts the LLM into
``v p`` chunks cyclic over ``p`` ranks (``schedules.interleaved_1f1b``; chunks balanced per rank by
``_Partitions.cyclic``, a heuristic); with ``attach_encoders`` every encoder is one stage on the first LLM
rank (a frozen encoder then costs no rank of its own); ``pipeline_plan.stage_ranks`` places the stages, as it
does for a job's ``[parallel.pp]`` (``virtual_stages``, ``attach_encoders``), so the trainer runs the chosen plan.
These candidates get a lower bound valid for their
schedule (``_interleaved_llm_terms``, ``_attached_stream``: per LLM rank, arrival + busy time + upstream
backwards; memory floors from the warm-up) and, when taken, are timed on the real per-rank orders
(``_time_orders``, the simulator's rules; tests check equality) with the per-rank memory peak checked
against the cap. The search stays exact over these candidates given their partitions.

Unit flags are recomputed from ``trainable`` by their definition (``types.Unit``): ``needs_input_grad`` =
some unit upstream trains, where the LLM's first unit (its embedding, into whose output the encoder
features are injected) is downstream of every encoder branch. The returned plan is built on these units.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from plait.planner.cost_model import OptimizerSpec, unit_activation_bytes, unit_static_bytes
from plait.planner.partitioner import partition_chain
from plait.planner.pipeline_plan import (
    LAYOUTS,
    PipelinePlan,
    check_plan_units,
    plan_pipeline,
    stage_ranks,
)
from plait.planner.schedules import (
    Action,
    build_schedule,
    in_flight_peaks,
    interleaved_1f1b,
    interleaved_chunk_order,
    interleaved_orders,
    interleaved_warmups,
    runs_interleaved,
)
from plait.planner.simulator import (
    P2PModel,
    StageMemory,
    boundary_bytes_from_units,
    simulate,
    stage_costs_from_units,
)
from plait.planner.graph import check_grouping, consistent_units
from plait.planner.types import LLM_MODULE, Unit, UnitCost, dataclass_from_dict

__all__ = [
    "METHODS",
    "LayoutChoice",
    "allreduce_s",
    "evaluate_plan",
    "megatron_even_split",
    "plan_layout",
]

METHODS = ("plait", "frozen_unaware", "megatron_even", "given")
Ranges = tuple[tuple[int, int], ...]
Costs = Sequence[UnitCost] | Mapping[str, UnitCost]


# --------------------------------------------------------------------------------------------------
# Result


@dataclass(frozen=True)
class LayoutChoice:
    """A chosen pipeline layout with its predicted cost (times in seconds, memory in bytes).

    Attributes:
        method: who chose it: ``"plait"`` (frozen-aware search), ``"frozen_unaware"`` (search with the
            frozen-unaware cost model), ``"megatron_even"`` (even split by unit count) or ``"given"``.
        layout: ``"encoder_parallel"`` or ``"encoders_colocated"`` (the plan's layout).
        dp: data-parallel degree (pipeline replicas).
        stages_per_module: ``((module, stages), ...)`` in plan order, ``"llm"`` last.
        plan: one replica's ``PipelinePlan`` (``num_microbatches`` = microbatches per replica).
        microbatches: global microbatches per iteration (all replicas).
        devices: accelerators available; ``devices_used = dp * plan.num_ranks``.
        iteration_s: predicted iteration time with the true frozen-aware costs: ``makespan_s + grad_sync_s``.
        makespan_s: simulated 1F1B makespan of the busiest replica (``ceil(microbatches / dp)``
            microbatches).
        grad_sync_s: data-parallel gradient all-reduce after the flush (0 without ``dp_link`` or for dp 1).
        planned_iteration_s: the iteration time the choosing cost model predicted (differs from
            ``iteration_s`` for ``"frozen_unaware"``).
        lower_bound_s: ``microbatches * (total true work per microbatch) / devices``.
        bubble_fraction: idle fraction of the pipeline ranks over the makespan, averaged over ranks.
        stage_forward_s, stage_backward_s: per stage, forward and full backward (dX + dW) seconds per
            microbatch (true costs); ``stage_work_s`` is their sum.
        stage_static_bytes, stage_activation_bytes: per stage, parameters + gradients + optimizer state,
            and saved activations per in-flight microbatch.
        stage_memory_bytes: per stage, peak memory under 1F1B (static + peak in-flight x activations).
        stage_boundary_bytes: per stage, bytes sent to its successor per microbatch (its gradient alike).
        memory_cap: bytes per device the plan was checked against (None: unchecked).
        fits_memory: every rank's simulated peak is within ``memory_cap``.
        p2p: the point-to-point model used for stage transfers.
        candidates: candidates the search considered (lower-bounded); simulated: candidates timed.
        schedule: the schedule the plan is timed with (``"1f1b"``, or ``"interleaved_1f1b"`` when LLM ranks
            hold several chunks or the encoders sit on the first LLM rank); the runtime must run the same one.

    Raises:
        ValueError: when the per-stage tuples do not have one entry per stage, or an unknown method.
    """

    method: str
    layout: str
    dp: int
    stages_per_module: tuple[tuple[str, int], ...]
    plan: PipelinePlan
    microbatches: int
    devices: int
    iteration_s: float
    makespan_s: float
    grad_sync_s: float
    planned_iteration_s: float
    lower_bound_s: float
    bubble_fraction: float
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    stage_static_bytes: tuple[float, ...]
    stage_activation_bytes: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    stage_boundary_bytes: tuple[float, ...]
    memory_cap: float | None = None
    fits_memory: bool = True
    p2p: P2PModel = P2PModel()
    candidates: int = 0
    simulated: int = 0
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        if not isinstance(self.plan, PipelinePlan):
            object.__setattr__(self, "plan", PipelinePlan.from_dict(self.plan))
        if not isinstance(self.p2p, P2PModel):
            object.__setattr__(self, "p2p", P2PModel.from_dict(self.p2p))
        object.__setattr__(self, "stages_per_module", tuple((str(m), int(s)) for m, s in self.stages_per_module))
        for name in _STAGE_FIELDS:
            value = tuple(float(v) for v in getattr(self, name))
            object.__setattr__(self, name, value)
            if len(value) != self.plan.num_stages:
                raise ValueError(f"LayoutChoice.{name} has {len(value)} entries for {self.plan.num_stages} stages")
        if self.method not in METHODS:
            raise ValueError(f"LayoutChoice.method must be one of {METHODS}, got {self.method!r}")

    @property
    def microbatches_per_replica(self) -> int:
        """``ceil(microbatches / dp)``: what the busiest replica runs."""
        return -(-self.microbatches // self.dp)

    @property
    def devices_used(self) -> int:
        """``dp * pipeline ranks``."""
        return self.dp * self.plan.num_ranks

    @property
    def stage_work_s(self) -> tuple[float, ...]:
        """Per stage, forward + backward seconds per microbatch (true costs)."""
        return tuple(f + b for f, b in zip(self.stage_forward_s, self.stage_backward_s))

    @property
    def ratio_to_lower_bound(self) -> float:
        """``iteration_s / lower_bound_s`` (1 is perfect; inf when the bound is 0)."""
        return self.iteration_s / self.lower_bound_s if self.lower_bound_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the plan and p2p model as nested dicts)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["plan"] = self.plan.to_dict()
        data["p2p"] = self.p2p.to_dict()
        data["stages_per_module"] = [list(p) for p in self.stages_per_module]
        for name in _STAGE_FIELDS:
            data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LayoutChoice":
        """Inverse of ``to_dict``; raises ValueError on unknown or missing fields."""
        return dataclass_from_dict(cls, dict(data))

    def to_json(self, **kwargs: Any) -> str:
        """JSON text of ``to_dict()`` (``kwargs`` go to ``json.dumps``, e.g. ``indent=2``)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "LayoutChoice":
        """Inverse of ``to_json``."""
        return cls.from_dict(json.loads(text))


_STAGE_FIELDS = ("stage_forward_s", "stage_backward_s", "stage_static_bytes", "stage_activation_bytes",
                 "stage_memory_bytes", "stage_boundary_bytes")


def allreduce_s(num_bytes: float, dp: int, link: P2PModel | None) -> float:
    """Ring all-reduce time (s) of ``num_bytes`` over ``dp`` ranks: ``2 (dp - 1)`` messages of latency plus
    ``2 (dp - 1) / dp * num_bytes / bandwidth`` (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms", JPDC 2009). 0 when ``dp == 1`` or ``link`` is None."""
    if link is None or dp <= 1:
        return 0.0
    volume = 2.0 * (dp - 1) / dp * num_bytes
    return 2 * (dp - 1) * link.latency_s + (volume / link.bandwidth_Bps if link.bandwidth_Bps else 0.0)


# --------------------------------------------------------------------------------------------------
# The model as the search sees it


def _cost_list(units: Sequence[Unit], costs: Costs) -> list[UnitCost]:
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


class _Model:
    """Per-unit arrays of one planning view (``frozen_aware`` or not) plus the true memory."""

    def __init__(self, units: Sequence[Unit], costs: Costs, frozen_aware: bool, dtype: Any,
                 optimizer: OptimizerSpec) -> None:
        cost_list = _cost_list(units, costs)
        self.modules = check_grouping(units)
        self.encoders = self.modules[:-1]
        self.units = consistent_units(units)
        view = self.units if frozen_aware else consistent_units(units, all_trainable=True)
        self.view = view
        self.forward = [c.forward_s for c in cost_list]
        self.backward = [c.backward_s(u, frozen_aware) for u, c in zip(view, cost_list)]
        self.work = [f + b for f, b in zip(self.forward, self.backward)]
        self.grid_work = _dyadic(self.work)
        self.runs_backward = [u.runs_backward for u in view]
        self.static = [unit_static_bytes(u, c, dtype, optimizer) for u, c in zip(self.units, cost_list)]
        self.activation = [unit_activation_bytes(u, c) for u, c in zip(self.units, cost_list)]
        self.output = [float(c.output_bytes) for c in cost_list]
        self.grad = [float(c.param_bytes) if u.trainable else 0.0 for u, c in zip(view, cost_list)]
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


# --------------------------------------------------------------------------------------------------
# Partitions (memoised) and candidate stages


class _Partitions:
    """Minimum-bottleneck partitions of each module chain, memoised; a memory-capped partition only when
    the plain one does not fit (the two coincide whenever the plain one fits: same exact optimum, same
    tie-break)."""

    def __init__(self, model: _Model, memory_cap: float | None) -> None:
        self.model, self.cap = model, memory_cap
        self._plain: dict[tuple[str, int], Ranges] = {}
        self._capped: dict[tuple, Ranges | None] = {}
        self.llm_terms: dict[int, tuple[np.ndarray, ...]] = {}
        self._sums: dict[tuple[int, int], tuple] = {}

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
        key = ("cyclic", ranks, v)
        if key not in self._capped:
            self._capped[key] = _balance_cyclic(self.model.prefix["W"], list(self.plain(LLM_MODULE, v * ranks)),
                                                ranks)
        return self._capped[key]

    def grad_floor(self, module: str, stages: int) -> float:
        """Least possible largest stage gradient (bytes) over partitions of ``module`` into ``stages``: the
        min-max partition of its units' gradient bytes (memoised)."""
        key = ("grad", module, stages)
        if key not in self._capped:
            a, b = self.model.span[module]
            grads = _dyadic(self.model.grad[a:b])
            ranges = partition_chain(grads, stages)
            self._capped[key] = max(math.fsum(grads[x:y]) for x, y in ranges)
        return self._capped[key]

    def chunk(self, a: int, b: int) -> tuple:
        """Memoised sums of units ``[a, b)``: (forward s, backward s, runs backward, output bytes of the last
        unit, static bytes, activation bytes, gradient bytes)."""
        key = (a, b)
        found = self._sums.get(key)
        if found is None:
            m = self.model
            found = (m.total("F", a, b), m.total("B", a, b), any(m.runs_backward[a:b]), m.output[b - 1],
                     m.total("S", a, b), m.total("A", a, b), m.total("G", a, b))
            self._sums[key] = found
        return found

    def memory(self, ranges: Ranges, in_flight: Sequence[int]) -> list[float]:
        """Per-range memory (bytes): static + in-flight x activations."""
        return [self.chunk(a, b)[4] + f * self.chunk(a, b)[5] for (a, b), f in zip(ranges, in_flight)]

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
    work, chunk ``j`` on rank ``j mod ranks`` (``_Partitions.cyclic``): the better of ``ranges`` and the
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
class _Stages:
    """One candidate made concrete: per stage (plan order) its unit chunks and what the search needs."""

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


def _in_flight(stages: int, extra_depth: int, microbatches: int) -> tuple[int, ...]:
    """1F1B peak in-flight microbatches ``min(depth, M_r)`` of a chain's stages, depth ``stages - i + extra``."""
    return tuple(min(stages - i + extra_depth, microbatches) for i in range(stages))


def _module_chunks(parts: _Partitions, layout: str, counts: Sequence[int], nb: int,
                   llm: Ranges | None = None) -> list[list[Ranges]] | None:
    """Per module (plan order), its ranges (the LLM's ``llm`` when given); None when memory rules a module
    out. Colocated encoders are partitioned one by one; if together they do not fit, each is capped at its
    share of the cap (proportional to its static + activation bytes)."""
    model = parts.model
    s_llm = counts[-1]
    llm = llm or parts.fitted(LLM_MODULE, s_llm, _in_flight(s_llm, 0, nb))
    if llm is None:
        return None
    chunks: list[Ranges] = []
    for module, s in zip(model.encoders, counts):
        ranges = parts.fitted(module, s, _in_flight(s, s_llm, nb))
        if ranges is None:
            return None
        chunks.append(ranges)
    if layout == "encoders_colocated" and len(chunks) > 1 and parts.cap is not None:
        flights = _in_flight(counts[0], s_llm, nb)
        joint = [sum(v) for v in zip(*(parts.memory(r, flights) for r in chunks))]
        if max(joint) > parts.cap:
            chunks = _shared_cap_chunks(parts, counts[0], flights)
            if chunks is None:
                return None
    return [list(c) for c in chunks] + [list(llm)]


def _shared_cap_chunks(parts: _Partitions, stages: int, flights: tuple[int, ...]) -> list[Ranges] | None:
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


def _build_stages(parts: _Partitions, layout: str, counts: Sequence[int], nb: int,
                  p2p: P2PModel, check_memory: bool = True, llm: Ranges | None = None) -> _Stages | None:
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
    return _fill_stages(parts, groups, depth, succ, nb, p2p, check_memory)


def _fill_stages(parts: _Partitions, groups: list[list[tuple[int, int]]], depth: list[int], succ: list[int],
                 nb: int, p2p: P2PModel, check_memory: bool = True) -> _Stages | None:
    """Costs, flags, transfers and memory of the stage groups; None when a stage exceeds the cap."""
    preds: list[list[int]] = [[] for _ in groups]
    for s, t in enumerate(succ):
        if t >= 0:
            preds[t].append(s)
    stages = _Stages(groups, depth, succ, preds, [], [], [], [], [], [])
    for chunks, d in zip(groups, depth):
        if len(chunks) == 1:
            f, b, rb, out, static, act, grad = parts.chunk(*chunks[0])
        else:
            columns = list(zip(*(parts.chunk(a, b) for a, b in chunks)))
            f, b, out, static, act, grad = (sum(columns[i]) for i in (0, 1, 3, 4, 5, 6))
            rb = any(columns[2])
        stages.forward.append(f)
        stages.backward.append(b)
        stages.runs_backward.append(rb)
        stages.send.append(p2p.transfer_s(out))
        stages.memory.append(static + min(d, nb) * act)
        stages.activation.append(act)
        stages.grad.append(grad)
    if check_memory and parts.cap is not None and max(stages.memory) > parts.cap:
        return None
    return stages


# --------------------------------------------------------------------------------------------------
# Lower bound and fast 1F1B timing (one stage per rank)


def _stage_bounds(st: _Stages, nb: int) -> list[float]:
    """Per stage, a lower bound on the 1F1B makespan (module docstring), stages in topological order."""
    n = len(st.forward)
    f, b, rb, send = st.forward, st.backward, st.runs_backward, st.send
    start = [0.0] * n
    for s in range(n):
        if st.succ[s] >= 0:
            t = st.succ[s]
            start[t] = max(start[t], start[s] + f[s] + send[s])
    tail = [0.0] * n  # after stage s's last backward: upstream backwards
    for s in range(n):
        for p in st.preds[s]:
            if rb[p]:
                tail[s] = max(tail[s], send[p] + b[p] + tail[p])
    trip = [0.0] * n  # end of F(s, i) to earliest start of B(s, i)
    after_f = [0.0] * n  # end of F(s, Nb-1) to the end of the iteration, for forward-only stages
    for s in range(n - 1, -1, -1):
        t = st.succ[s]
        if t < 0:
            continue
        trip[s] = send[s] + f[t] + trip[t] + b[t] + send[s]
        after_f[s] = send[s] + f[t] + (trip[t] + b[t] + tail[t] if rb[t] else after_f[t])
    bounds = []
    for s in range(n):
        if not rb[s]:
            bounds.append(start[s] + nb * f[s] + after_f[s])
            continue
        before = min(min(st.depth[s] - 1, nb) + 1, nb)
        first_b = max(before * f[s], f[s] + trip[s])
        bounds.append(start[s] + first_b + nb * b[s] + (nb - before) * f[s] + tail[s])
    return bounds


def _fast_makespan(st: _Stages, nb: int) -> float:
    """1F1B makespan (s) of ``st`` with ``nb`` microbatches, one stage per rank, by the simulator's rules
    (``simulator.simulate`` on ``schedules.one_f_one_b``): a rank runs its stage's actions in order, each
    starting when the rank is free and its inputs have arrived (``send`` seconds after the upstream
    action). Tests check equality with the simulator."""
    n = len(st.forward)
    orders = [_stage_order(st.depth[s], nb, st.runs_backward[s]) for s in range(n)]
    f_end = [[-1.0] * nb for _ in range(n)]
    b_end = [[-1.0] * nb for _ in range(n)]
    heads, free = [0] * n, [0.0] * n
    remaining = sum(len(o) for o in orders)
    sweep = 0
    while remaining:
        progressed = False
        for s in (range(n) if sweep % 2 == 0 else range(n - 1, -1, -1)):
            done = _advance(st, s, orders[s], heads, free, f_end, b_end)
            remaining -= done
            progressed |= done > 0
        sweep += 1
        if not progressed:
            raise RuntimeError("fast 1F1B timing stalled (a plait bug)")
    return max(free)


def _stage_order(depth: int, nb: int, runs_backward: bool) -> list[int]:
    """1F1B order of one stage as signed microbatch ids: ``i + 1`` forward, ``-(i + 1)`` backward."""
    if not runs_backward:
        return list(range(1, nb + 1))
    warmup = min(depth - 1, nb)
    order = list(range(1, warmup + 1))
    for i in range(nb):
        if warmup + i < nb:
            order.append(warmup + i + 1)
        order.append(-(i + 1))
    return order


def _advance(st: _Stages, s: int, order: list[int], heads: list[int], free: list[float],
             f_end: list[list[float]], b_end: list[list[float]]) -> int:
    """Run stage ``s``'s ready actions in order; returns how many ran."""
    h, clock = heads[s], free[s]
    succ, preds, send = st.succ[s], st.preds[s], st.send
    back_dep = succ >= 0 and st.runs_backward[succ]
    while h < len(order):
        code = order[h]
        if code > 0:
            i = code - 1
            ready = clock
            for p in preds:
                arrival = f_end[p][i]
                if arrival < 0:
                    break
                ready = max(ready, arrival + send[p])
            else:
                clock = f_end[s][i] = ready + st.forward[s]
                h += 1
                continue
            break
        i = -code - 1
        ready = max(clock, f_end[s][i])
        if back_dep:
            arrival = b_end[succ][i]
            if arrival < 0:
                break
            ready = max(ready, arrival + send[s])
        clock = b_end[s][i] = ready + st.backward[s]
        h += 1
    done = h - heads[s]
    heads[s], free[s] = h, clock
    return done


def _sync_s(st: _Stages, dp: int, link: P2PModel | None) -> float:
    """Gradient all-reduce after the flush: the slowest stage's (one stage per rank)."""
    return max(allreduce_s(g, dp, link) for g in st.grad)


# --------------------------------------------------------------------------------------------------
# Phase 1: vectorised lower bounds per (layout, DP degree)


@dataclass
class _Stream:
    """Candidates of one (layout, dp) sorted by their first lower bound."""

    layout: str
    dp: int
    nb: int
    bounds: np.ndarray
    counts: np.ndarray  # (candidates, modules)
    position: int = 0
    v: int = 1  # LLM chunks per LLM rank (interleaved 1F1B when > 1); the LLM count in ``counts`` is ranks
    attached: bool = False  # one stage per encoder, all on LLM rank 0


def _chain_bounds(parts: _Partitions, ranges: Ranges, nb: int, p2p: P2PModel) -> tuple[float, ...]:
    """LLM chain alone: (max bound over stages that run backward, over forward-only stages, one microbatch's
    path: every forward, then every backward, with the transfers between stages; the largest stage's
    gradient bytes)."""
    depth = [len(ranges) - j for j in range(len(ranges))]
    succ = [j + 1 if j < len(ranges) - 1 else -1 for j in range(len(ranges))]
    st = _fill_stages(_Partitions(parts.model, None), [[r] for r in ranges], depth, succ, nb, p2p)
    bounds = _stage_bounds(st, nb)
    back = [x for x, rb in zip(bounds, st.runs_backward) if rb]
    fwd = [x for x, rb in zip(bounds, st.runs_backward) if not rb]
    path = sum(st.forward) + sum(st.backward) + sum(st.send[:-1])
    path += sum(t for t, rb in zip(st.send[:-1], st.runs_backward[:-1]) if rb)
    return max(back, default=-math.inf), max(fwd, default=-math.inf), path, max(st.grad)


def _llm_terms(parts: _Partitions, nb: int, max_stages: int, p2p: P2PModel) -> tuple[np.ndarray, ...]:
    """Per LLM stage count 1..max_stages, ``_chain_bounds`` of its partition (inf when none fits memory);
    memoised per microbatch count."""
    cached = parts.llm_terms.get(nb)
    if cached is not None and len(cached[0]) >= max_stages:
        return tuple(c[:max_stages] for c in cached)
    terms = np.full((4, max_stages), math.inf)
    for s in range(1, max_stages + 1):
        ranges = parts.fitted(LLM_MODULE, s, _in_flight(s, 0, nb))
        if ranges is not None:
            terms[:, s - 1] = _chain_bounds(parts, ranges, nb, p2p)
    parts.llm_terms[nb] = tuple(terms)
    return tuple(terms)


def _encoder_terms(parts: _Partitions, modules: Sequence[str], max_stages: int, nb: int,
                   p2p: P2PModel) -> dict[str, Any]:
    """Lower-bound terms of a chain of encoder stages (one encoder, or colocated ``modules``) per stage
    count 1..max_stages: ``neck`` ``nb`` x the plain bottleneck (no partition has a smaller one);
    ``path`` the forward path into the LLM (forwards, per internal boundary the transfer of the smallest
    output that can end a stage, the projector outputs' transfer); ``through`` the last microbatch's exit, ``path + (nb - 1)`` x the least possible
    largest stage forward; ``backward`` the backward path from the LLM (0 if the chain runs none)."""
    model = parts.model
    stages = np.arange(1, max_stages + 1)
    spans = [model.span[m] for m in modules]
    necks = [[max(model.total("W", x, y) for x, y in parts.plain(m, s)) for s in stages] for m in modules]
    into_llm = p2p.transfer_s(sum(model.output[b - 1] for _, b in spans))
    forward = sum(model.total("F", a, b) for a, b in spans)
    inner = p2p.transfer_s(sum(min(model.output[a:b - 1], default=0.0) for a, b in spans))
    path = forward + (stages - 1) * inner + into_llm
    largest = max(max(model.forward[a:b]) for a, b in spans)
    through = path + (nb - 1) * np.maximum(forward / stages, largest)
    runs = any(any(model.runs_backward[a:b]) for a, b in spans)
    every = all(model.runs_backward[a] for a, _ in spans)  # every stage runs a backward: inner transfers too
    backward = sum(model.total("B", a, b) for a, b in spans) + into_llm if runs else 0.0
    backward = backward + (stages - 1) * inner if every else backward
    return {"neck": nb * np.max(necks, axis=0), "path": path, "through": through, "backward": backward}


def _stream(parts: _Partitions, layout: str, dp: int, devices: int, microbatches: int, p2p: P2PModel,
            link: P2PModel | None, v: int = 1) -> _Stream | None:
    """All candidates of (layout, dp, v) with their vectorised lower bound ``LB1``, sorted. With ``v > 1``
    the LLM entry of a candidate is its LLM rank count ``p`` (``v p`` LLM stages, interleaved 1F1B)."""
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    k = len(model.encoders)
    enc_ranks = k if layout == "encoder_parallel" else min(k, 1)
    max_llm = min(model.size(LLM_MODULE) // v, pipe - enc_ranks)
    if pipe < enc_ranks + 1 or max_llm < (2 if v > 1 else 1):
        return None
    llm = _llm_terms(parts, nb, max_llm, p2p) if v == 1 else _interleaved_llm_terms(parts, nb, max_llm, v, p2p)
    if not k:
        grids, lb = [np.arange(1, max_llm + 1)], np.maximum(llm[0], llm[1])
    else:
        grids, lb = _encoder_bounds(parts, layout, nb, pipe, max_llm, llm, p2p)
    lb = lb + _sync_bounds(parts, layout, grids, dp, link, llm[3])
    counts = np.stack([g.ravel() for g in np.broadcast_arrays(*grids)], axis=1)
    lb = np.broadcast_to(lb, np.broadcast_shapes(*(g.shape for g in grids))).ravel()
    keep = (counts.sum(axis=1) <= pipe) & np.isfinite(lb)
    counts, lb = counts[keep], lb[keep]
    order = np.lexsort((counts.sum(axis=1), lb))
    return _Stream(layout, dp, nb, lb[order], counts[order], v=v)


def _interleaved_llm_terms(parts: _Partitions, nb: int, max_ranks: int, v: int,
                           p2p: P2PModel) -> tuple[np.ndarray, ...]:
    """``_llm_terms`` for an LLM of ``v p`` stages cyclically on ``p = 1..max_ranks`` ranks (inf for
    ``p = 1`` and where even one microbatch per rank exceeds the memory cap). Per LLM rank ``i`` the bound
    is valid for any schedule whose last action on the rank is the backward of its first chunk (the
    ``interleaved_1f1b`` order): microbatch 0 reaches the rank (forwards and transfers of the LLM stages
    before it), the rank is busy ``nb`` x its chunks' work, then the upstream LLM stages' backwards follow."""
    terms = np.full((4, max_ranks), math.inf)
    for p in range(2, max_ranks + 1):
        sums = [parts.chunk(a, b) for a, b in parts.cyclic(p, v)]
        f, b, rb = [c[0] for c in sums], [c[1] for c in sums], [c[2] for c in sums]
        send = [p2p.transfer_s(c[3]) for c in sums]
        if parts.cap is not None and max(_interleaved_memory_floor(sums, p, v, nb)) > parts.cap:
            continue
        first_b = _first_backward_starts(f, b, rb, send, p, v, nb)
        back, fwd, arrive, tail = [], [], 0.0, 0.0
        for i in range(p):
            work = nb * sum(f[j] + b[j] for j in range(i, v * p, p))
            busy = arrive + work
            if first_b[i] is not None:  # the order's warm-up: rank i's first B waits for a round trip
                warm, start_b = first_b[i]
                busy = max(busy, max(start_b, arrive + warm) + work - warm)
            (back if rb[i] else fwd).append(busy + tail)
            arrive += f[i] + send[i]
            tail += send[i] + b[i] if rb[i] else 0.0
        path = sum(f) + sum(b) + sum(send[:-1]) + sum(t for t, r in zip(send[:-1], rb[:-1]) if r)
        grad = max(sum(c[6] for c in sums[i::p]) for i in range(p))
        terms[:, p - 1] = (max(back, default=-math.inf), max(fwd, default=-math.inf), path, grad)
    return tuple(terms)


def _sync_bounds(parts: _Partitions, layout: str, grids: list[np.ndarray], dp: int, link: P2PModel | None,
                 llm_grad: np.ndarray) -> np.ndarray | float:
    """Lower bound of the gradient all-reduce per candidate: the LLM partition's largest stage gradient
    (``llm_grad`` per LLM stage count) and, per encoder, the least largest stage gradient of any partition
    into the candidate's stage count (``_Partitions.grad_floor``)."""
    if link is None or dp == 1:
        return 0.0
    model = parts.model
    chains = [[m] for m in model.encoders] if layout == "encoder_parallel" else [list(model.encoders)]
    chains = [c for c in chains if c]
    most: np.ndarray | float = llm_grad.reshape([1] * len(chains) + [-1])
    for grid, modules in zip(grids, chains):
        floors = [[parts.grad_floor(m, int(g)) for g in grid.ravel()] for m in modules]
        most = np.maximum(most, np.max(floors, axis=0).reshape(grid.shape))
    return 2 * (dp - 1) * link.latency_s + 2.0 * (dp - 1) / dp * most / (link.bandwidth_Bps or math.inf)


def _encoder_bounds(parts: _Partitions, layout: str, nb: int, pipe: int, max_llm: int,
                    llm: tuple[np.ndarray, ...], p2p: P2PModel) -> tuple[list[np.ndarray], np.ndarray]:
    """Grids (one axis per encoder chain: each encoder for ``encoder_parallel``, one shared count for
    ``encoders_colocated``; then the LLM) and LB1: the largest of the encoder bottlenecks, the LLM chain
    bound after the encoder paths, and each encoder chain's ``through`` plus the LLM path."""
    model = parts.model
    chains = [[m] for m in model.encoders] if layout == "encoder_parallel" else [list(model.encoders)]
    axes = len(chains) + 1
    grids, neck, path, through, backward = [], 0.0, 0.0, 0.0, np.zeros(1)
    for axis, modules in enumerate(chains):
        top = min(min(model.size(m) for m in modules), pipe - len(chains))
        terms = _encoder_terms(parts, modules, top, nb, p2p)
        shape = [1] * axes
        shape[axis] = top
        grids.append(np.arange(1, top + 1).reshape(shape))
        neck = np.maximum(neck, terms["neck"].reshape(shape))
        path = np.maximum(path, terms["path"].reshape(shape))
        through = np.maximum(through, terms["through"].reshape(shape))
        backward = np.maximum(backward, np.broadcast_to(terms["backward"], (top,)).reshape(shape))
    shape = [1] * (axes - 1) + [max_llm]
    grids.append(np.arange(1, max_llm + 1).reshape(shape))
    back, fwd, llm_path = (t.reshape(shape) for t in llm[:3])
    chain = path + np.maximum(back + backward, fwd)
    return grids, np.maximum(np.maximum(neck, chain), through + llm_path + backward)


# --------------------------------------------------------------------------------------------------
# Phase 2: branch and bound


@dataclass
class _Best:
    time: float = math.inf
    key: tuple = ()
    stages: _Stages | None = None
    layout: str = ""
    dp: int = 0
    counts: tuple[int, ...] = ()
    v: int = 1
    attached: bool = False


def _counts_tuple(model: _Model, layout: str, row: np.ndarray) -> tuple[int, ...]:
    """Stage count per module (encoders in order, LLM last) of a stream row."""
    values = [int(v) for v in row]
    if layout == "encoders_colocated" and model.encoders:
        return tuple([values[0]] * len(model.encoders) + [values[1]])
    return tuple(values)


def _search(parts: _Partitions, streams: list[_Stream], p2p: P2PModel, link: P2PModel | None,
            rel_tol: float, budget: int = 10**9) -> tuple[_Best, int, int]:
    """Branch and bound over the streams (module docstring). Returns the best, candidates considered and
    candidates simulated."""
    heap: list[tuple] = []
    seq = 0
    for index, stream in enumerate(streams):
        if len(stream.bounds):
            heap.append((float(stream.bounds[0]), 0, seq, 0, index, None))
            seq += 1
    heapq.heapify(heap)
    best, considered, timed = _Best(), 0, 0
    while heap and heap[0][0] * (1 + rel_tol) < best.time:
        bound, used, _, refined, index, payload = heapq.heappop(heap)
        stream = streams[index]
        if not refined:
            counts = _counts_tuple(parts.model, stream.layout, stream.counts[stream.position])
            stream.position += 1
            if stream.position < len(stream.bounds):
                heapq.heappush(heap, (float(stream.bounds[stream.position]), 0, seq, 0, index, None))
                seq += 1
            considered += 1
            if stream.v > 1 or stream.attached:  # timed at once on the real orders (no second bound)
                if budget <= 0:
                    continue
                budget -= 1
                found = _interleaved_candidate(parts, stream, counts, p2p, link)
                timed += 1
                ranks = counts[-1] if stream.attached else sum(counts)
                if found is not None:
                    key = (found[0], ranks * stream.dp, stream.v, stream.layout, counts, stream.attached)
                    if best.stages is None or key < (best.time, *best.key):
                        best = _Best(found[0], key[1:], found[1], stream.layout, stream.dp, counts, stream.v,
                                     stream.attached)
                continue
            st = _build_stages(parts, stream.layout, counts, stream.nb, p2p)
            if st is not None:
                tight = max(bound, max(_stage_bounds(st, stream.nb)) + _sync_s(st, stream.dp, link))
                heapq.heappush(heap, (tight, sum(counts) * stream.dp, seq, 1, index, (counts, st)))
                seq += 1
            continue
        counts, st = payload
        timed += 1
        total = _fast_makespan(st, stream.nb) + _sync_s(st, stream.dp, link)
        key = (total, used, 1, stream.layout, counts, False)
        if best.stages is None or key < (best.time, *best.key):
            best = _Best(total, key[1:], st, stream.layout, stream.dp, counts)
    return best, considered, timed


# --------------------------------------------------------------------------------------------------
# Interleaved candidates (several LLM chunks per rank): timed on the real schedule order


def _attached_stream(parts: _Partitions, dp: int, devices: int, microbatches: int, p2p: P2PModel,
                     v: int) -> _Stream | None:
    """Candidates with every encoder one stage on LLM rank 0 and the LLM on ``p = 2..`` ranks (``v`` chunks
    each), sorted by a lower bound valid for any schedule: per LLM rank, microbatch 0's arrival (the
    encoders' forwards run on rank 0 first), ``nb`` x its work (rank 0: with the encoders'), then the
    upstream LLM backwards; and one microbatch's whole path; plus nothing for the all-reduce."""
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    top = min(model.size(LLM_MODULE) // v, pipe)
    spans = [model.span[m] for m in model.encoders]
    enc_f = sum(model.total("F", a, b) for a, b in spans)
    enc_w = sum(model.total("W", a, b) for a, b in spans)
    enc_static = sum(model.total("S", a, b) + model.total("A", a, b) for a, b in spans)
    bounds, rows = [], []
    for p in range(2, top + 1):
        ranges = parts.cyclic(p, v) if v > 1 else parts.fitted(LLM_MODULE, p, _in_flight(p, 0, nb))
        if ranges is None:
            continue
        sums = [parts.chunk(a, b) for a, b in ranges]
        floor = _interleaved_memory_floor(sums, p, v, nb) if v > 1 else [c[4] + c[5] for c in sums]
        if parts.cap is not None and (floor[0] + enc_static > parts.cap or max(floor) > parts.cap):
            continue
        arrive, tail, worst = enc_f, 0.0, 0.0
        for i in range(p):
            work = sum(c[0] + c[1] for c in sums[i::p]) + (enc_w if i == 0 else 0.0)
            worst = max(worst, (0.0 if i == 0 else arrive) + nb * work + tail)
            arrive += sums[i][0] + p2p.transfer_s(sums[i][3])
            tail += p2p.transfer_s(sums[i][3]) + sums[i][1] if sums[i][2] else 0.0
        bounds.append(max(worst, sum(model.work)))
        rows.append([1] * len(model.encoders) + [p])
    if not rows:
        return None
    order = np.argsort(np.asarray(bounds), kind="stable")
    return _Stream("encoder_parallel", dp, nb, np.asarray(bounds)[order], np.asarray(rows)[order], v=v,
                   attached=True)


def _first_backward_starts(f: Sequence[float], b: Sequence[float], rb: Sequence[bool], send: Sequence[float],
                           p: int, v: int, nb: int) -> list[tuple[float, float] | None]:
    """Per LLM rank ``i`` of ``interleaved_1f1b``: (forward seconds of the ``warm-up + 1`` forwards it runs
    before its first backward, the earliest start of that backward ``B(stage (v-1) p + i, 0)``: microbatch
    0's forwards through every LLM stage and backwards down to it, with transfers; both from microbatch 0
    reaching the LLM). None where the stages after it do not all run backward."""
    k = v * p
    forward_end = sum(f) + sum(send[:-1])
    warmups = interleaved_warmups(p, v, nb)
    order = interleaved_chunk_order(nb, v, p)
    out: list[tuple[float, float] | None] = []
    for i in range(p):
        s = (v - 1) * p + i
        if not all(rb[s:]):
            out.append(None)
            continue
        start = forward_end + sum(b[s + 1:]) + sum(send[s:k - 1])
        warm = sum(f[c * p + i] for c, _ in order[: warmups[i] + 1])
        out.append((warm, start))
    return out


def _interleaved_memory_floor(sums: Sequence[tuple], p: int, v: int, nb: int) -> list[float]:
    """Per LLM rank, a floor of its peak memory under ``interleaved_1f1b``: static bytes of its chunks plus
    the activations of its warm-up forwards and the first steady forward, all held before its first
    backward (``sums``: ``_Partitions.chunk`` of each LLM stage)."""
    warmups = interleaved_warmups(p, v, nb)
    order = interleaved_chunk_order(nb, v, p)
    out = []
    for i in range(p):
        held = sum(sums[c * p + i][5] for c, _ in order[: warmups[i] + 1] if sums[c * p + i][2])
        out.append(sum(c[4] for c in sums[i::p]) + held)
    return out


def _interleaved_candidate(parts: _Partitions, stream: _Stream, counts: tuple[int, ...], p2p: P2PModel,
                           link: P2PModel | None) -> tuple[float, _Stages] | None:
    """(planning-view iteration time, stages) of a candidate with ``counts[-1]`` LLM ranks holding
    ``stream.v`` chunks each (``interleaved_1f1b``, which is 1F1B when ``v = 1``), its encoder stages on their own
    ranks or, for ``stream.attached``, on LLM rank 0; None when it does not fit memory (the simulated
    per-rank peak, checked exactly)."""
    p, v, nb = counts[-1], stream.v, stream.nb
    llm = parts.cyclic(p, v) if v > 1 else parts.fitted(LLM_MODULE, p, _in_flight(p, 0, nb))
    st = None if llm is None else _build_stages(parts, stream.layout, counts[:-1] + (v * p,), nb, p2p, False, llm)
    if st is None:
        return None
    n_enc = len(st.forward) - v * p
    if parts.cap is not None and not stream.attached and max(st.memory[:n_enc], default=0.0) > parts.cap:
        return None
    plan = _plan_from_chunks(parts.model, parts.model.view, stream.layout, st.chunks,
                             stage_ranks(n_enc, p, v, stream.attached))
    orders = interleaved_orders(plan, nb)
    timing = _time_orders(plan, orders, st, nb)
    if timing is None:  # the unchecked orders stalled: take the generator's safety net
        timing = _time_orders(plan, interleaved_1f1b(plan, nb).actions, st, nb)
    makespan, live = timing
    memory = [0.0] * plan.num_ranks
    grads = [0.0] * plan.num_ranks
    for stage in plan.stages:
        memory[stage.rank] += sum(parts.chunk(a, b)[4] for a, b in st.chunks[stage.index])
        grads[stage.rank] += st.grad[stage.index]
    if parts.cap is not None and max(m + x for m, x in zip(memory, live)) > parts.cap:
        return None
    return makespan + max(allreduce_s(g, stream.dp, link) for g in grads), st


def _time_orders(plan: PipelinePlan, orders: Sequence[Sequence[Action]], st: _Stages,
                 nb: int) -> tuple[float, list[float]] | None:
    """Makespan (s) and per-rank peak live activation bytes of per-rank ``orders`` by the simulator's rules
    (``simulator.simulate``: in-order ranks, transfers of ``st.send`` between ranks, none within a rank;
    activations from a forward's start to its stage's backward's end, or its own end for a forward-only
    stage); None when the orders stall. Tests check equality with the simulator."""
    rank = [s.rank for s in plan.stages]
    succ = [(plan.successors(s) or (-1,))[0] for s in range(plan.num_stages)]
    preds = [plan.predecessors(s) for s in range(plan.num_stages)]
    back = [s.runs_backward for s in plan.stages]
    f_end = [[-1.0] * nb for _ in plan.stages]
    b_end = [[-1.0] * nb for _ in plan.stages]
    f_start = [[0.0] * nb for _ in plan.stages]
    heads, free = [0] * len(orders), [0.0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, actions in enumerate(orders):
            h, clock = heads[r], free[r]
            while h < len(actions):
                a = actions[h]
                s, i = a.stage, a.microbatch
                if a.kind == "F":
                    ready = clock
                    for q in preds[s]:
                        if f_end[q][i] < 0:
                            break
                        ready = max(ready, f_end[q][i] + (0.0 if rank[q] == r else st.send[q]))
                    else:
                        f_start[s][i] = ready
                        clock = f_end[s][i] = ready + st.forward[s]
                        h += 1
                        continue
                    break
                t = succ[s]
                ready = max(clock, f_end[s][i])
                if t >= 0 and back[t]:
                    if b_end[t][i] < 0:
                        break
                    ready = max(ready, b_end[t][i] + (0.0 if rank[t] == r else st.send[s]))
                clock = b_end[s][i] = ready + st.backward[s]
                h += 1
            remaining -= h - heads[r]
            progressed |= h > heads[r]
            heads[r], free[r] = h, clock
        if not progressed:
            return None
    return max(free), _live_peaks(plan, st, nb, f_start, f_end, b_end)


def _live_peaks(plan: PipelinePlan, st: _Stages, nb: int, f_start: list[list[float]], f_end: list[list[float]],
                b_end: list[list[float]]) -> list[float]:
    """Per rank, the most activation bytes live at once (frees before allocations at equal times)."""
    deltas: list[list[tuple[float, int, float]]] = [[] for _ in range(plan.num_ranks)]
    for stage in plan.stages:
        s = stage.index
        nbytes = st.activation[s]
        ends = b_end[s] if stage.runs_backward else f_end[s]
        for i in range(nb):
            deltas[stage.rank].append((f_start[s][i], 1, nbytes))
            deltas[stage.rank].append((ends[i], 0, -nbytes))
    peaks = []
    for rank_deltas in deltas:
        live = peak = 0.0
        for _, _, delta in sorted(rank_deltas):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


# --------------------------------------------------------------------------------------------------
# Public API


def _dp_candidates(devices: int, microbatches: int, dp_degrees: Sequence[int] | None) -> list[int]:
    """DP degrees to try: ``dp_degrees``, or the divisors of ``devices`` up to ``microbatches``.

    Raises:
        ValueError: on a degree < 1, above ``devices`` or above ``microbatches``.
    """
    if dp_degrees is None:
        return [d for d in range(1, min(devices, microbatches) + 1) if devices % d == 0]
    out = sorted({int(d) for d in dp_degrees})
    for d in out:
        if not 1 <= d <= min(devices, microbatches):
            raise ValueError(f"dp_degrees: {d} must be in 1..min(devices, microbatches) = "
                             f"1..{min(devices, microbatches)}")
    return out


def _check_common(devices: int, microbatches: int, memory_cap: float | None, rel_tol: float = 0.0) -> None:
    if int(devices) != devices or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if int(microbatches) != microbatches or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if memory_cap is not None and not (math.isfinite(memory_cap) and memory_cap > 0):
        raise ValueError(f"memory_cap must be a finite number > 0 or None, got {memory_cap!r}")
    if not (math.isfinite(rel_tol) and rel_tol >= 0):
        raise ValueError(f"rel_tol must be finite and >= 0, got {rel_tol!r}")


def plan_layout(
    units: Sequence[Unit],
    costs: Costs,
    devices: int,
    *,
    microbatches: int,
    frozen_aware: bool = True,
    memory_cap: float | None = None,
    p2p: P2PModel | None = None,
    dp_link: P2PModel | None = None,
    layouts: Sequence[str] = LAYOUTS,
    dp_degrees: Sequence[int] | None = None,
    rel_tol: float = 0.0,
    dtype: Any = "bfloat16",
    optimizer: OptimizerSpec = OptimizerSpec(),
    virtual_stages: Sequence[int] = (1,),
    attach_encoders: bool = False,
    max_timed: int = 256,
) -> LayoutChoice:
    """Search layout, stages per module, DP degree and LLM chunks per rank minimising the predicted
    iteration time.

    Args:
        units: pipeline units, grouped by module, encoders first and the LLM (``"llm"``) last.
        costs: one ``UnitCost`` per unit (same order) or a mapping from unit name.
        devices: accelerators available (``dp * pipeline ranks <= devices``).
        microbatches: global microbatches per iteration, split over the DP replicas.
        frozen_aware: plan with the true frozen-aware costs (True) or as the frozen-unaware baseline
            (module docstring); the returned times are always the true ones.
        memory_cap: bytes per device (parameters, gradients, optimizer state, 1F1B activations); None: no cap.
        p2p: transfer model between pipeline stages (default free and instant).
        dp_link: link of the gradient all-reduce between replicas (None: not modelled).
        layouts: layouts to consider (a model without encoders has one layout either way).
        dp_degrees: DP degrees to consider (default: divisors of ``devices`` up to ``microbatches``).
        rel_tol: stop when no candidate can beat the best by more than this fraction (0: exact optimum).
        dtype, optimizer: parameter dtype and optimizer memory per trainable parameter.
        virtual_stages: LLM chunks per LLM rank ``v`` to consider: 1 is 1F1B with one stage per rank; ``v > 1``
            splits the LLM into ``v p`` stages cyclically on ``p >= 2`` ranks, run with
            ``schedules.interleaved_1f1b`` (``v p`` at most the LLM's unit count). Default ``(1,)``; the
            benchmark passes ``(1, 2, 4)``.
        attach_encoders: also consider plans whose encoders are one stage each on the first LLM rank (the
            rank runs an encoder forward just before the first LLM stage's, its backward just after), for
            every LLM rank count and ``v``; the time of such a candidate is bounded by its busiest rank
            (``_attached_stream``) and it is timed on the real schedule order.
        max_timed: at most this many interleaved / attached candidates are timed (in increasing lower bound;
            each costs a schedule and a timing pass); the search is exact over them only when fewer have a
            bound below the best time (1F1B candidates with one stage per rank are not limited).

    Returns:
        The best ``LayoutChoice`` (method ``"plait"`` or ``"frozen_unaware"``; ``schedule`` says which).

    Raises:
        ValueError: on bad arguments (named), an unknown layout, or when no candidate fits the memory cap.
    """
    _check_common(devices, microbatches, memory_cap, rel_tol)
    unknown = [lay for lay in layouts if lay not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {list(layouts)}")
    if not virtual_stages or any(int(v) != v or v < 1 for v in virtual_stages):
        raise ValueError(f"virtual_stages must be a non-empty list of integers >= 1, got {list(virtual_stages)}")
    p2p = p2p or P2PModel()
    model = _Model(units, costs, frozen_aware, dtype, optimizer)
    parts = _Partitions(model, memory_cap)
    chosen_layouts = list(dict.fromkeys(layouts)) if model.encoders else [layouts[0]]
    streams = [s for v in sorted({int(x) for x in virtual_stages}) for lay in chosen_layouts
               for d in _dp_candidates(devices, microbatches, dp_degrees)
               if (s := _stream(parts, lay, d, devices, microbatches, p2p, dp_link, v)) is not None]
    if attach_encoders and model.encoders:
        streams += [s for v in sorted({int(x) for x in virtual_stages})
                    for d in _dp_candidates(devices, microbatches, dp_degrees)
                    if (s := _attached_stream(parts, d, devices, microbatches, p2p, v)) is not None]
    best, considered, timed = _search(parts, streams, p2p, dp_link, rel_tol, max_timed)
    common = dict(microbatches=microbatches, devices=devices, p2p=p2p, dp_link=dp_link, memory_cap=memory_cap,
                  method="plait" if frozen_aware else "frozen_unaware", dtype=dtype, optimizer=optimizer)
    single = _single_rank(model, units, costs, max(_dp_candidates(devices, microbatches, dp_degrees)), dp_link,
                          common)
    if single is not None and (best.stages is None or single[0] < best.time):
        return dataclasses.replace(single[1], candidates=considered + 1, simulated=timed + 1)
    if best.stages is None:
        raise ValueError(f"no layout fits: every candidate for {devices} devices exceeds memory_cap={memory_cap} "
                         "bytes (or has fewer pipeline ranks than modules)")
    plan = _plan_from_stages(model, best)
    schedule = "interleaved_1f1b" if best.v > 1 or best.attached else "1f1b"
    return evaluate_plan(plan, units, costs, dp=best.dp, planned_iteration_s=best.time, candidates=considered,
                         simulated=timed + (single is not None), schedule=schedule, **common)


def _single_rank(model: _Model, units: Sequence[Unit], costs: Costs, dp: int, dp_link: P2PModel | None,
                 common: dict[str, Any]) -> tuple[float, LayoutChoice] | None:
    """The no-pipeline candidate: every module's single stage on one rank, ``dp`` replicas. One rank never
    waits, so its time in the planning view is ``M_r * sum(work) + all-reduce``. None when it does not fit
    memory (checked with the simulator's in-flight peaks)."""
    layout = "encoders_colocated" if model.encoders else "encoder_parallel"
    plan = plan_pipeline(model.units, layout, ranks=[0] * (1 + min(len(model.encoders), 1)))
    choice = evaluate_plan(plan, units, costs, dp=dp, **common)
    if not choice.fits_memory:
        return None
    nb = -(-common["microbatches"] // dp)
    planned = nb * math.fsum(model.work) + allreduce_s(math.fsum(model.grad), dp, dp_link)
    return planned, dataclasses.replace(choice, planned_iteration_s=planned)


def _plan_from_stages(model: _Model, best: _Best) -> PipelinePlan:
    """The ``PipelinePlan`` of the best candidate (splits at its chunk boundaries; LLM chunks cyclic over
    the LLM ranks when ``best.v > 1``)."""
    ranks = None
    if best.v > 1 or best.attached:
        n_enc = len(best.stages.chunks) - best.v * best.counts[-1]
        ranks = stage_ranks(n_enc, best.counts[-1], best.v, best.attached)
    return _plan_from_chunks(model, model.units, best.layout, best.stages.chunks, ranks)


def _plan_from_chunks(model: _Model, units: Sequence[Unit], layout: str, chunks: Sequence[Sequence[tuple[int, int]]],
                      ranks: Sequence[int] | None = None) -> PipelinePlan:
    """``plan_pipeline`` of ``units`` (true or planning view) split at the starts of ``chunks``."""
    starts: dict[str, list[str]] = {m: [] for m in model.modules}
    for stage_chunks in chunks:
        for a, _ in stage_chunks:
            unit = units[a]
            if a != model.span[unit.module][0]:
                starts[unit.module].append(unit.name)
    return plan_pipeline(units, layout, splits=starts, ranks=ranks)


def evaluate_plan(
    plan: PipelinePlan,
    units: Sequence[Unit],
    costs: Costs,
    *,
    dp: int,
    microbatches: int,
    devices: int | None = None,
    p2p: P2PModel | None = None,
    dp_link: P2PModel | None = None,
    memory_cap: float | None = None,
    method: str = "given",
    planned_iteration_s: float | None = None,
    candidates: int = 0,
    simulated: int = 0,
    dtype: Any = "bfloat16",
    optimizer: OptimizerSpec = OptimizerSpec(),
    schedule: str | None = None,
) -> LayoutChoice:
    """Time ``plan`` with the true frozen-aware costs: ``simulator.simulate`` on its schedule (``schedule``,
    a ``schedules.SCHEDULE_NAMES`` entry; default ``"interleaved_1f1b"`` when ``schedules.runs_interleaved``,
    else ``"1f1b"``) with ``ceil(microbatches / dp)`` microbatches, plus the gradient all-reduce of
    each rank's trainable parameters over ``dp`` replicas (after the flush; the slowest rank's).

    Args:
        plan: a pipeline plan over ``units`` (flags as ``consistent_units``; its ``num_microbatches`` is
            replaced).
        units, costs: as ``plan_layout``.
        dp: DP degree; microbatches: global microbatches; devices: for ``lower_bound_s`` (default
            ``dp * plan.num_ranks``).
        p2p, dp_link, memory_cap, dtype, optimizer: as ``plan_layout``.
        method, planned_iteration_s, candidates, simulated: recorded in the result
            (``planned_iteration_s`` defaults to the true time).

    Raises:
        ValueError: when the plan does not match the units, on bad numbers, or ``dp * ranks > devices``.
    """
    _check_common(devices or 1, microbatches, memory_cap)
    if int(dp) != dp or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    devices = devices or dp * plan.num_ranks
    if dp * plan.num_ranks > devices:
        raise ValueError(f"dp {dp} x {plan.num_ranks} pipeline ranks exceeds devices={devices}")
    p2p = p2p or P2PModel()
    true_units = consistent_units(units)
    check_plan_units(plan, true_units)
    cost_map = dict(zip((u.name for u in true_units), _cost_list(units, costs)))
    nb = -(-microbatches // dp)
    plan = plan.replace(num_microbatches=nb)
    name = schedule or ("interleaved_1f1b" if runs_interleaved(plan) else "1f1b")
    schedule = build_schedule(plan, name)
    action = stage_costs_from_units(plan, true_units, cost_map)
    boundary = boundary_bytes_from_units(plan, cost_map)
    memory = _stage_memory(plan, true_units, cost_map, dtype, optimizer)
    result = simulate(schedule, action, p2p=p2p, boundary_bytes=boundary, memory=memory)
    peaks = in_flight_peaks(schedule)
    by_name = _by_name(true_units)
    grads = [0.0] * plan.num_ranks
    for stage in plan.stages:
        grads[stage.rank] += sum(cost_map[n].param_bytes for n in stage.units if by_name[n].trainable)
    sync = max(allreduce_s(g, dp, dp_link) for g in grads)
    work = sum(c.forward_s + c.backward_s(u) for u, c in zip(true_units, cost_map.values()))
    n = plan.num_stages
    fits = memory_cap is None or max(result.peak_memory_bytes) <= memory_cap
    return LayoutChoice(
        method=method, layout=plan.layout, dp=dp,
        stages_per_module=tuple((m, len(plan.module_stages(m))) for m in plan.modules), plan=plan,
        microbatches=microbatches, devices=devices, iteration_s=result.makespan_s + sync,
        makespan_s=result.makespan_s, grad_sync_s=sync,
        planned_iteration_s=result.makespan_s + sync if planned_iteration_s is None else planned_iteration_s,
        lower_bound_s=microbatches * work / devices, bubble_fraction=result.mean_bubble_fraction,
        stage_forward_s=[action[(s, "F")] for s in range(n)], stage_backward_s=[action[(s, "B")] for s in range(n)],
        stage_static_bytes=[memory[s].static_bytes for s in range(n)],
        stage_activation_bytes=[memory[s].activation_bytes for s in range(n)],
        stage_memory_bytes=[memory[s].static_bytes + peaks[s] * memory[s].activation_bytes for s in range(n)],
        stage_boundary_bytes=[boundary[s] for s in range(n)], memory_cap=memory_cap, fits_memory=fits, p2p=p2p,
        candidates=candidates, simulated=simulated, schedule=name,
    )


def _by_name(units: Sequence[Unit]) -> dict[str, Unit]:
    return {u.name: u for u in units}


def _stage_memory(plan: PipelinePlan, units: Sequence[Unit], cost_map: Mapping[str, UnitCost], dtype: Any,
                  optimizer: OptimizerSpec) -> dict[int, StageMemory]:
    """Per stage: static bytes (parameters, gradients, optimizer state) and activation bytes per microbatch."""
    by_name = _by_name(units)
    out = {}
    for stage in plan.stages:
        pairs = [(by_name[n], cost_map[n]) for n in stage.units]
        static = sum(unit_static_bytes(u, c, dtype, optimizer) for u, c in pairs)
        act = sum(unit_activation_bytes(u, c) for u, c in pairs)
        out[stage.index] = StageMemory(int(round(static)), int(round(act)))
    return out


def megatron_even_split(
    units: Sequence[Unit],
    costs: Costs,
    devices: int,
    *,
    microbatches: int,
    dp: int | None = None,
    memory_cap: float | None = None,
    p2p: P2PModel | None = None,
    dp_link: P2PModel | None = None,
    dtype: Any = "bfloat16",
    optimizer: OptimizerSpec = OptimizerSpec(),
) -> LayoutChoice:
    """Megatron-style baseline: the units, encoders first, spread evenly by count over the
    ``devices // dp`` pipeline ranks (the first ``n mod ranks`` ranks get one unit more). A rank whose run
    of units crosses a module boundary holds one stage per module (stages sharing a rank); the plan's
    layout is ``encoder_parallel`` (each encoder's chunks feed the first LLM stage).

    With an explicit ``dp`` the plan is returned whether or not it fits (see ``fits_memory``). With
    ``dp=None`` every divisor of ``devices`` (up to ``microbatches``, leaving at least one unit per
    rank) is tried and, among those whose plan fits ``memory_cap``, the one with the lowest iteration time
    predicted by the frozen-unaware cost model is kept, as a Megatron user tuning with that model would.
    When none fits, the best of all is returned with ``fits_memory=False`` (such a run would need
    activation recomputation or a memory-capped schedule, which this baseline does not model).

    Returns:
        A ``LayoutChoice`` (method ``"megatron_even"``) timed with the true costs.

    Raises:
        ValueError: on bad arguments, or fewer units than the pipeline ranks of every DP degree.
    """
    _check_common(devices, microbatches, memory_cap)
    if dp is not None:
        return _megatron_for(units, costs, devices, microbatches, dp, memory_cap, p2p, dp_link, dtype, optimizer)
    choices = [_megatron_for(units, costs, devices, microbatches, d, memory_cap, p2p, dp_link, dtype, optimizer)
               for d in _dp_candidates(devices, microbatches, None) if devices // d <= len(units)]
    if not choices:
        raise ValueError(f"{len(units)} units cannot fill the pipeline ranks of any DP degree of {devices} devices")
    fitting = [c for c in choices if c.fits_memory] or choices
    return min(fitting, key=lambda c: c.planned_iteration_s)


def _megatron_for(units, costs, devices, microbatches, dp, memory_cap, p2p, dp_link, dtype, optimizer):
    """Even split for one DP degree, timed true and frozen-unaware."""
    ranks = devices // dp
    if ranks < 1 or ranks > len(units):
        raise ValueError(f"dp={dp} leaves {ranks} pipeline ranks for {len(units)} units; need 1..{len(units)}")
    true_units = consistent_units(units)
    base, extra = divmod(len(true_units), ranks)
    rank_of = [r for r in range(ranks) for _ in range(base + (r < extra))]
    splits: dict[str, list[str]] = {}
    rank_per_stage, previous = [], None
    for index, unit in enumerate(true_units):
        key = (unit.module, rank_of[index])
        if key != previous:
            if previous is not None and previous[0] == unit.module:
                splits.setdefault(unit.module, []).append(unit.name)
            rank_per_stage.append(rank_of[index])
            previous = key
    plan = plan_pipeline(true_units, "encoder_parallel", splits=splits, ranks=rank_per_stage)
    common = dict(dp=dp, microbatches=microbatches, devices=devices, p2p=p2p, dp_link=dp_link,
                  memory_cap=memory_cap, dtype=dtype, optimizer=optimizer)
    unaware_units = consistent_units(units, all_trainable=True)
    unaware_costs = [_unaware_cost(c) for c in _cost_list(units, costs)]
    planned = evaluate_plan(plan_pipeline(unaware_units, "encoder_parallel", splits=splits, ranks=rank_per_stage),
                            unaware_units, unaware_costs, **common)
    return evaluate_plan(plan, units, costs, method="megatron_even", planned_iteration_s=planned.iteration_s,
                         **common)


def _unaware_cost(cost: UnitCost) -> UnitCost:
    """The cost as the frozen-unaware model charges it on an all-trainable unit: backward ``dX + dW`` even
    where no input gradient is needed (``UnitCost.backward_s(unit, frozen_aware=False)``), booked as dW."""
    return dataclasses.replace(cost, input_grad_s=0.0, weight_grad_s=cost.input_grad_s + cost.weight_grad_s)
