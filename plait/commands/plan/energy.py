"""``plait energy``: the time-energy frontier of a job's pipeline plan and its per-action GPU frequencies (Perseus).

:func:`energy_command` plans the job as ``plait plan`` does (``commands.plan.command.plan_command`` on the chosen GPU
preset), turns one replica's iteration of the plan's schedule into the action DAG of
``plait.planner.energy.frontier`` with each stage action's (time, energy) per SM clock (the analytic preset of
``plait.planner.energy.power_profile`` combined with the roofline cost model, scaled so that the top clock gives the
plan's own stage times), traces the frontier and writes into ``--out-dir``:

- ``energy_plan.json``: the frequency plan (``plait.planner.energy.types.EnergyPlan``; the pipeline runtime reads
  it through ``[energy] plan = "path"``): frontier points with each action's frequency;
- ``frontier.json`` (every frontier point's time and energy) and ``frontier.png`` (energy against iteration
  time, the top-clock iteration and the chosen plans marked);
- ``timelines.png``: the top-clock iteration, the plan at ``T*`` and the plan at the straggler's time, each
  action coloured by its frequency (the simulator's replay, ``energy_frontier.replay_plan``).

It prints the table: iteration time and energy per iteration of one replica at the top clock, at the frontier's
fastest point ``T*`` (same time, intrinsic bloat removed) and, when another replica straggles at ``--straggler``
x ``T*``, waiting at the top clock against the frontier point within that time (extrinsic bloat), with savings.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from plait.train.job_file import load_config_for_planning
from plait.commands.plan.command import plan_command, split_global_batch
from plait.models.plan_inputs import build_plan_inputs, device_spec
from plait.planner.cost.analytic import unit_estimates
from plait.planner.energy.frontier import (
    energy_at_deadline,
    energy_frontier,
    energy_plan,
    replay_plan,
    schedule_energy_dag,
)
from plait.planner.energy.types import EnergyPlan, EnergyProfile, FrontierPoint
from plait.planner.energy.power_profile import GPU_PRESETS, analytic_energy_profile, gpu_preset, stage_action_options
from plait.planner.cost.types import ProfileKey
from plait.planner.energy.units import ENERGY_UNIT, TIME_SCALE, TIME_UNIT, format_energy, format_time
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.search.types import LayoutChoice
from plait.train.plots import plot_energy_frontier, plot_frequency_timelines

__all__ = ["GPUS", "REFINE_S", "TRACE_S", "energy_command", "job_action_options", "plan_by_energy",
           "require_pipeline"]

TRACE_S = 60.0
"""Seconds lowtime may trace the frontier (``energy_frontier``'s ``time_limit_s``)."""
REFINE_S = 10.0
"""MILP seconds spent on the ``T*`` point and on the straggler's point (``energy_frontier``'s ``refine_s``)."""


def energy_command(config_path: str | Path, devices: int, *, straggler: float = 1.2, gpu: str = "h100",
                   out_dir: str | Path | None = None, overrides: Sequence[str] = (), microbatches: int | None = None,
                   method: str = "auto", energy_profile: str | Path | None = None,
                   dp_degrees: Sequence[int] | None = None, out: TextIO | None = None,
                   encoder_dp: bool = True, encoder_tp: bool = False) -> dict[str, Any]:
    """``plait energy`` (module docstring).

    Args:
        config_path: TOML job file; overrides: dotted ``--section.key=value`` overrides.
        devices: GPUs to plan for.
        straggler: another replica's iteration time as a multiple of ``T*`` (> 1 plans a straggler point).
        gpu: GPU preset (``a100``, ``h100``, ``h200``).
        out_dir: folder for the outputs (default ``runs/<job file stem>/energy``).
        microbatches: as ``plait plan --microbatches``.
        method: frontier solver (``energy_frontier.energy_frontier``: ``auto``, ``exact``, ``lowtime``).
        energy_profile: a measured energy profile JSON (``plait profile --energy``:
            ``energy_profile.EnergyProfile``) to use instead of the preset: its clocks, times, energies and blocking
            power, unscaled (the frontier's ``T*`` is then the measured prediction, not the plan's).
        dp_degrees: as ``plait plan --dp`` (``[1]``: one pipeline over the devices).
        out: text stream (default stdout).
        encoder_dp: as ``plait plan --encoder-dp``, on by default (replicated encoder stages: each replica stage's
            actions get their own frequencies, its costs a share of its branch's rows); False: one replica per
            encoder stage.
        encoder_tp: as ``plait plan --encoder-tp`` (tensor-parallel encoder stages: each TP rank's actions get
            their own frequencies, its costs by ``evaluate_plan``'s TP rule, :func:`job_action_options`).

    Returns:
        ``{"plan": EnergyPlan, "paths": {name: Path}, "rows": {name: (seconds, joules)}}``.

    Raises:
        ValueError: on a straggler factor below 1, an unknown GPU or method, as ``plait plan``, and when the plan
            has no pipeline (:func:`require_pipeline`: a frequency plan sets the clocks of pipeline actions and
            training refuses ``energy.plan`` without ``parallel.pp.degree > 1``); FileNotFoundError: on a missing
            job file.
    """
    stream = out or sys.stdout
    if not straggler >= 1.0:
        raise ValueError(f"--straggler must be >= 1 (a multiple of the fastest iteration time), got {straggler}")
    preset = gpu_preset(gpu)
    measured = _read_profile(energy_profile) if energy_profile is not None else None
    choice = plan_command(config_path, devices, None, overrides=overrides, device=preset.name,
                          microbatches=microbatches, dp_degrees=dp_degrees, out=stream, profile_store=None,
                          encoder_dp=encoder_dp, encoder_tp=encoder_tp)
    require_pipeline(choice, devices)
    schedule = build_schedule(choice.plan, choice.schedule, choice.microbatches_per_replica)
    options = job_action_options(config_path, overrides, microbatches, choice, preset.name, measured)
    blocking = preset.blocking_w if measured is None else measured.blocking_power_w
    if measured is not None:
        print(f"plait energy: measured energy profile {energy_profile} ({measured.gpu}, clocks "
              f"{measured.frequencies_mhz[-1]}-{measured.max_frequency_mhz} MHz)", file=stream)
    dag = schedule_energy_dag(schedule, options, p2p=choice.p2p,
                              boundary_bytes=dict(enumerate(choice.stage_boundary_bytes)), blocking_w=blocking)
    t_star, e_max = dag.evaluate(dag.top_clock)
    deadline = straggler * t_star
    frontier = energy_frontier(dag, method=method, deadlines=[deadline], max_slowdown=max(1.5, 1.25 * straggler),
                               refine_s=REFINE_S, time_limit_s=TRACE_S)
    gpu_name, top = (preset.name, preset.max_frequency_mhz) if measured is None else (measured.gpu, measured.max_frequency_mhz)
    plan = energy_plan(dag, frontier, gpu_name, top, keep=[t_star, deadline])
    slow = min((p for p in plan.points if p.iteration_time_s <= deadline * (1 + 1e-12)),
               key=lambda p: energy_at_deadline(p, deadline, dag.num_ranks, blocking))
    fastest = plan.point_for(t_star * (1 + 1e-9))
    rows = {"max frequency": (t_star, e_max), "plan at T*": (fastest.iteration_time_s, fastest.energy_j),
            f"max frequency, waiting {straggler:g}x": (deadline, e_max + blocking * dag.num_ranks * (deadline - t_star)),
            f"plan at {straggler:g}x T*": (deadline, energy_at_deadline(slow, deadline, dag.num_ranks, blocking))}
    _print_table(stream, rows, choice, gpu_name, len(frontier))
    folder = Path(out_dir) if out_dir is not None else Path("runs") / Path(config_path).stem / "energy"
    paths = _write(folder, plan, frontier, rows, schedule, options, choice, blocking, (fastest, slow), straggler)
    for name, path in paths.items():
        print(f"plait energy: wrote {name} {path}", file=stream)
    return {"plan": plan, "paths": paths, "rows": rows}


def require_pipeline(choice: LayoutChoice, devices: int) -> None:
    """Refuse a plan without a pipeline for ``plait energy``.

    Raises:
        ValueError: when ``choice`` has one pipeline rank, naming why (a frequency plan sets the SM clock of each
            pipeline action; training refuses ``energy.plan`` without ``parallel.pp.degree > 1``) and what to do.
    """
    if choice.plan.num_ranks > 1:
        return
    raise ValueError(
        f"plait energy: the plan for {devices} devices has no pipeline (DP {choice.dp}, the whole model on each "
        "GPU), so there is no frequency plan to make: energy.plan sets the SM clock of each pipeline action and "
        "training refuses it without parallel.pp.degree > 1. Plan one pipeline over the GPUs with --dp 1 (or "
        "give each replica several GPUs: more --devices than the microbatches per step), or train without "
        "[energy] plan")


def job_action_options(config_path: str | Path, overrides: Sequence[str], microbatches: int | None,
                       choice: LayoutChoice, gpu: str,
                       measured: EnergyProfile | None = None) -> dict[tuple[int, str], list[tuple[int, float, float]]]:
    """Per stage action of ``choice``, ``(frequency_mhz, seconds, joules)`` at the preset's clocks: the job's units
    (``models.plan_inputs.build_plan_inputs``) through ``energy_profile.analytic_energy_profile``, each action's times
    and energies scaled so that its top-clock time is the plan's own (``choice.stage_forward_s`` /
    ``stage_backward_s``, which include activation recomputation and runtime overheads when charged). With a
    ``measured`` profile, its own numbers per unit, unscaled. A tensor-parallel encoder stage (``encoder_tp``)
    per TP rank, as ``evaluate_plan`` times it (``power_profile.stage_action_options``: layers divided by ``t``,
    their all-reduces on the plan's link at the blocking power).

    Raises:
        ValueError: when ``measured`` lacks a unit of the plan (naming it).
    """
    preset = gpu_preset(gpu)
    cfg, _ = load_config_for_planning(config_path, overrides)
    cfg = split_global_batch(cfg, microbatches)
    spec = device_spec(preset.name)
    inputs = build_plan_inputs(cfg, spec, microbatches=microbatches)
    estimates = unit_estimates(inputs.units, inputs.model_configs, inputs.shapes, inputs.dtype)
    key = ProfileKey({"job": str(config_path)}, {m: s.to_dict() for m, s in inputs.shapes.items()}, inputs.dtype,
                     preset.name, "", "")
    # a TP encoder stage per TP rank (encoder_tp): its all-reduces on the link evaluate_plan used (plan_command's
    # machine has no tp_link of its own: the plan's p2p)
    tp = dict(output_bytes={u.name: int(round(e.output_bytes)) for u, e in zip(inputs.units, estimates)},
              tp_link=choice.p2p)
    if measured is not None:
        return stage_action_options(choice.plan, inputs.units, measured, **tp)
    profile = analytic_energy_profile(inputs.units, estimates, preset, key, device=spec)
    options = stage_action_options(choice.plan, inputs.units, profile, **tp)
    targets = {"F": choice.stage_forward_s, "B": choice.stage_backward_s}
    out = {}
    for (stage, kind), opts in options.items():
        top = opts[0][1]
        factor = targets[kind][stage] / top if kind in targets and top > 0 else 1.0
        out[(stage, kind)] = [(f, t * factor, e * factor) for f, t, e in opts]
    return out


def _energy_preset(gpu: str | None, stream: TextIO) -> Any:
    """The GPU power preset of ``plait plan --energy`` (``plan_by_energy``'s ``gpu``), announced in one line.

    Raises:
        ValueError: when ``gpu`` names no GPU preset (``cpu``: energy is planned for GPUs only).
    """
    from plait.measure.host_costs import host_device

    if gpu is None:
        host, why = host_device()
        name, why = (host, why) if host != "cpu" else ("h100", f"{why}: the default")
    else:
        name, why = gpu, "--device"
    if name.lower() not in GPU_PRESETS:
        raise ValueError(f"plait plan --energy plans SM clocks of GPUs: --device {name} has no energy preset; "
                         f"choose one of {sorted(GPU_PRESETS)} (without --device: this host's GPU, else h100)")
    preset = gpu_preset(name)
    print(f"plait plan --energy: planning for the {preset.name} GPU preset ({preset.device.name}; {why}; --device "
          f"{'|'.join(sorted(GPU_PRESETS))} for another)", file=stream)
    return preset


def plan_by_energy(config_path: str | Path, devices: int, *, tolerance: float = 0.02, gpu: str | None = None,
                   out_json: str | Path | None = None, overrides: Sequence[str] = (), microbatches: int | None = None,
                   out: TextIO | None = None, dp_degrees: Sequence[int] | None = None,
                   **plan_options: Any) -> LayoutChoice:
    """``plait plan --energy``: among the best plan of every DP degree and layout (``plan_command`` restricted to
    each), those whose predicted iteration time is within ``tolerance`` (a fraction) of the fastest are compared by
    energy per iteration at their own ``T*`` (all replicas: DP x one replica's frontier point at ``T*``, on the
    ``gpu`` preset; GPUs a plan leaves idle are not charged) and the least-energy one is printed and written as
    ``plait plan`` does. ``gpu``: the GPU preset (``plait plan --device``); None: this host's GPU's
    (``measure.host_costs.host_device``), else (no GPU) the H100's; the first line printed names it and why.
    ``dp_degrees`` (``plait plan --dp``): only those DP degrees are compared; None: every divisor of ``devices``.

    Raises:
        ValueError: on a negative tolerance, a device without a GPU energy preset (``cpu``), and as ``plait plan``.
    """
    import io

    from plait.planner.pipeline.types import LAYOUTS

    if not tolerance >= 0:
        raise ValueError(f"--energy tolerance must be >= 0 (a fraction of the fastest iteration time), got {tolerance}")
    stream = out or sys.stdout
    preset = _energy_preset(gpu, stream)
    candidates, seen = [], set()
    for dp in dp_degrees or [d for d in range(1, devices + 1) if devices % d == 0]:
        for layout in LAYOUTS:
            try:
                choice = plan_command(config_path, devices, None, overrides=overrides, device=preset.name,
                                      microbatches=microbatches, dp_degrees=[dp], layouts=[layout],
                                      out=io.StringIO(), profile_store=None, **plan_options)
            except ValueError:
                continue  # this DP degree / layout has no plan (microbatches, memory)
            key = (choice.dp, choice.schedule, json.dumps(choice.plan.to_dict(), sort_keys=True))
            if key not in seen:  # both layout restrictions can give the same plan (e.g. no pipeline)
                seen.add(key)
                candidates.append(choice)
    if not candidates:
        raise ValueError(f"plait plan --energy: no plan for {devices} devices")
    fastest = min(c.iteration_s for c in candidates)
    print(f"plait plan --energy: plans within {100 * tolerance:g}% of the fastest ({format_time(fastest)}), energy per "
          f"iteration at T* on {preset.name} (all replicas):", file=stream)
    best, best_energy = None, float("inf")
    for choice in sorted(candidates, key=lambda c: c.iteration_s):
        if choice.iteration_s > fastest * (1 + tolerance):
            continue
        energy = choice.dp * _energy_at_t_star(config_path, overrides, microbatches, choice, preset.name)
        print(f"  {choice.layout:<20} DP {choice.dp:<3} {choice.plan.num_ranks} ranks per replica: iteration "
              f"{format_time(choice.iteration_s)}, {format_energy(energy)}", file=stream)
        if energy < best_energy:
            best, best_energy = choice, energy
    print(f"plait plan --energy: chose {best.layout}, DP {best.dp}", file=stream)
    return plan_command(config_path, devices, out_json, overrides=overrides, device=preset.name,
                        microbatches=microbatches, dp_degrees=[best.dp], layouts=[best.layout], out=stream,
                        profile_store=None, **plan_options)


def _energy_at_t_star(config_path: str | Path, overrides: Sequence[str], microbatches: int | None,
                      choice: LayoutChoice, gpu: str) -> float:
    """Joules of one replica's iteration at the frontier point at ``T*`` (short frontier trace, refined)."""
    preset = gpu_preset(gpu)
    schedule = build_schedule(choice.plan, choice.schedule, choice.microbatches_per_replica)
    options = job_action_options(config_path, overrides, microbatches, choice, preset.name)
    dag = schedule_energy_dag(schedule, options, p2p=choice.p2p,
                              boundary_bytes=dict(enumerate(choice.stage_boundary_bytes)), blocking_w=preset.blocking_w)
    frontier = energy_frontier(dag, method="lowtime", steps=40, time_limit_s=10.0, max_slowdown=1.2, refine_s=5.0)
    t_star, _ = dag.evaluate(dag.top_clock)
    return min(c.energy_j for c in frontier if c.time_s <= t_star * (1 + 1e-9))


def _read_profile(path: str | Path) -> EnergyProfile:
    """The measured ``EnergyProfile`` at ``path``.

    Raises:
        FileNotFoundError: when it does not exist; ValueError: naming the file when it is not an energy profile.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--energy-profile {file} does not exist")
    try:
        return EnergyProfile.from_json(file.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--energy-profile {file} is not an energy profile written by `plait profile --energy` "
                         f"({exc})") from exc


def _print_table(stream: TextIO, rows: dict[str, tuple[float, float]], choice: LayoutChoice, gpu: str,
                 points: int) -> None:
    print(f"\nplait energy: {points} frontier point{'s' if points != 1 else ''} on {gpu} (one replica: {choice.plan.num_ranks} GPUs, "
          f"DP {choice.dp}; energies per replica iteration, blocking power included)", file=stream)
    print(f"{'':<30} {f'iteration ({TIME_UNIT})':>15} {f'energy ({ENERGY_UNIT})':>12} {'savings':>8}", file=stream)
    base = 0.0
    for index, (name, (seconds, joules)) in enumerate(rows.items()):
        base = joules if index % 2 == 0 else base
        saving = "" if index % 2 == 0 else f"{100 * (1 - joules / base):7.1f}%"
        print(f"{name:<30} {seconds * TIME_SCALE:15.5g} {joules:12.5g} {saving:>8}", file=stream)


def _write(folder: Path, plan: EnergyPlan, frontier, rows, schedule, options, choice: LayoutChoice, blocking: float,
           chosen: tuple[FrontierPoint, FrontierPoint], straggler: float) -> dict[str, Path]:
    """The four output files (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "energy_plan.json"
    plan_path.write_text(plan.to_json(indent=1))
    front_path = folder / "frontier.json"
    front_path.write_text(json.dumps([{"iteration_time_s": c.time_s, "energy_j": c.energy_j} for c in frontier]))
    png = plot_energy_frontier([(c.time_s, c.energy_j) for c in frontier], folder / "frontier.png",
                               marks=dict(list(rows.items())[:2]), title=f"time-energy frontier ({plan.gpu})")
    replay = dict(p2p=choice.p2p, boundary_bytes=dict(enumerate(choice.stage_boundary_bytes)), blocking_w=blocking)
    panels = {}
    top = EnergyPlan(plan.gpu, plan.max_frequency_mhz, (FrontierPoint(0.0, 0.0),))  # every action at the top
    for label, (p, point) in {"max frequency": (top, top.points[0]), "plan at T*": (plan, chosen[0]),
                              f"plan at {straggler:g}x T*": (plan, chosen[1])}.items():
        result, _, freqs = replay_plan(schedule, options, p, point, **replay)
        panels[label] = (result.events, freqs)
    timeline = plot_frequency_timelines(panels, folder / "timelines.png", title="GPU frequency per action")
    return {"plan": plan_path, "frontier": front_path, "frontier plot": png, "timelines": timeline}


GPUS = tuple(GPU_PRESETS)
"""The ``--gpu`` choices."""
