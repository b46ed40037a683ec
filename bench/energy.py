"""Energy bloat of pipeline plans (issue 17, Perseus): the nine MLLMs of ``bench/pipeline_plans.py`` (frozen
setting) on 8, 16 and 32 GPUs of one preset, Megatron-style even split (A) and plait's plan (C).

For each plan, one replica's iteration (the plan's schedule: 1F1B or interleaved 1F1B) becomes the action DAG of
``plait.planner.energy.frontier`` with each stage action's (time, energy) at the preset's SM clocks
(``plait.planner.energy.power_profile``: the analytic GPU preset combined with the roofline cost model), and the
time-energy frontier is traced (``energy_frontier.energy_frontier``: lowtime's Phillips-Dessouky solver for 12 s
over options at most 1.3x slower than the top clock, uniformly stretched candidates, every point re-timed exactly
and slack-polished, and the points at ``T*`` and at the straggler's time refined by a HiGHS MILP for 17 s each,
warm-started from the best point found). Columns:

- ``T*``: iteration time of one replica with every action at the top clock (the simulator's makespan);
- ``E max``: energy of one replica's iteration at the top clock, blocking power included
  (``sum e + P_blocking (R T - sum t)``, R GPUs of the replica);
- ``E T*`` / ``save``: energy of the frontier's fastest point (same iteration time: intrinsic bloat removed);
- ``strag``: savings when another replica straggles at 1.2 x T*: every other replica must wait until
  ``T' = 1.2 T*`` anyway; top clock + waiting (``E max`` + ``P_blocking R (T' - T*)``) against the least-energy
  frontier point within ``T'`` plus its own wait (Perseus' extrinsic bloat). Reported per waiting replica (the
  straggler's own energy is unchanged by the plan).
- ``pts``: frontier points; ``solve``: seconds to build the DAG and trace the frontier.

A plan marked ``!`` exceeds the memory cap (the even split's DP degree is chosen by the frozen-unaware model, as
in ``bench/pipeline_plans.py``) and is left out of the means.

Savings come from the preset's power model (``energy_profile`` docstring: data-sheet TDP and clocks, assumed
shape parameters), not from measurements. Run: ``.venv/bin/python bench/energy.py`` (``--help``: models, GPU
counts, preset, solver steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_plans as pp  # noqa: E402  (the nine models, their units and the plan searches)

from plait.planner.cost.analytic import unit_estimates  # noqa: E402
from plait.planner.energy.frontier import energy_at_deadline, energy_frontier, energy_plan, schedule_energy_dag  # noqa: E402
from plait.planner.energy.power_profile import analytic_energy_profile, gpu_preset, stage_action_options  # noqa: E402
from plait.planner.cost.types import ProfileKey  # noqa: E402
from plait.planner.pipeline.schedules import build_schedule  # noqa: E402
from plait.planner.search.types import Machine, SearchSpace  # noqa: E402
from plait.planner.search.layout import megatron_even_split, plan_layout
from plait.planner.search.types import LayoutChoice  # noqa: E402

STRAGGLER = 1.2
MAX_SLOWDOWN = 1.3  # lowtime traces the fast part of the frontier (options up to 1.3x slower)
REFINE_S = 17.0  # MILP seconds on the T* point and on the straggler point


def plan_energy(choice: LayoutChoice, units, profile, steps: int, time_limit_s: float) -> dict[str, float]:
    """Energy numbers of one plan (module docstring columns)."""
    start = time.perf_counter()
    schedule = build_schedule(choice.plan, choice.schedule, choice.microbatches_per_replica)
    options = stage_action_options(choice.plan, units, profile, split_backward=schedule.split_backward)
    dag = schedule_energy_dag(schedule, options, p2p=choice.p2p, boundary_bytes=dict(enumerate(choice.stage_boundary_bytes)),
                              blocking_w=profile.blocking_power_w)
    t_star, e_max = dag.evaluate(dag.top_clock)
    deadline = STRAGGLER * t_star
    frontier = energy_frontier(dag, method="lowtime", steps=steps, time_limit_s=time_limit_s, deadlines=[deadline],
                               max_slowdown=MAX_SLOWDOWN, refine_s=REFINE_S)
    solve = time.perf_counter() - start
    plan = energy_plan(dag, frontier, profile.gpu, profile.max_frequency_mhz, max_points=len(frontier))
    ranks, power = dag.num_ranks, profile.blocking_power_w
    wait_max = e_max + power * ranks * (deadline - t_star)
    wait_plan = min(energy_at_deadline(p, deadline, ranks, power) for p in plan.points if p.iteration_time_s <= deadline)
    e_star = plan.point_for(t_star * (1 + 1e-9)).energy_j
    return {"t_star": t_star, "t_fast": frontier[0].time_s, "e_max": e_max, "e_star": e_star,
            "save": 1 - e_star / e_max, "strag": 1 - wait_plan / wait_max, "points": len(frontier),
            "solve": solve, "actions": len(dag.actions)}


def _profile(name: str, units, gpu):
    configs, shapes = pp.model_configs(name)
    estimates = unit_estimates(units, configs, shapes)
    key = ProfileKey({"bench": name}, [], "bfloat16", gpu.name, "bench", "bench")
    return analytic_energy_profile(units, estimates, gpu, key, device=pp.DEVICE)


def _row(label: str, choice: LayoutChoice | None, units, profile, steps: int, limit: float) -> dict[str, float] | None:
    if choice is None:
        print(f"  {label}: no plan")
        return None
    out = plan_energy(choice, units, profile, steps, limit)
    if abs(out["t_star"] - choice.makespan_s) > 1e-6 * choice.makespan_s:
        print(f"  {label}: warning: DAG T* {out['t_star']:.4f} s != plan makespan {choice.makespan_s:.4f} s")
    out["fits"] = choice.fits_memory
    mark = " " if choice.fits_memory else "!"
    print(f"  {label:<2}{mark}{pp._layout_tag(choice):<22} T* {out['t_star']:7.3f}s  E max {out['e_max'] / 1e3:8.2f} kJ  "
          f"E T* {out['e_star'] / 1e3:8.2f} kJ  save {100 * out['save']:5.1f}%  strag {100 * out['strag']:5.1f}%  "
          f"pts {out['points']:4d}  actions {out['actions']:5d}  solve {out['solve']:6.1f}s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--models", nargs="+", default=list(pp.MODELS), choices=list(pp.MODELS))
    parser.add_argument("--gpu", default="h100", help="GPU preset (a100, h100, h200); the plans use bench/"
                                                     "pipeline_plans.py's H100 roofline")
    parser.add_argument("--steps", type=int, default=60, help="lowtime time quanta over the frontier's span")
    parser.add_argument("--time-limit", type=float, default=12.0, help="seconds lowtime may trace one frontier")
    args = parser.parse_args()
    gpu = gpu_preset(args.gpu)
    print(f"energy per replica iteration, preset {gpu.name} (TDP {gpu.tdp_w:.0f} W, clocks "
          f"{gpu.frequencies_mhz[-1]}-{gpu.max_frequency_mhz} MHz, blocking {gpu.blocking_w:.0f} W), "
          f"{pp.MICROBATCHES} microbatches, frozen setting, straggler {STRAGGLER}x\n")
    results: dict[str, list[dict[str, float]]] = {"A": [], "C": []}
    for name in args.models:
        units, costs, _ = pp.build(name, "frozen")
        profile = _profile(name, units, gpu)
        for gpus in args.gpus:
            print(f"{name} on {gpus} GPUs")
            common = dict(microbatches=pp.MICROBATCHES,
                          machine=Machine(memory_cap=pp.MEMORY_CAP, p2p=pp.P2P, dp_link=pp.DP_LINK))
            dps = [d for d in range(1, min(gpus, pp.MICROBATCHES) + 1) if gpus % d == 0]
            space = SearchSpace(dp_degrees=dps, virtual_stages=pp.VIRTUAL_STAGES, attach_encoders=True)
            plans = {}
            for key, call in (("A", lambda: megatron_even_split(units, costs, gpus, **common)),
                              ("C", lambda: plan_layout(units, costs, gpus, space=space, **common))):
                try:
                    plans[key] = call()
                except ValueError:
                    plans[key] = None
            for key in ("A", "C"):
                row = _row(key, plans[key], units, profile, args.steps, args.time_limit)
                if row is not None:
                    results[key].append(row)
    print()
    print("'!': over the memory cap (left out of the means, as in bench/pipeline_plans.py)")
    for key, label in (("A", "Megatron-style even split"), ("C", "plait's plan")):
        rows = [r for r in results[key] if r["fits"]]
        if rows:
            print(f"{label}: mean savings at T* {100 * statistics.fmean(r['save'] for r in rows):.1f}% "
                  f"(min {100 * min(r['save'] for r in rows):.1f}%), with a {STRAGGLER}x straggler "
                  f"{100 * statistics.fmean(r['strag'] for r in rows):.1f}% ({len(rows)} rows); largest solve "
                  f"{max(r['solve'] for r in rows):.1f} s ({max(rows, key=lambda r: r['solve'])['actions']} actions)")


if __name__ == "__main__":
    main()
