"""Plans and profiles for people and files, as strings (pure: no I/O; the commands print and write them).

- :func:`format_plan`: a ``LayoutChoice`` as a text table, with the per-rank peak memory of one simulated
  iteration (:func:`simulate_choice`, :func:`rank_peak_memory_bytes`).
- :func:`pp_toml`: the ready-to-paste ``[parallel]`` (and, with a pipeline, ``[parallel.pp]``) TOML tables of a plan
  (``toml_text.toml_value``).
- :func:`plan_to_json` / :func:`plan_from_json`: the plan file of ``plait plan --out`` (``LayoutChoice.to_dict``
  plus the ``[parallel.pp]`` table under ``PP_TOML_KEY``), read back with messages that name what a wrong file
  looks like (a profile, a Chrome trace).
- :func:`format_profile`: a measured ``Profile`` as a text table.
- :func:`format_bytes` / :func:`memory_unit`: the one rule for memory figures shown to people (GiB from one GiB
  up, MiB below it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.cost.measured_profile import Profile
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.search.types import LayoutChoice
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import SimResult, StageMemory
from plait.planner.toml_text import toml_key, toml_value
from plait.planner.types import Unit

__all__ = [
    "degrees_line",
    "format_bytes",
    "format_lora_units",
    "PP_TOML_KEY",
    "format_plan",
    "format_profile",
    "idle_devices_note",
    "memory_unit",
    "plan_from_json",
    "plan_to_json",
    "pp_toml",
    "rank_peak_memory_bytes",
    "simulate_choice",
]

PP_TOML_KEY = "parallel_pp_toml"
"""Key of the plan JSON (:func:`plan_to_json`) holding the ``[parallel.pp]`` table (:func:`pp_toml`; null when
there is none); every other key is a ``LayoutChoice`` field."""
_GIB = 2**30
_MIB = 2**20


# ----- memory figures ----------------------------------------------------------------------------------------
def memory_unit(largest: float) -> tuple[str, float, int]:
    """The unit of memory figures whose largest is ``largest`` bytes: ``("GiB", 2**30, 2)`` from one GiB up, else
    ``("MiB", 2**20, 1)`` (name, bytes per unit, decimals), so that a small cap or peak does not read as 0.0 GiB.
    Figures shown together (a column, a list of ranks) share the unit of their largest."""
    return ("GiB", _GIB, 2) if largest >= _GIB else ("MiB", _MIB, 1)


def format_bytes(num_bytes: float, largest: float | None = None) -> str:
    """``num_bytes`` for people: ``"12.34 GiB"``, or ``"61.4 MiB"`` below one GiB (:func:`memory_unit`); with
    ``largest`` in the unit of that figure instead (``format_bytes(2**29, 2**30) == "0.50 GiB"``)."""
    name, size, decimals = memory_unit(num_bytes if largest is None else largest)
    return f"{num_bytes / size:.{decimals}f} {name}"


# ----- simulation of a choice --------------------------------------------------------------------------------
def simulate_choice(choice: LayoutChoice) -> SimResult:
    """Simulate one iteration of ``choice``'s busiest replica from the per-stage costs it carries."""
    plan = choice.plan
    costs = {}
    weight = choice.stage_weight_grad_s or (0.0,) * plan.num_stages  # split-backward schedules: B and W apart
    for s in range(plan.num_stages):
        costs[(s, "F")] = choice.stage_forward_s[s]
        costs[(s, "B")] = choice.stage_backward_s[s] - weight[s]
        costs[(s, "W")] = weight[s]
    memory = {s: StageMemory(int(choice.stage_static_bytes[s]), int(choice.stage_activation_bytes[s]))
              for s in range(plan.num_stages)}
    boundary = dict(enumerate(choice.stage_boundary_bytes))
    schedule = build_schedule(plan, choice.schedule, choice.microbatches_per_replica)
    return simulate(schedule, costs, p2p=choice.p2p, boundary_bytes=boundary, memory=memory)


