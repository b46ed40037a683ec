"""Prepared GPU check of issue 17 (energy, Perseus): one command, a few minutes on one GPU, prints tables.

1. **Profile**: the demo model's (``configs/demo.toml``) pipeline units at ``--clocks`` SM clocks (3-5, from the
   top down to half of it), time and energy per pass with NVML through zeus (``plait.measure.energy_sweep``),
   summed into the stage actions of the demo's pipeline plan (``encoder_parallel``: vision, audio and LLM stages,
   one per rank); prints, per clock, each stage action's milliseconds and joules.
2. **Plan**: the 1F1B schedule of that plan as the action DAG, its time-energy frontier
   (``plait.planner.energy.frontier``) and the frequency plan; prints ``T*`` and the energy at the top clock and
   at the fastest frontier point.
3. **Run**: ``--steps`` pipeline steps in this process (the same stages, all on this device) at the top clock,
   then as many with the plan's fastest point set before every action (``plait.parallel.energy``); prints step
   time, energy per step (NVML; RAPL on CPU where readable; else n/a) and checks that each action ran at its
   planned frequency.

Where clocks cannot be locked (no GPU, zeus missing, no ``SYS_ADMIN``) step 1 says why and is skipped, the plan is
a synthetic one (every F at 1500 MHz, every B at 1200 MHz) and step 3 runs the recording path: the script is known
to work on CPU: ``.venv/bin/python bench/gpu_energy_check.py --device cpu``. On a GPU:
``.venv/bin/python bench/gpu_energy_check.py`` (needs ``pip install -e ".[energy]"``; expected 2-4 minutes: about
20 units x 4 passes x 4 clocks of two 0.1 s NVML windows each, plus the steps; not yet run on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.measure.job_profile import build_profile_inputs  # noqa: E402
from plait.config.loader import load_config  # noqa: E402
from plait.models.units import model_units  # noqa: E402
from plait.parallel.energy import build_frequency_controller  # noqa: E402
from plait.parallel.pipeline import run_pipeline_step  # noqa: E402
from plait.parallel.stages import build_rank_stages  # noqa: E402
from plait.planner.energy.frontier import energy_frontier, energy_plan, schedule_energy_dag  # noqa: E402
from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint, action_label  # noqa: E402
from plait.planner.energy.power_profile import stage_action_options  # noqa: E402
from plait.planner.pipeline.plan import plan_pipeline  # noqa: E402
from plait.planner.pipeline.schedules import build_schedule  # noqa: E402
from plait.measure.energy_sweep import gpu_clock_control, measure_energy_profile, sweep_clocks  # noqa: E402
from plait.train.loss import token_loss_sum  # noqa: E402
from plait.train.metrics import detect_energy_meter  # noqa: E402


def profile_table(profile, schedule, units) -> dict:
    """Print per clock the ms and J of each stage action ``schedule`` runs; returns their options."""
    kinds = {a.kind for _, a in schedule.all_actions()}
    options = {k: v for k, v in stage_action_options(schedule.plan, units, profile,
                                                     split_backward=schedule.split_backward).items() if k[1] in kinds}
    keys = sorted(options)
    print(f"\n1. energy profile of {profile.gpu} (blocking power {profile.blocking_power_w:.1f} W)")
    print(f"{'clock MHz':>10} " + " ".join(f"{f'{k} s{s}':>18}" for s, k in keys) + f" {'sum ms':>9} {'sum J':>9}")
    for i, mhz in enumerate(profile.frequencies_mhz):
        cells = [options[key][i] for key in keys]
        print(f"{mhz:>10} " + " ".join(f"{t * 1e3:9.3f}ms {e:6.3f}J" for _, t, e in cells)
              + f" {sum(c[1] for c in cells) * 1e3:9.3f} {sum(c[2] for c in cells):9.3f}")
    return options


def frequency_plan(schedule, options, profile) -> EnergyPlan:
    """The frontier of ``schedule``'s DAG and its frequency plan; prints T*, E at the top clock and at T*."""
    start = time.perf_counter()
    dag = schedule_energy_dag(schedule, options, blocking_w=profile.blocking_power_w)
    t_star, e_max = dag.evaluate(dag.top_clock)
    frontier = energy_frontier(dag, time_limit_s=60.0)
    plan = energy_plan(dag, frontier, profile.gpu, profile.max_frequency_mhz)
    best = plan.points[0]
    print(f"\n2. frontier: {len(frontier)} points in {time.perf_counter() - start:.1f} s; T* {t_star * 1e3:.3f} ms, "
          f"E(top clock) {e_max:.3f} J, E(T* point) {best.energy_j:.3f} J "
          f"({100 * (1 - best.energy_j / e_max):.1f}% less), {len(best.frequencies)} actions below the top clock")
    return plan


def synthetic_plan(schedule) -> EnergyPlan:
    """Every F at 1500 MHz, every B/W at 1200 MHz (the recording path without a measured profile)."""
    freqs = tuple(ActionFrequency(rank, action_label(a.kind, a.stage, a.microbatch), 1500 if a.kind == "F" else 1200)
                  for rank, actions in enumerate(schedule.actions) for a in actions)
    return EnergyPlan("synthetic", 1980, (FrontierPoint(1.0, 1.0, freqs),))


