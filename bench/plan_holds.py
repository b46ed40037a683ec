"""Plans that hold: is the plan ``plait plan --devices 2`` recommends on this machine as fast as the best of the
plans it considered, when each is run?

For each job (the demo ``configs/demo.toml``; ``bench/jobs/plan_holds_2layer.toml``, a 2-layer LLM with one small
encoder; ``bench/jobs/plan_holds_2stage.toml``, a wide LLM-only model with short sequences, where a 2-stage
pipeline pays off):

1. **Plan** as ``plait plan --config JOB --devices 2`` does on this host
   (``plait.commands.plan.compare.considered_plans``, with ``plan_command``'s costs: this host's CPU measured, a
   stored profile when one matches ``--profile-store``, else the analytic costs plus the CPU overheads): its
   recommendation and the best plan of each runnable family it weighs (plain DP, 1F1B in each layout,
   interleaved 1F1B, encoders attached), deduplicated. ``plan_command``'s own output gives the costs line.
2. **Run** each candidate for ``--steps`` optimizer steps after ``--warmup`` warm-up steps under
   ``torchrun --nproc_per_node 2`` (this file's ``--worker`` mode: ``Trainer.build`` / ``PipelineTrainer.build``
   of the job with the candidate's ``parallel.dp`` and ``[parallel.pp]``, ``train_step`` timed between two
   barriers on every rank; the step time is rank 0's). The training data is the job's first ``--samples``
   records (a copy with absolute media paths), so dataset processing stays short.
3. **Print** one table per job: per plan the predicted and measured (median) step time, and whether the
   recommended plan is within ``--noise`` (relative) of the fastest measured one.

Run: ``.venv/bin/python bench/plan_holds.py [--jobs demo,2layer,2stage] [--steps 6] [--warmup 2]`` (about 4 minutes
on the 2-core CPU). Exit status 1 when a recommendation does not hold.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

JOBS = {
    "demo": ROOT / "configs" / "demo.toml",
    "2layer": ROOT / "bench" / "jobs" / "plan_holds_2layer.toml",
    "2stage": ROOT / "bench" / "jobs" / "plan_holds_2stage.toml",
}
DEVICES = 2


@dataclass(frozen=True)
class Row:
    """One plan of a job: its label, predicted and measured (median) step seconds, and whether it is the
    recommended one."""

    label: str
    predicted_s: float
    measured_s: float
    recommended: bool


# ----- worker (one rank under torchrun) -------------------------------------------------------------------
def worker(configs: list[str], steps: int, warmup: int, out: str) -> None:
    """Build the trainer of every job in ``configs`` (``config_to_dict`` JSON files, all for this world size) in
    this process, then run ``warmup + steps`` rounds of one ``train_step`` per trainer in turn, each timed between
    two barriers, so that the host's speed drifting over minutes (a shared virtual machine) reaches every plan
    alike; rank 0 writes the timed rounds' seconds per job to ``out`` (JSON list of lists)."""
    import torch.distributed as dist

    from plait.config.loader import config_from_dict, validate
    from plait.parallel.process_group import init_distributed
    from plait.train.pipeline_trainer import PipelineTrainer
    from plait.train.trainer import Trainer

    cfgs = [config_from_dict(json.loads(Path(c).read_text())) for c in configs]
    info = None
    trainers = []
    for cfg in cfgs:
        validate(cfg)
        info = info or init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s)
        trainers.append((PipelineTrainer if cfg.parallel.pp.degree > 1 else Trainer).build(cfg, info))
    group = dist.is_initialized()
    times: list[list[float]] = [[] for _ in trainers]
    for round_ in range(warmup + steps):
        for k, trainer in enumerate(trainers):
            batch = trainer.loader.next_batch()
            if group:
                dist.barrier()
            start = time.perf_counter()
            trainer.train_step(batch)
            if group:
                dist.barrier()
            if round_ >= warmup:
                times[k].append(time.perf_counter() - start)
    if not group or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    if group:
        dist.destroy_process_group()


# ----- runner -------------------------------------------------------------------------------------------------
def small_train_set(path: Path, samples: int, folder: Path) -> Path:
    """The first ``samples`` records of the JSONL ``path`` with absolute media paths, written under ``folder``."""
    rows = []
    for line in path.read_text().splitlines()[:samples]:
        record = json.loads(line)
        for key in ("images", "audios"):
            record[key] = [str((path.parent / p).resolve()) for p in record.get(key, [])]
        rows.append(json.dumps(record))
    target = folder / "train.jsonl"
    target.write_text("\n".join(rows) + "\n")
    return target