def rank_peak_memory_bytes(choice: LayoutChoice) -> tuple[int, ...]:
    """Per pipeline rank, the most bytes held at once (static bytes of all its stages plus their live
    activations) over one iteration of ``choice``: ``simulate_choice(choice).peak_memory_bytes``. This is what
    a device must hold; ``choice.stage_memory_bytes`` is per stage, so under interleaved 1F1B (several stages
    per rank) or attached encoders their maximum under-reports it."""
    return tuple(simulate_choice(choice).peak_memory_bytes)


# ----- the plan table ----------------------------------------------------------------------------------------
def _chunk_label(names: Sequence[str]) -> str:
    """``first .. last (n)`` of a stage's unit names for one module, the last without the shared prefix
    (``llm.layers.0 .. layers.7 (8)``)."""
    if len(names) == 1:
        return names[0]
    first, last = names[0].split("."), names[-1].split(".")
    shared = 0
    while shared < min(len(first), len(last)) - 1 and first[shared] == last[shared]:
        shared += 1
    if last[shared:] and last[shared].isdigit() and shared > 0:
        shared -= 1
    return f"{names[0]} .. {'.'.join(last[shared:])} ({len(names)})"


def format_plan(choice: LayoutChoice) -> str:
    """The plan as a text table: with a pipeline, one row per stage (rank, modules, units, forward and backward ms
    per microbatch, that stage's own peak memory in GiB, or MiB when every stage holds less than one GiB); without
    one, a line with the whole model's forward and backward ms per microbatch; then the
    totals with the peak memory per rank (device): ``rank_peak_memory_bytes``, the sum over a rank's stages, not
    the largest stage. Memory figures follow :func:`format_bytes`."""
    plan = choice.plan
    unit, size, decimals = memory_unit(max(choice.stage_memory_bytes, default=0))
    if plan.num_ranks == 1:  # no pipeline: no stage table
        lines = [f"whole model on each rank ({', '.join(plan.modules)}): forward "
                 f"{1e3 * sum(choice.stage_forward_s):.2f} ms, backward {1e3 * sum(choice.stage_backward_s):.2f} ms "
                 "per microbatch"]
    else:
        lines = _stage_rows(choice, size, decimals, unit)
    counts = ", ".join(f"{m} {s}" for m, s in choice.stages_per_module)
    dp = (f"DP {choice.dp} (dp {choice.dp // choice.dp_shard} x FSDP2 dp_shard {choice.dp_shard})"
          if choice.dp_shard > 1 else f"DP {choice.dp}")
    shape = (f"layout {choice.layout}, {dp} x {plan.num_ranks} pipeline ranks" if plan.num_ranks > 1
             else f"no pipeline (the whole model on each rank), {dp}")
    shape += f" x TP {choice.tp}" if choice.tp > 1 else ""
    lines += [
        f"{shape} = {choice.devices_used} of {choice.devices} devices"
        + ("" if plan.num_ranks == 1 else f"; stages: {counts}")
        + ("; encoder data-parallel degrees (each stage's replicas): "
           + ", ".join(f"{m} {r}" for m, r in choice.encoder_dp) if choice.encoder_dp else "")
        + ("; encoder tensor-parallel degrees (each stage's TP group): "
           + ", ".join(f"{m} {t}" for m, t in choice.encoder_tp) if choice.encoder_tp else "")
        + idle_devices_note(choice),
        f"iteration {1e3 * choice.iteration_s:.2f} ms (pipeline {1e3 * choice.makespan_s:.2f} ms + "
        + (f"gradient all-reduce {1e3 * choice.grad_sync_s:.2f} ms" if choice.dp_shard == 1 else
           f"FSDP2 gradient reduce-scatter {1e3 * choice.grad_sync_s:.2f} ms" if choice.grad_sync_s else
           "FSDP2 gradient reduce-scatter not charged: no DP link")
        + (f" + optimizer step {1e3 * choice.update_s:.2f} ms" if choice.update_s else "")
        + f") with {choice.microbatches_per_replica} of "
        f"{choice.microbatches} microbatches per replica; bubble {100 * choice.bubble_fraction:.1f}%"
        + (f" under {choice.schedule}" if plan.num_ranks > 1 else "") + "; "
        f"{choice.ratio_to_lower_bound:.2f}x the lower bound {1e3 * choice.lower_bound_s:.2f} ms",
        *_weighed_line(choice),
        _peak_line(choice, unit),
    ]
    degrees = degrees_line(choice)
    return "\n".join(lines + ([degrees] if degrees else []))


