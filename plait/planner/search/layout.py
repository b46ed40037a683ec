"""Automatic layout search: modality layout, stages per module and DP degree of an MLLM pipeline.

Given the pipeline units of a model and their costs, ``plan_layout`` chooses, for ``devices`` accelerators
and a global batch of ``microbatches`` microbatches:

- the layout (Cornstarch, "Modality parallelism"): ``"encoder_parallel"`` (each
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

Search (exact branch and bound over this space; the modules below hold its parts):

- ``search_model``: the candidate model: per-unit arrays, the minimum-bottleneck partition per module and
  stage count (memoised; a memory-capped one only when the plain one does not fit), concrete stages;
- ``search_bounds``: per (layout, DP degree, ``v``), every candidate with a vectorised lower bound, sorted;
- ``search_candidates``: the branch and bound (candidates in increasing bound, a tighter bound for a taken
  candidate, timing only when it is again the smallest) and the timing of candidates with the simulator's
  core (``simulator.time_actions``); the chosen plan is then simulated with ``simulator.simulate`` itself
  (``evaluate_plan``), always with the true frozen-aware costs.

With ``rel_tol = 0`` the result is optimal over the search space. The space also holds the no-pipeline
candidate (every module on one rank, largest DP degree). It does not hold plans whose stages share ranks
across modules (``megatron_even_split`` makes such plans), nor partitions other than the minimum-bottleneck
one per module and stage count (these are not always makespan-optimal: a different split can occasionally
be faster by a fraction of a percent). The space is small per module but its product is large (1,024 GPUs
and three modules: about 10^6 candidates), and timing one candidate costs milliseconds: hence the bounds.

Frozen-unaware baseline: with ``frozen_aware=False`` the search believes every unit trains (work
``f + dX + dW`` everywhere, every stage runs a backward, every parameter is all-reduced), as a planner that
ignores frozen-ness would; memory always follows the real flags (it is the limit
the runtime meets). The chosen plan is evaluated with the true costs. ``megatron_even_split`` is the
Megatron-style baseline: units spread evenly by count over the pipeline ranks, encoders first.

More schedules (``virtual_stages``, ``attach_encoders``): with ``v > 1`` a candidate cuts the LLM into
``v p`` chunks cyclic over ``p`` ranks (``schedules_interleaved.interleaved_1f1b``; chunks balanced per rank by
``search_model.Partitions.cyclic``, a heuristic); with ``attach_encoders`` every encoder is one stage on the
first LLM rank (a frozen encoder then costs no rank of its own); ``pipeline_plan.stage_ranks`` places the
stages, as it does for a job's ``[parallel.pp]`` (``virtual_stages``, ``attach_encoders``), so the trainer
runs the chosen plan. These candidates get a lower bound valid for their schedule and, when taken, are timed
on the real per-rank orders with the per-rank memory peak checked against the cap. The search stays exact
over these candidates given their partitions.

Unit flags are recomputed from ``trainable`` by their definition (``graph.consistent_units``):
``needs_input_grad`` = some unit upstream trains, where the LLM's first unit (its embedding, into whose
output the encoder features are injected) is downstream of every encoder branch. The returned plan is
built on these units.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.cost.analytic import unit_activation_bytes, unit_static_bytes
from plait.planner.cost.sharding import tensor_parallel_unit_costs
from plait.planner.cost.types import OptimizerSpec
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.plan import check_plan_units, plan_pipeline, stage_ranks
from plait.planner.pipeline.types import LAYOUTS, P2PModel, PipelinePlan, StageMemory
from plait.planner.pipeline.schedule_ir import in_flight_peaks
from plait.planner.pipeline.schedules import IN_BUBBLE_SCHEDULES, build_schedule
from plait.planner.pipeline.interleaved import runs_interleaved
from plait.planner.search.bounds import attached_stream, in_bubble_stream, layout_stream
from plait.planner.search.candidates import Best, branch_and_bound
from plait.planner.search.encoder_dp import IN_BUBBLE_TIMED, in_bubble_candidates, plan_replicated
from plait.planner.search.model import (
    Costs,
    Partitions,
    SearchModel,
    cost_list,
    flush_s,
    grad_sync_s,
    plan_from_chunks,
)
from plait.planner.pipeline.simulator import boundary_bytes_from_units, simulate, stage_costs_from_units
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["evaluate_plan", "megatron_even_split", "plan_layout", "plan_layout_below"]


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
    machine: Machine = Machine(),
    space: SearchSpace = SearchSpace(),
) -> LayoutChoice:
    """Search layout, stages per module, DP degree and LLM chunks per rank minimising the predicted
    iteration time.

    Args:
        units: pipeline units, grouped by module, encoders first and the LLM (``"llm"``) last.
        costs: one ``UnitCost`` per unit (same order) or a mapping from unit name.
        devices: accelerators available (``dp * pipeline ranks <= devices``).
        microbatches: global microbatches per iteration, split over the DP replicas.
        machine: memory cap (bytes per device: parameters, gradients, optimizer state, 1F1B activations), the
            stage-to-stage ``p2p`` link (default free and instant), the DP all-reduce's ``dp_link`` (None: not
            modelled), dtype, optimizer, the runtime's fixed ``overheads`` (charged in the search's stage costs and
            in the chosen plan's timing; ``p2p``'s send and receive overheads per message alike) and ``dp_shard``,
            the FSDP2 shard degree: ``costs`` are per shard (``sharding.shard_costs``), only DP degrees it divides
            are searched and gradients are reduce-scattered (``search_model.grad_sync_s``); the cap is the
            caller's (``search_parallel`` keeps FSDP2's transient buffer free below it).
        space: ``layouts``; ``dp_degrees`` (default: divisors of ``devices`` up to ``microbatches``);
            ``frozen_aware``: plan with the true frozen-aware costs or as the frozen-unaware baseline (module
            docstring; the returned times are always the true ones); ``rel_tol``: stop when no candidate can beat
            the best by more than this fraction (0: exact optimum); ``virtual_stages``: LLM chunks per LLM rank
            ``v`` (1: 1F1B with one stage per rank; ``v > 1`` splits the LLM into ``v p`` stages cyclically on
            ``p >= 2`` ranks, run with ``schedules_interleaved.interleaved_1f1b``, ``v p`` at most the LLM's unit
            count); ``attach_encoders``: also plans whose encoders are one stage each on the first LLM rank (an
            encoder forward just before the first LLM stage's, its backward just after; bounded by the busiest
            rank, ``attached_stream``, timed on the real schedule order); ``max_timed``: at most this many
            interleaved / attached candidates are timed in increasing lower bound (exact over them only when
            fewer have a bound below the best time; 1F1B candidates with one stage per rank are not limited);
            ``encoder_dp``: the most replicas per encoder branch (``search.encoder_dp``: plans whose encoder stages
            run on several ranks each, their own or, with ``in_bubble``, the LLM ranks', weighed beside the
            homogeneous plan, which is kept unless slower); ``encoder_tp``: the most TP degree per branch (its
            stages as TP groups on ranks of their own, weighed beside the replicas).

    Returns:
        The best ``LayoutChoice`` (method ``"plait"`` or ``"frozen_unaware"``; ``schedule`` says which).

    Raises:
        ValueError: on bad arguments (named) or an unknown layout; ``NoPlanFits`` when no candidate fits the
            memory cap.
    """
    try:
        homogeneous: LayoutChoice | None = _plan_homogeneous(units, costs, devices, microbatches=microbatches,
                                                             machine=machine, space=space)
    except NoPlanFits:
        if not space.copies_encoders:
            raise
        homogeneous = None  # replicas hold a share of the activations: one may fit
    if not space.copies_encoders:
        return homogeneous
    dps = [d for d in _dp_candidates(devices, microbatches, space.dp_degrees) if d % machine.dp_shard == 0]
    beat = homogeneous.iteration_s if homogeneous is not None and homogeneous.fits_memory else math.inf
    best, timed = _replicated_best(units, costs, devices, microbatches, machine, space, dps, beat)
    if best is None:
        if homogeneous is None:
            raise NoPlanFits(f"no layout fits: every candidate for {devices} devices exceeds memory_cap="
                             f"{machine.memory_cap} bytes (encoder replicas searched too)")
        return homogeneous
    searched = (homogeneous.candidates, homogeneous.simulated) if homogeneous is not None else (0, 0)
    return dataclasses.replace(best[0], method="plait", planned_iteration_s=best[1], candidates=searched[0] + timed,
                               simulated=searched[1] + timed)


def _replicated_best(units: Sequence[Unit], costs: Costs, devices: int, microbatches: int, machine: Machine,
                     space: SearchSpace, dps: Sequence[int],
                     beat: float) -> tuple[tuple[LayoutChoice, float] | None, int]:
    """The fastest fitting plan with replicated encoder stages below ``beat`` seconds (``encoder_dp``: own ranks, and
    on the LLM ranks in their bubbles with ``space.in_bubble``), timed by ``evaluate_plan``, with its planned time;
    and how many plans were timed."""
    timing = dataclasses.replace(machine, p2p=machine.p2p or P2PModel())
    common = dict(microbatches=microbatches, devices=devices, machine=timing)
    best: tuple[LayoutChoice, float] | None = None
    timed = 0
    own = plan_replicated(units, costs, devices, microbatches=microbatches, machine=timing, space=space, dps=dps,
                          beat=beat)
    if own is not None:
        timed += 1
        choice = evaluate_plan(own.plan, units, costs, dp=own.dp, **common)
        if choice.fits_memory and choice.iteration_s < beat:
            best, beat = (choice, own.planned_s), choice.iteration_s
    names = tuple(n for n in dict.fromkeys(space.schedules) if n in IN_BUBBLE_SCHEDULES) or ("1f1b",)
    true_units = consistent_units(units)
    for count, candidate in enumerate(in_bubble_candidates(true_units, costs, devices, microbatches=microbatches,
                                                           machine=timing, space=space, dps=dps)):
        if candidate.bound >= beat or count >= IN_BUBBLE_TIMED:
            break
        plan = candidate.plan(true_units)
        for name in names:
            timed += 1
            choice = evaluate_plan(plan, true_units, costs, dp=candidate.dp, schedule=name, **common)
            if choice.fits_memory and choice.iteration_s < beat:
                best, beat = (choice, choice.iteration_s), choice.iteration_s
    return best, timed


def plan_layout_below(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int, machine: Machine,
                           space: SearchSpace, beat: float) -> LayoutChoice | None:
    """``plan_layout`` with its searches stopped at ``beat`` seconds (the branch and bound's planning view, then the
    encoder replicas' search, ``space.encoder_dp``): the same plan whenever its time is below ``beat``, else a plan
    not faster or None. Only for 1F1B's schedules (``space.schedules``). Raises as ``plan_layout``."""
    homogeneous = _plan_homogeneous(units, costs, devices, microbatches=microbatches, machine=machine, space=space,
                                    beat=beat)
    if not space.copies_encoders:
        return homogeneous
    dps = [d for d in _dp_candidates(devices, microbatches, space.dp_degrees) if d % machine.dp_shard == 0]
    below = min(beat, homogeneous.iteration_s if homogeneous is not None and homogeneous.fits_memory else beat)
    best, timed = _replicated_best(units, costs, devices, microbatches, machine, space, dps, below)
    if best is None:
        return homogeneous
    return dataclasses.replace(best[0], method="plait", planned_iteration_s=best[1], candidates=timed, simulated=timed)


def _plan_homogeneous(units: Sequence[Unit], costs: Costs, devices: int, *, microbatches: int, machine: Machine,
                      space: SearchSpace, beat: float = math.inf) -> LayoutChoice | None:
    """``plan_layout`` over plans whose every stage runs on one rank per pipeline (every encoder degree 1); with
    ``beat`` finite, None when no plan is faster (``plan_layout_below``)."""
    memory_cap, dp_link, dp_shard = machine.memory_cap, machine.dp_link, machine.dp_shard
    layouts, virtual_stages, frozen_aware = space.layouts, space.virtual_stages, space.frozen_aware
    _check_common(devices, microbatches, memory_cap, space.rel_tol)
    unknown = [lay for lay in layouts if lay not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {list(layouts)}")
    if not virtual_stages or any(int(v) != v or v < 1 for v in virtual_stages):
        raise ValueError(f"virtual_stages must be a non-empty list of integers >= 1, got {list(virtual_stages)}")
    p2p = machine.p2p or P2PModel()
    dps = [d for d in _dp_candidates(devices, microbatches, space.dp_degrees) if d % dp_shard == 0]
    if not dps:
        raise ValueError(f"dp_shard {dp_shard} divides none of the DP degrees searched for {devices} devices and "
                         f"{microbatches} microbatches")
    parts = _partitions(units, costs, frozen_aware, machine, p2p)
    model = parts.model
    chosen_layouts = list(dict.fromkeys(layouts)) if model.encoders else [layouts[0]]
    streams = [s for v in sorted({int(x) for x in virtual_stages}) for lay in chosen_layouts for d in dps
               if (s := layout_stream(parts, lay, d, devices, microbatches, p2p, dp_link, v)) is not None]
    if space.attach_encoders and model.encoders:
        streams += [s for v in sorted({int(x) for x in virtual_stages}) for d in dps
                    if (s := attached_stream(parts, d, devices, microbatches, p2p, v)) is not None]
    if space.in_bubble and model.encoders:
        streams += [s for d in dps if (s := in_bubble_stream(parts, d, devices, microbatches, p2p)) is not None]
    best, considered, timed = branch_and_bound(parts, streams, p2p, dp_link, space.rel_tol, space.max_timed, beat)
    timing = dataclasses.replace(machine, p2p=p2p)
    method = "plait" if frozen_aware else "frozen_unaware"
    single = _single_rank(model, units, costs, max(dps), (microbatches, devices, timing))
    if single is not None and (best.stages is None or single[0] < best.time):
        return dataclasses.replace(single[1], method=method, candidates=considered + 1, simulated=timed + 1)
    if best.stages is None and beat < math.inf:
        return None
    if best.stages is None:
        raise NoPlanFits(f"no layout fits: every candidate for {devices} devices exceeds memory_cap={memory_cap} "
                         "bytes (or has fewer pipeline ranks than modules)")
    plan = _plan_from_stages(model, best)
    schedules = tuple(dict.fromkeys(space.schedules))
    flat_names = tuple(n for n in schedules if n != "zb_v") or ("1f1b",)  # zb_v runs only its V
    names = ("interleaved_1f1b",) if best.v > 1 or best.attached else flat_names
    if best.in_bubble:  # the list-scheduled schedules run encoders on LLM ranks
        names = tuple(n for n in flat_names if n in IN_BUBBLE_SCHEDULES) or ("1f1b",)
    timing_of = dict(microbatches=microbatches, devices=devices, machine=timing)
    # every timed choice with the planning-view time of the search that found its plan
    timed_all = [(c, best.time) for c in _time_schedules(plan, units, costs, names, dict(dp=best.dp, **timing_of))]
    simulated = timed + (single is not None) + len(names) - 1
    plain = [dataclasses.replace(s, position=0) for s in streams
             if s.v == 1 and not (s.attached or s.in_bubble)]  # fresh
    flat = best if best.v == 1 and not (best.attached or best.in_bubble) else None
    if flat is None and set(schedules) - {"1f1b"} and plain:
        # the zero-bubble schedules run one stage per rank (zb_v: its V, cut from such a plan): find the best one
        flat, _, flat_timed = branch_and_bound(parts, plain, p2p, dp_link, space.rel_tol, space.max_timed)
        simulated += flat_timed
        if flat.stages is not None and set(flat_names) - {"1f1b"}:
            timed_all += [(c, flat.time) for c in _time_schedules(_plan_from_stages(model, flat), units, costs,
                                                                  flat_names, dict(dp=flat.dp, **timing_of))]
            simulated += len(flat_names)
    if "zb_v" in schedules and flat is not None and flat.stages is not None:
        v_plan = _v_shape_plan(model, parts, flat)
        if v_plan is not None:
            v = evaluate_plan(v_plan, units, costs, dp=flat.dp, schedule="zb_v", **timing_of)
            timed_all.append((v, v.iteration_s))  # no search timed the V: its own time
            simulated += 1
    choice, planned = _fastest(timed_all)
    weighed = sorted({(c.schedule, c.iteration_s, c.fits_memory) for c, _ in timed_all}, key=lambda w: w[1])
    return dataclasses.replace(choice, method=method, planned_iteration_s=planned, candidates=considered,
                               simulated=simulated, schedules_weighed=tuple(weighed) if len(weighed) > 1 else ())


PARTITIONS_KEPT = 64
"""Searches whose ``Partitions`` are kept (``_partitions``; least recently used dropped first)."""
_PARTITIONS: OrderedDict[tuple, Partitions] = OrderedDict()


def _partitions(units: Sequence[Unit], costs: Costs, frozen_aware: bool, machine: Machine,
                p2p: P2PModel) -> Partitions:
    """The ``Partitions`` (and its ``SearchModel``) of one planning view, shared by every search of the same units,
    costs, view, dtype, optimizer, overheads, shard degree, memory cap and stage-to-stage link: what they memoise
    (partitions per module and stage count, chunk sums, the LLM chain's bound terms per microbatch count) depends on
    nothing else, so a search over several device counts (``parallel.plan_parallel``'s divisors) partitions once."""
    per_unit = tuple(cost_list(units, costs))
    key = (tuple(units), per_unit, frozen_aware, machine.dtype, machine.optimizer, repr(machine.overheads),
           machine.dp_shard, machine.memory_cap, p2p)  # overheads hold a dict: keyed by their repr
    found = _PARTITIONS.get(key)
    if found is None:
        model = SearchModel(units, per_unit, frozen_aware, machine.dtype, machine.optimizer, machine.overheads,
                            machine.dp_shard)
        found = _PARTITIONS[key] = Partitions(model, machine.memory_cap)
        if len(_PARTITIONS) > PARTITIONS_KEPT:
            _PARTITIONS.popitem(last=False)
    else:
        _PARTITIONS.move_to_end(key)
    return found


def _fastest(timed: Sequence[tuple[LayoutChoice, float]]) -> tuple[LayoutChoice, float]:
    """The fastest choice of ``timed`` (``(choice, planned time)`` pairs) that fits the memory cap, else the first
    (the first timed, e.g. 1F1B), with its planned time."""
    fitting = [t for t in timed if t[0].fits_memory]
    return min(fitting, key=lambda t: t[0].iteration_s) if fitting else timed[0]


def _v_shape_plan(model: SearchModel, parts: Partitions, flat: Best) -> PipelinePlan | None:
    """The V-shape plan (``schedules.zb_v``) cut from ``flat``, a plan of one stage per rank with ``p >= 2`` LLM
    ranks: its encoder stages as they are, the LLM cut into ``2 p`` minimum-bottleneck chunks placed in a V over
    the same ``p`` ranks (``plan.v_shape_ranks``), so each LLM rank keeps about ``1/p`` of the LLM. None when
    ``p < 2`` or the LLM has fewer than ``2 p`` units."""
    p = flat.counts[-1]
    if p < 2 or model.size(LLM_MODULE) < 2 * p:
        return None
    encoder_chunks = list(flat.stages.chunks[:-p])
    chunks = encoder_chunks + [[r] for r in parts.plain(LLM_MODULE, 2 * p)]
    ranks = stage_ranks(len(encoder_chunks), p, 2, v_shape=True)
    return plan_from_chunks(model, model.units, flat.layout, chunks, ranks)


def _time_schedules(plan: PipelinePlan, units: Sequence[Unit], costs: Costs, names: Sequence[str],
                    timing: dict[str, Any]) -> list[LayoutChoice]:
    """``plan`` timed with each schedule of ``names`` (``evaluate_plan``, ``timing`` its keyword arguments; each
    schedule's in-flight peaks checked against the memory cap). With zero-bubble schedules weighed beside 1F1B a
    rank's bubbles take weight gradients (Qi et al., ICLR 2024)."""
    return [evaluate_plan(plan, units, costs, schedule=name, **timing) for name in names]


def _single_rank(model: SearchModel, units: Sequence[Unit], costs: Costs, dp: int,
                 common: tuple[int, int, Machine]) -> tuple[float, LayoutChoice] | None:
    """The no-pipeline candidate: every module's single stage on one rank, ``dp`` replicas (``common``: the
    microbatches, devices and machine). One rank never waits, so its time in the planning view is
    ``M_r * sum(work) + all-reduce``. None when it does not fit memory (checked with the simulator's in-flight
    peaks)."""
    microbatches, devices, machine = common
    layout = "encoders_colocated" if model.encoders else "encoder_parallel"
    plan = plan_pipeline(model.units, layout, ranks=[0] * (1 + min(len(model.encoders), 1)))
    choice = evaluate_plan(plan, units, costs, dp=dp, microbatches=microbatches, devices=devices, machine=machine)
    if not choice.fits_memory:
        return None
    dp_link = machine.dp_link
    nb = -(-microbatches // dp)
    chunks = [(m, any(u.runs_backward for u in model.view if u.module == m)) for m in model.modules]
    fixed = sum(model.overheads.stage_s(kind, chunks, pipelined=False) for kind in ("F", "B"))
    planned = nb * (math.fsum(model.work) + fixed) + flush_s(math.fsum(model.grad), dp, dp_link, model.overheads,
                                                              model.dp_shard)
    return planned, dataclasses.replace(choice, planned_iteration_s=planned)


def _plan_from_stages(model: SearchModel, best: Best) -> PipelinePlan:
    """The ``PipelinePlan`` of the best candidate (splits at its chunk boundaries; LLM chunks cyclic over
    the LLM ranks when ``best.v > 1``)."""
    ranks = None
    if best.v > 1 or best.attached or best.in_bubble:
        n_enc = len(best.stages.chunks) - best.v * best.counts[-1]
        ranks = stage_ranks(n_enc, best.counts[-1], best.v, best.attached, in_bubble=best.in_bubble)
    return plan_from_chunks(model, model.units, best.layout, best.stages.chunks, ranks)


def evaluate_plan(
    plan: PipelinePlan,
    units: Sequence[Unit],
    costs: Costs,
    *,
    dp: int,
    microbatches: int,
    devices: int | None = None,
    machine: Machine = Machine(),
    schedule: str | None = None,
) -> LayoutChoice:
    """Time ``plan`` with the true frozen-aware costs: ``simulator.simulate`` on its schedule (``schedule``,
    a ``schedules.SCHEDULE_NAMES`` entry; default ``"interleaved_1f1b"`` when
    ``schedules_interleaved.runs_interleaved``, else ``"1f1b"``) with ``ceil(microbatches / dp)`` microbatches, plus the gradient all-reduce of
    each rank's trainable parameters over ``dp`` replicas (after the flush; the slowest rank's); a replicated encoder
    stage's (``Stage.replicas`` ``r``) over its ``r x dp`` copies, its optimizer step on its whole gradient. A
    tensor-parallel encoder stage (``Stage.tensor_parallel``) is timed per TP rank
    (``cost.sharding.tensor_parallel_unit_costs`` on ``machine.tp_link``, default ``p2p``).

    Args:
        plan: a pipeline plan over ``units`` (flags as ``consistent_units``; its ``num_microbatches`` is
            replaced).
        units, costs: as ``plan_layout``.
        dp: DP degree; microbatches: global microbatches; devices: for ``lower_bound_s`` (default
            ``dp * plan.num_ranks``).
        machine: as ``plan_layout``; its ``overheads`` are added to every stage action
            (``ActionOverheads.stage_s`` of its module chunks; the executor's ``per_action_s`` only when the plan
            has more than one rank); ``dp_shard``: costs per shard, gradients reduce-scattered.

    Returns:
        The ``LayoutChoice`` (method ``"given"``; ``planned_iteration_s`` the true time; no candidates).

    Raises:
        ValueError: when the plan does not match the units, on bad numbers, or ``dp * ranks > devices``.
    """
    memory_cap, dp_shard, overheads = machine.memory_cap, machine.dp_shard, machine.overheads
    _check_common(devices or 1, microbatches, memory_cap)
    if int(dp) != dp or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if int(dp_shard) != dp_shard or dp_shard < 1 or dp % dp_shard:
        raise ValueError(f"dp_shard must be a positive integer dividing dp {dp}, got {dp_shard!r}")
    devices = devices or dp * plan.num_ranks
    if dp * plan.num_ranks > devices:
        raise ValueError(f"dp {dp} x {plan.num_ranks} pipeline ranks exceeds devices={devices}")
    p2p = machine.p2p or P2PModel()
    true_units = consistent_units(units)
    by_name_units = _by_name(true_units)
    check_plan_units(plan, true_units)
    cost_map = dict(zip((u.name for u in true_units), cost_list(units, costs)))
    if plan.tensor_parallel:  # encoder_tp: a TP stage's units as one of its ranks runs them
        cost_map = tensor_parallel_unit_costs(plan, true_units, cost_map, machine.tp_link or p2p)
    nb = -(-microbatches // dp)
    plan = plan.replace(num_microbatches=nb)
    name = schedule or ("interleaved_1f1b" if runs_interleaved(plan) else "1f1b")
    schedule = build_schedule(plan, name)
    action = stage_costs_from_units(plan, true_units, cost_map, split_backward=schedule.split_backward)
    if not overheads.zero:
        for stage in plan.stages:
            for kind in ("F", "B", "W") if schedule.split_backward else ("F", "B"):
                flag = "trainable" if kind == "W" else "runs_backward"
                chunks = [(m, any(getattr(by_name_units[n], flag) for n in stage.module_units(m)))
                          for m in stage.modules]
                action[(stage.index, kind)] += overheads.stage_s(kind, chunks, pipelined=plan.num_ranks > 1)
    boundary = boundary_bytes_from_units(plan, cost_map)
    memory = _stage_memory(plan, true_units, cost_map, machine.dtype, machine.optimizer)
    result = simulate(schedule, action, p2p=p2p, boundary_bytes=boundary, memory=memory)
    peaks = in_flight_peaks(schedule)
    by_name = _by_name(true_units)
    grads: list[dict[int, float]] = [{} for _ in range(plan.num_ranks)]  # per rank: replicas -> gradient bytes
    for stage in plan.stages:
        held = grads[stage.rank]
        held[stage.row_share] = held.get(stage.row_share, 0.0) + sum(
            cost_map[n].param_bytes * by_name[n].trained_fraction for n in stage.units)
    # a replicated encoder stage's gradients are all-reduced over its replicas x the DP replicas (encoder_dp), a TP
    # stage's shards over the DP replicas
    sync = max(sum(grad_sync_s(g, dp * r, machine.dp_link, dp_shard) for r, g in held.items()) for held in grads)
    update = max(overheads.update_s(sum(held.values())) for held in grads)
    work = sum(c.forward_s + c.backward_s(u) for u, c in zip(true_units, cost_map.values()))
    n, split = plan.num_stages, schedule.split_backward
    fits = memory_cap is None or max(result.peak_memory_bytes) <= memory_cap
    return LayoutChoice(
        method="given", layout=plan.layout, dp=dp,
        stages_per_module=tuple((m, sum(plan.stages[s].replica == 0 for s in plan.module_stages(m)))
                                for m in plan.modules), plan=plan,
        microbatches=microbatches, devices=devices, iteration_s=result.makespan_s + sync + update,
        makespan_s=result.makespan_s, grad_sync_s=sync,
        planned_iteration_s=result.makespan_s + sync + update,
        lower_bound_s=microbatches * work / devices, bubble_fraction=result.mean_bubble_fraction,
        stage_forward_s=[action[(s, "F")] for s in range(n)],
        stage_backward_s=[action[(s, "B")] + (action[(s, "W")] if split else 0.0) for s in range(n)],
        stage_weight_grad_s=[action[(s, "W")] for s in range(n)] if split else (),
        stage_static_bytes=[memory[s].static_bytes for s in range(n)],
        stage_activation_bytes=[memory[s].activation_bytes for s in range(n)],
        stage_memory_bytes=[memory[s].static_bytes + peaks[s] * memory[s].activation_bytes for s in range(n)],
        stage_boundary_bytes=[boundary[s] for s in range(n)], memory_cap=memory_cap, fits_memory=fits, p2p=p2p,
        schedule=name, update_s=update, dp_shard=dp_shard, encoder_dp=_copies(plan, False),
        encoder_tp=_copies(plan, True))


def _copies(plan: PipelinePlan, tp: bool) -> tuple[tuple[str, int], ...]:
    """``((branch, degree), ...)`` of the plan's replicated (``tp``: tensor-parallel) encoder branches
    (``LayoutChoice.encoder_dp`` / ``encoder_tp``)."""
    return tuple(dict.fromkeys((s.modules[0], s.replicas) for s in plan.stages
                               if s.replicas > 1 and s.tensor_parallel == tp))


def _by_name(units: Sequence[Unit]) -> dict[str, Unit]:
    return {u.name: u for u in units}


def _stage_memory(plan: PipelinePlan, units: Sequence[Unit], cost_map: Mapping[str, UnitCost], dtype: Any,
                  optimizer: OptimizerSpec) -> dict[int, StageMemory]:
    """Per stage: static bytes (parameters, gradients, optimizer state) and activation bytes per microbatch (a
    replica of a replicated encoder stage keeps those of its ``1/replicas`` share of the rows; a TP stage's
    costs are per TP rank already)."""
    by_name = _by_name(units)
    out = {}
    for stage in plan.stages:
        pairs = [(by_name[n], cost_map[n]) for n in stage.units]
        static = sum(unit_static_bytes(u, c, dtype, optimizer) for u, c in pairs)
        act = sum(unit_activation_bytes(u, c) for u, c in pairs) / stage.row_share
        out[stage.index] = StageMemory(int(round(static)), int(round(act)))
    return out


def megatron_even_split(
    units: Sequence[Unit],
    costs: Costs,
    devices: int,
    *,
    microbatches: int,
    dp: int | None = None,
    machine: Machine = Machine(),
) -> LayoutChoice:
    """Megatron-style baseline: the units, encoders first, spread evenly by count over the
    ``devices // dp`` pipeline ranks (the first ``n mod ranks`` ranks get one unit more). A rank whose run
    of units crosses a module boundary holds one stage per module (stages sharing a rank); the plan's
    layout is ``encoder_parallel`` (each encoder's chunks feed the first LLM stage).

    With an explicit ``dp`` the plan is returned whether or not it fits (see ``fits_memory``). With
    ``dp=None`` every divisor of ``devices`` (up to ``microbatches``, leaving at least one unit per
    rank) is tried and, among those whose plan fits ``memory_cap``, the one with the lowest iteration time
    predicted by the frozen-unaware cost model is kept, as a Megatron user tuning with that model would.
    ``machine``: memory cap, links, dtype and optimizer as ``plan_layout`` (its overheads and ``dp_shard`` unused).
    When none fits, the best of all is returned with ``fits_memory=False`` (such a run would need
    activation recomputation or a memory-capped schedule, which this baseline does not model).

    Returns:
        A ``LayoutChoice`` (method ``"megatron_even"``) timed with the true costs.

    Raises:
        ValueError: on bad arguments, or fewer units than the pipeline ranks of every DP degree.
    """
    _check_common(devices, microbatches, machine.memory_cap)
    machine = Machine(memory_cap=machine.memory_cap, p2p=machine.p2p, dp_link=machine.dp_link, dtype=machine.dtype,
                      optimizer=machine.optimizer)
    if dp is not None:
        return _megatron_for(units, costs, devices, microbatches, dp, machine)
    choices = [_megatron_for(units, costs, devices, microbatches, d, machine)
               for d in _dp_candidates(devices, microbatches, None) if devices // d <= len(units)]
    if not choices:
        raise ValueError(f"{len(units)} units cannot fill the pipeline ranks of any DP degree of {devices} devices")
    fitting = [c for c in choices if c.fits_memory] or choices
    return min(fitting, key=lambda c: c.planned_iteration_s)


def _megatron_for(units, costs, devices, microbatches, dp, machine):
    """Even split for one DP degree, timed true and frozen-unaware. The baseline splits by unit count alone, a
    ``Unit.joined`` tower included (which plait's own plans keep in one stage)."""
    units = [dataclasses.replace(u, joined=False) for u in units]
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
    common = dict(dp=dp, microbatches=microbatches, devices=devices, machine=machine)
    unaware_units = consistent_units(units, all_trainable=True)
    unaware_costs = [_unaware_cost(c) for c in cost_list(units, costs)]
    planned = evaluate_plan(plan_pipeline(unaware_units, "encoder_parallel", splits=splits, ranks=rank_per_stage),
                            unaware_units, unaware_costs, **common)
    return dataclasses.replace(evaluate_plan(plan, units, costs, **common), method="megatron_even",
                               planned_iteration_s=planned.iteration_s)


def _unaware_cost(cost: UnitCost) -> UnitCost:
    """The cost as the frozen-unaware model charges it on an all-trainable unit: backward ``dX + dW`` even
    where no input gradient is needed (``UnitCost.backward_s(unit, frozen_aware=False)``), booked as dW (no
    measured split backward: that model knows none)."""
    return dataclasses.replace(cost, input_grad_s=0.0, weight_grad_s=cost.input_grad_s + cost.weight_grad_s,
                               split_input_grad_s=None, split_weight_grad_s=None)