def on_one_rank(plan: EnergyPlan) -> EnergyPlan:
    """The plan with every action on rank 0 (this process runs every stage; stage indices are the same)."""
    points = tuple(dataclasses.replace(p, frequencies=tuple(dataclasses.replace(a, rank=0) for a in p.frequencies))
                   for p in plan.points)
    return dataclasses.replace(plan, points=points)


def run_steps(stages, schedule, inputs, steps: int, controller, meter, clocks) -> tuple[float, float | None, list]:
    """``steps`` pipeline steps; returns (mean step s, mean J per step or None, the last step's events)."""
    batches = inputs.microbatches
    targets = sum(b.target_tokens for b in batches)
    kwargs = [inputs.llm_kwargs(b) for b in batches]
    times, joules, events = [], [], []
    if clocks is not None and controller is None:
        clocks.lock(clocks.supported_mhz[0])
    for _ in range(steps + 1):  # the first is a warm-up
        mark = meter.read_j() if meter is not None else 0.0
        start = time.perf_counter()
        res = run_pipeline_step(stages, schedule, batches, targets, loss_fn=token_loss_sum, autocast=inputs.autocast,
                                llm_kwargs=kwargs, frequency=controller)
        if batches[0].input_ids.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        joules.append(meter.read_j() - mark if meter is not None else 0.0)
        events = list(res.events)
        for _, p in stages.trainable_parameters():
            p.grad = None
    energy = statistics.mean(joules[1:]) if meter is not None else None
    return statistics.mean(times[1:]), energy, events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/demo.toml"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--clocks", type=int, default=4, help="SM clocks of the sweep (3-5)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-window", type=float, default=0.1, help="least seconds of each NVML window")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    cfg = load_config(args.config, [f"--train.device={device}", "--data.num_workers=0"])
    inputs = build_profile_inputs(cfg, microbatches=args.microbatches, microbatch_size=args.microbatch_size,
                                  device=device)
    units = model_units(inputs.model)
    plan = plan_pipeline(units, "encoder_parallel")
    schedule = build_schedule(plan, "1f1b", args.microbatches)
    print(f"plait GPU energy check: {device}, demo model, {plan.num_stages} stages "
          f"({', '.join('+'.join(s.modules) for s in plan.stages)}), 1F1B, {args.microbatches} microbatches of "
          f"{args.microbatch_size}")
    clocks, reason = gpu_clock_control(torch.device(device))
    if clocks is None:
        print(f"\n1. energy profile: skipped: {reason}\n2. frontier: skipped; synthetic plan (F 1500 MHz, B 1200 MHz)")
        eplan = synthetic_plan(schedule)
    else:
        from zeus.monitor import ZeusMonitor

        monitor = ZeusMonitor(gpu_indices=[clocks.index], cpu_indices=[], approx_instant_energy=True)
        freqs = sweep_clocks(clocks.supported_mhz, args.clocks)
        profile = measure_energy_profile(inputs.model, inputs.microbatches[:1], inputs.key, clocks, freqs, monitor,
                                         repeats=args.repeats, warmup=1, min_window_s=args.min_window,
                                         llm_kwargs=inputs.llm_kwargs, autocast=inputs.autocast, progress=print)
        eplan = frequency_plan(schedule, profile_table(profile, schedule, units), profile)
    one = plan_pipeline(units, "encoder_parallel", ranks=[0] * plan.num_stages)
    run_schedule = build_schedule(one, "gpipe", args.microbatches)
    stages = build_rank_stages(inputs.model, one, 0)
    stages.train()
    meter = detect_energy_meter(device)
    merged = on_one_rank(eplan)
    controller = build_frequency_controller(merged, 0, torch.device(device))
    print(f"\n3. {args.steps} steps each (this process runs every stage; energy: "
          f"{meter.source if meter is not None else 'n/a (no NVML, no readable RAPL)'}; clocks "
          f"{'locked' if controller.applies else 'recorded only'})")
    print(f"{'run':<24} {'step ms':>9} {'J/step':>9} {'frequencies (MHz)':>30}")
    for name, ctl in (("top clock", None), ("frequency plan (T*)", controller)):
        seconds, energy, events = run_steps(stages, run_schedule, inputs, args.steps, ctl, meter, clocks)
        used = sorted({e.frequency_mhz for e in events}, reverse=True)
        print(f"{name:<24} {seconds * 1e3:9.2f} {f'{energy:.3f}' if energy is not None else 'n/a':>9} "
              f"{str(used):>30}")
    planned = [merged.frequency_of(merged.points[0], 0, action_label(e.kind, e.stage, e.microbatch)) for e in events]
    ok = [e.frequency_mhz for e in events] == planned
    controller.close()
    if clocks is not None:
        clocks.reset()
    print(f"\nevery action ran at its planned frequency: {ok} ({len(events)} actions); "
          f"total {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