def _weighed_line(choice: LayoutChoice) -> list[str]:
    """The schedules the search timed for ``choice`` with their iterations, the chosen one marked and those over
    the memory cap named apart (no line when one was timed): why this schedule."""
    if not choice.schedules_weighed:
        return []
    fits = [f"{name} {1e3 * t:.2f} ms" + (" (chosen)" if name == choice.schedule else "")
            for name, t, ok in choice.schedules_weighed if ok]
    over = [f"{name} {1e3 * t:.2f} ms" for name, t, ok in choice.schedules_weighed if not ok]
    return ["schedules weighed, the fastest that fits memory chosen: " + ", ".join(fits)
            + (f"; over the memory cap: {', '.join(over)}" if over else "")]


def _stage_rows(choice: LayoutChoice, size: float, decimals: int, unit: str) -> list[str]:
    """The stage table of a pipelined plan (``format_plan``): the header and one row per stage and module."""
    lines = [f"{'stage':>5} {'rank':>4} {'module':<8} {'units':<64} {'F ms':>8} {'B ms':>8} {'stage ' + unit:>9}"]
    for stage in choice.plan.stages:
        for k, module in enumerate(stage.modules):
            first = k == 0
            lines.append(
                f"{stage.index if first else '':>5} {stage.rank if first else '':>4} {module:<8} "
                f"{_chunk_label(stage.module_units(module)):<64} "
                + (f"{1e3 * choice.stage_forward_s[stage.index]:>8.2f} {1e3 * choice.stage_backward_s[stage.index]:>8.2f} "
                   f"{choice.stage_memory_bytes[stage.index] / size:>9.{decimals}f}" if first else ""))
    return lines

def _peak_line(choice: LayoutChoice, stage_unit: str) -> str:
    """``"peak memory per rank (device) 41.2 MiB (cap 61.4 MiB); ranks 41.2 / 30.0 MiB"`` (:func:`format_bytes`;
    the ranks in the unit of the largest), with a note when a rank holds several stages."""
    peaks = rank_peak_memory_bytes(choice)
    cap = "no cap" if choice.memory_cap is None else f"cap {format_bytes(choice.memory_cap)}"
    ranks = ""
    if len(peaks) > 1:
        unit, size, decimals = memory_unit(max(peaks))
        ranks = f"; ranks {' / '.join(f'{p / size:.{decimals}f}' for p in peaks)} {unit}"
    note = (f"; 'stage {stage_unit}' is each stage's own peak, a rank holds all of its stages"
            if choice.plan.num_stages > choice.plan.num_ranks > 1 else "")
    return f"peak memory per rank (device) {format_bytes(max(peaks))} ({cap}){ranks}{note}"