def run_plans(cfgs: list, nproc: int, folder: Path, steps: int, warmup: int, timeout_s: float) -> list[list[float]]:
    """Run the jobs ``cfgs`` (``JobConfig`` s with their plans applied, all on ``nproc`` processes) interleaved in
    one ``torchrun --nproc_per_node nproc`` launch (``worker``); the timed steps' seconds per job (empty lists,
    with the error printed, when the run fails)."""
    from plait.config.loader import config_to_dict

    paths = []
    for k, cfg in enumerate(cfgs):
        cfg.metrics.run_dir = str(folder / f"run{nproc}_{k}")
        paths.append(folder / f"plan{nproc}_{k}.json")
        paths[-1].write_text(json.dumps(config_to_dict(cfg)))
    out = folder / f"times{nproc}.json"
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--steps", str(steps),
               "--warmup", str(warmup), "--out", str(out), "--worker", *map(str, paths)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out.is_file():
        print(f"  run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return [[] for _ in cfgs]
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_job(name: str, path: Path, args: argparse.Namespace) -> tuple[list[Row], str]:
    """Plan ``path`` for 2 devices, run the recommended plan and every considered one; rows and the plan text."""
    from plait.train.job_file import load_config_for_planning
    from plait.commands.plan.command import plan_command
    from plait.commands.plan.compare import considered_plans
    from plait.train.apply_plan import apply_layout_choice

    with tempfile.TemporaryDirectory(prefix=f"plan_holds_{name}_") as tmp:
        folder = Path(tmp)
        cfg, _ = load_config_for_planning(path)
        train = small_train_set(Path(cfg.data.train), args.samples, folder)
        overrides = [f"--data.train={train}", f"--metrics.run_dir={folder / 'run'}"]
        text = io.StringIO()
        plan_command(path, DEVICES, overrides=overrides, out=text, profile_store=args.profile_store)  # its text
        recommended, candidates = considered_plans(path, DEVICES, overrides=overrides,
                                                   profile_store=args.profile_store)
        cfg, _ = load_config_for_planning(path, overrides)
        cfg.train.steps = 1000
        cfg.data.val = None
        cfg.metrics.progress = cfg.metrics.tensorboard = False
        cfg.train.eval_every = 0
        cfg.checkpoint.every = 0
        runs = [(label, choice, apply_layout_choice(cfg, choice, units)) for label, choice, units in candidates]
        measured: dict[str, list[float]] = {}
        for nproc in sorted({choice.devices_used for _, choice, _ in runs}):
            group = [r for r in runs if r[1].devices_used == nproc]
            for (label, _, _), times in zip(group, run_plans([r[2] for r in group], nproc, folder, args.steps,
                                                              args.warmup, args.timeout)):
                measured[label] = times
        rows = []
        for label, choice, _ in runs:
            times = measured[label]
            median = statistics.median(times) if times else float("nan")
            rows.append(Row(label, choice.iteration_s, median, _same_plan(choice, recommended)))
            print(f"  {name} {label}: predicted {1e3 * choice.iteration_s:.1f} ms, measured {1e3 * median:.1f} ms "
                  f"({', '.join(f'{1e3 * t:.0f}' for t in times)})", flush=True)
        return rows, text.getvalue()


def _same_plan(a, b) -> bool:
    """The same runnable plan: DP degree, stages (units, ranks) and schedule."""
    def key(c):
        return c.dp, c.schedule, tuple((s.units, s.rank) for s in c.plan.stages)
    return key(a) == key(b)


def table(name: str, rows: list[Row], noise: float) -> tuple[str, bool]:
    """The job's table and whether the recommended plan is within ``noise`` of the fastest measured plan."""
    best = min((r.measured_s for r in rows if r.measured_s == r.measured_s), default=float("nan"))
    lines = [f"{name}: {'plan':<44} {'predicted ms':>12} {'measured ms':>12} {'/ best':>7}"]
    holds = False
    for r in rows:
        ratio = r.measured_s / best if best > 0 else float("nan")
        mark = "  <- recommended" if r.recommended else ""
        lines.append(f"{'':<{len(name) + 1}} {r.label:<44} {1e3 * r.predicted_s:>12.1f} {1e3 * r.measured_s:>12.1f} "
                     f"{ratio:>7.2f}{mark}")
        if r.recommended:
            holds = ratio <= 1 + noise
    lines.append(f"{'':<{len(name) + 1}} recommended plan within {100 * noise:.0f}% of the best measured: "
                 f"{'yes' if holds else 'NO'}")
    return "\n".join(lines), holds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {list(JOBS)}")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--samples", type=int, default=160, help="training records each run processes")
    parser.add_argument("--noise", type=float, default=0.10, help="relative tolerance of 'not slower'")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per torchrun launch")
    parser.add_argument("--profile-store", default="runs/profiles",
                        help="plait profile's store: a job's matching profile is planned with (as plait plan does)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return 0
    start, ok, outputs = time.perf_counter(), True, []
    for name in args.jobs.split(","):
        rows, plan_text = bench_job(name, JOBS[name], args)
        text, holds = table(name, rows, args.noise)
        costs = [line for line in plan_text.splitlines() if "costs:" in line or "no measured profile" in line]
        text = "\n".join([text, *(f"{'':<{len(name) + 1}} {line}" for line in costs)])
        outputs.append(text)
        ok &= holds
    print("\n" + "\n\n".join(outputs))
    print(f"\nplan_holds: {time.perf_counter() - start:.0f} s; every recommendation holds: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