def degrees_line(choice: LayoutChoice) -> str:
    """One line on the plan's TP degree, FSDP2 sharding, expert parallelism and activation checkpointing
    (``planner.sharding``), empty
    without any: ``"memory: tensor parallel 2 (each pipeline rank is 2 devices), FSDP2 over 4 of the 8
    data-parallel ranks (HSDP: 2 replicas) + 1.20 GiB unsharded buffer, activation checkpointing full"``. The peak
    above is per device, FSDP2's buffer not included."""
    parts = []
    if choice.tp > 1:
        parts.append(f"tensor parallel {choice.tp} (each pipeline rank is {choice.tp} devices)")
    if choice.dp_shard > 1:
        hsdp = f" (HSDP: {choice.dp // choice.dp_shard} replicas)" if choice.dp > choice.dp_shard else ""
        buffer = (f" + {format_bytes(choice.shard_buffer_bytes)} unsharded buffer" if choice.plan.num_ranks == 1
                  else " (under stages: optimizer state sharded, parameters and gradients whole within a step)")
        reduce = ", gradients reduce-scattered every microbatch" if choice.fsdp_reduce == "microbatch" else ""
        reduce += (", parameters kept gathered from forward to backward" if choice.fsdp_reshard == "after_backward"
                   and choice.plan.num_ranks == 1 else "")
        parts.append(f"FSDP2 over {choice.dp_shard} of the {choice.dp} data-parallel ranks{hsdp}{buffer}{reduce}")
    if choice.ep > 1:
        parts.append(f"expert parallel {choice.ep} (each MoE layer's experts split over {choice.ep} of the "
                     f"{choice.dp} data-parallel ranks)")
    if choice.checkpointing != "none":
        parts.append(f"activation checkpointing {choice.checkpointing}")
    return "memory: " + ", ".join(parts) if parts else ""


def idle_devices_note(choice: LayoutChoice) -> str:
    """Why ``choice`` leaves devices idle, as ``"; 6 devices idle: ..."`` (empty when it uses them all): every
    replica needs a microbatch (``"2 microbatches per step: at most 2 pipelines"``, when the DP degree is
    already the microbatch count), else a deeper or wider plan was predicted no faster (more stages add
    transfers, bubbles and per-action overheads; the DP degree must divide the devices)."""
    idle = choice.devices - choice.devices_used
    if idle <= 0:
        return ""
    head = f"; {idle} device{'s' if idle > 1 else ''} idle: "
    if choice.dp >= choice.microbatches:
        more = ("a pipeline of more stages was predicted no faster" if choice.plan.num_ranks > 1
                else "pipelining the model was predicted no faster")
        return (head + f"{choice.microbatches} microbatch{'es' if choice.microbatches > 1 else ''} per step: "
                f"at most {choice.microbatches} pipeline{'s' if choice.microbatches > 1 else ''}, and {more}")
    return head + ("no plan using them was predicted faster (more stages add transfers, bubbles and per-action "
                   "overheads; the DP degree divides the devices)")


# ----- the [parallel.pp] table -------------------------------------------------------------------------------
def pp_toml(fields: Mapping[str, Any], dp: int, degrees: Mapping[str, Any] | None = None) -> str:
    """The job tables that run a plan, ready to paste: a comment line (processes, what to replace), the
    ``[parallel]`` table (``plan = "manual"``, ``dp`` replicas, ``dp_shard``, ``tp``, ``cp``; ``offload`` only when
    not ``"none"``, ``fsdp_reduce`` only when not ``"step"``, ``fsdp_reshard`` only when ``"after_backward"``,
    ``rank_order`` only when the pipeline goes outermost) and,
    only when there is a pipeline (``degree`` > 1), the ``[parallel.pp]`` table of ``fields`` (``degree`` first;
    the values ``toml_value`` writes).

    ``degrees`` (``dp``, ``dp_shard``, ``tp``, optionally ``cp``, ``activation_checkpointing``, ``offload``,
    ``fsdp_reduce``, ``fsdp_reshard``, ``rank_order``, ``ep``: written only above 1) gives the ``[parallel]`` keys;
    None: ``dp`` replicas and every other degree
    1. A plan with activation checkpointing names ``train.activation_checkpointing`` in the comment. A table
    never pairs ``layout = "encoder_parallel"`` with ``attach_encoders = true`` (the encoders then sit on the first
    LLM rank, not on parallel ranks): the layout line is left out there (its default) and a comment says where
    the encoders run.

    Raises:
        ValueError: when ``fields`` has no ``degree`` or a value has no TOML form here.
    """
    if "degree" not in fields:
        raise ValueError(f"a [parallel.pp] table needs a degree, got fields {sorted(fields)}")
    degree = int(fields["degree"])
    degrees = dict(dp=dp, dp_shard=1, tp=1) if degrees is None else degrees
    head = _parallel_table(degrees, degree)
    if degree == 1:
        return head
    note = ""
    if fields.get("attach_encoders") and fields.get("layout") == "encoder_parallel":
        fields = {k: v for k, v in fields.items() if k != "layout"}  # not "encoder_parallel" next to attached encoders
        note = ("# attach_encoders: every encoder is its own stage, all on the first LLM rank (layout left at its "
                "default)\n")
    body = "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in fields.items())
    return head + note + "[parallel.pp]\n" + body


def _parallel_table(degrees: Mapping[str, Any], pp: int) -> str:
    """Comment line and ``[parallel]`` table of a plan (``pp_toml``)."""
    dp, shard, tp = int(degrees["dp"]), int(degrees["dp_shard"]), int(degrees["tp"])
    cp = int(degrees.get("cp", 1))
    ac = degrees.get("activation_checkpointing", "none")
    pipeline = f"a pipeline of {pp} ranks per replica" if pp > 1 else "no pipeline (the whole model on each rank)"
    note = (f"# plait plan: {dp * shard * pp * tp * cp} processes = dp {dp} x dp_shard {shard} x pp {pp} x tp {tp} "
            f"x cp {cp}, {pipeline}; these tables replace the job's [parallel]"
            + (" and [parallel.pp]" if pp > 1 else " (and any [parallel.pp])")
            + (f"; also set activation_checkpointing = {toml_value(ac)} in [train]" if ac != "none" else "") + "\n")
    return (note + "[parallel]\nplan = \"manual\"\n"
            + "".join(f"{k} = {v}\n" for k, v in (("dp", dp), ("dp_shard", shard), ("tp", tp), ("cp", cp)))
            + (f"offload = {toml_value(degrees['offload'])}\n" if degrees.get("offload", "none") != "none" else "")
            + (f"fsdp_reduce = {toml_value(degrees['fsdp_reduce'])}\n"
               if degrees.get("fsdp_reduce", "step") != "step" else "")
            + (f"fsdp_reshard = {toml_value(degrees['fsdp_reshard'])}\n"  # "auto" runs "after_forward"
               if degrees.get("fsdp_reshard", "auto") not in ("auto", "after_forward") else "")
            + (f"rank_order = {toml_value(degrees['rank_order'])}\n"
               if degrees.get("rank_order", "auto") not in ("auto", "dp_outer") else "")
            + (f"ep = {int(degrees['ep'])}\n" if int(degrees.get("ep", 1)) > 1 else ""))


# ----- the plan file -----------------------------------------------------------------------------------------
def plan_to_json(choice: LayoutChoice, pp_table: str | None) -> str:
    """The plan file's text: ``choice.to_dict()`` and the ``[parallel.pp]`` table (or None) under ``PP_TOML_KEY``."""
    return json.dumps({**choice.to_dict(), PP_TOML_KEY: pp_table}, indent=2)


def plan_from_json(text: str) -> LayoutChoice:
    """The ``LayoutChoice`` of a plan file (:func:`plan_to_json`; its ``PP_TOML_KEY`` entry dropped).

    Raises:
        ValueError: when the text is not JSON, or not such a plan: missing or unknown keys (saying when it looks
            like a profile or a Chrome trace), or as ``LayoutChoice.from_dict``.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"a plan is a JSON object, got {type(data).__name__}")
    data.pop(PP_TOML_KEY, None)
    fields = dataclasses.fields(LayoutChoice)
    missing = [f.name for f in fields
               if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    unknown = sorted(set(data) - {f.name for f in fields})
    if missing or unknown:
        kind = "a profile (plait profile --out)" if {"format", "key", "measurements"} <= set(data) else (
            "a Chrome trace (e.g. timeline.json)" if "traceEvents" in data else "")
        raise ValueError(("it looks like " + kind + "; " if kind else "")
                         + f"a plan has the keys of LayoutChoice; missing {missing[:6]}"
                         + (f", unknown {unknown[:6]}" if unknown else ""))
    return LayoutChoice.from_dict(data)


# ----- profiles ----------------------------------------------------------------------------------------------
def format_profile(profile: Profile) -> str:
    """The profile as a plain-text table: one row per unit (flags, forward / dX / dW / fused-backward ms,
    parameter, gradient, optimizer-state, saved-activation and output KiB), then the chunk overheads (with one
    line explaining a negative one: the module ran faster as one chunk than its units apart)."""
    head = (f"{'unit':<56} {'T':>1}{'X':>1} {'F ms':>8} {'dX ms':>8} {'dW ms':>8} {'B ms':>8} {'param KiB':>10} "
            f"{'grad KiB':>9} {'optim KiB':>10} {'act KiB':>9} {'out KiB':>8}")
    lines = [f"profile: {profile.key.device}, {profile.key.dtype}, torch {profile.key.torch_version}, plait "
             f"{profile.key.plait_version}; median of {profile.repeats} after {profile.warmup} warm-up", head]
    for unit, m in zip(profile.units, profile.measurements):
        name = unit.name if len(unit.name) <= 56 else "..." + unit.name[-53:]
        lines.append(
            f"{name:<56} {_train_flag(unit):>1}{'X' if unit.needs_input_grad else '-':>1} "
            f"{1e3 * m.forward_s:>8.3f} {1e3 * m.input_grad_s:>8.3f} {1e3 * m.weight_grad_s:>8.3f} "
            f"{1e3 * m.fused_backward_s:>8.3f} {m.param_bytes / 1024:>10.1f} {m.grad_bytes / 1024:>9.1f} "
            f"{m.optimizer_bytes / 1024:>10.1f} {m.activation_bytes / 1024:>9.1f} {m.output_bytes / 1024:>8.1f}")
    lines.append(f"runtime cost per action: {1e3 * profile.action_overhead_s:.3f} ms")
    for module, over in profile.chunk_overhead_s.items():
        split = "".join(f", {kind} {1e3 * over[kind]:.3f} ms" for kind in ("B_split", "W_split") if kind in over)
        lines.append(f"chunk overhead {module}: F {1e3 * over.get('F', 0.0):.3f} ms, "
                     f"B {1e3 * over.get('B', 0.0):.3f} ms{split}")
    if any(v < 0 for over in profile.chunk_overhead_s.values() for v in over.values()):
        lines.append("a negative chunk overhead: the module ran faster as one chunk than its units measured apart; "
                     "kept as a correction (a stage's time is clipped at 0)")
    lines.append("T = trainable, L = LoRA (frozen base + trainable adapters), X = needs input gradient; "
                 "B = fused backward (dX + dW in one pass)")
    return "\n".join(lines)


def _train_flag(unit: Unit) -> str:
    """``T`` trainable, ``L`` LoRA (:attr:`Unit.adapter`), ``-`` frozen."""
    return "L" if unit.adapter else ("T" if unit.trainable else "-")


def format_lora_units(units: Sequence[Unit]) -> str:
    """One line per module with LoRA units (:attr:`Unit.adapter`): how many, and the share of their parameters
    the adapters are (what their dW, gradients and optimizer state cost, ``Unit.trained_fraction``), each line
    ending with a newline; ``""`` when no unit is a LoRA unit."""
    lines = []
    modules = dict.fromkeys(u.module for u in units)
    for module in modules:
        lora = [u for u in units if u.module == module and u.adapter]
        if lora:
            share = sum(u.trainable_fraction for u in lora) / len(lora)
            lines.append(f"LoRA {module}: {len(lora)} units with a frozen base and trainable adapters (mean "
                         f"{100 * share:.2f}% of a unit's parameters): backward = dX through the base + the "
                         f"adapters' dW; gradients and optimizer state for the adapters only\n")
    return "".join(lines)
