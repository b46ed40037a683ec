"""Data-parallel scaling: tokens/s of 2 processes vs 1 on the demo, DDP-style vs FSDP2 (vs HSDP where it fits).

Each configuration trains the demo job (``configs/demo.toml``, one intra-op thread per process) under torchrun on
the first ``--samples`` training records with a fixed per-rank batch (``--per-rank`` samples in two microbatches:
weak scaling, so ideal scaling is N x the one-process tokens/s):

- ``single``: one process (the reference);
- ``ddp``: ``parallel.dp = 2`` (full replicas; ``data_parallel.GradientReducer``: the backward accumulates into
  25 MiB gradient buckets, the LLM's all-reduced asynchronously as the last LLM backward finishes them, the
  encoders' after the deferred encoder backwards, all awaited before the optimizer);
- ``ddp_sync``: the same with the gradients flattened into one bucket after the last backward, all-reduced and
  copied back (``sum_gradients``: no overlap, no views), only with ``--sync`` (what the reducer gains, in the same
  interleaved rounds);
- ``fsdp2``: ``parallel.dp_shard = 2`` (FSDP2 per pipeline unit: parameters all-gathered per unit, gradients
  reduce-scattered as each unit's backward ends, overlapping the rest of the backward);
- ``fsdp2_kept``: the same with ``parallel.fsdp_reshard = "after_backward"`` (each unit's gathered parameters kept
  from its forward to its backward: one all-gather per unit per microbatch instead of two);
- ``hsdp``: ``parallel.dp = 2, dp_shard = 2`` (4 processes), only with ``--hsdp`` (it needs 4 cores to mean
  anything).

Runs are interleaved (``--rounds`` rounds, the configuration order rotated every round, so a change in machine load
hits every configuration alike). Every configuration times the same samples: after one warm-up step, the next
``--steps`` x ``--per-rank`` x (the largest process count run) records of the epoch order, in steps of its own
global batch (``--per-rank`` x processes), so one process takes N times as many steps as N processes over the same
work (comparing different samples would mix the modalities' costs into the ratio). A run's tokens/s is those
samples' tokens over the sum of its step times. The table gives per configuration the median over rounds of
tokens/s and the ratio to ideal scaling (``tokens/s / (N x single's)``). Read the spread across rounds too.

Run: ``.venv/bin/python bench/dp_scaling.py [--rounds 3] [--steps 6] [--per-rank 8] [--hsdp] [--sync]`` (about 4 minutes
on the 2-core CPU with the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIGS = {"single": (1, {}), "ddp": (2, {"dp": 2}), "ddp_sync": (2, {"dp": 2}), "fsdp2": (2, {"dp_shard": 2}),
           "fsdp2_kept": (2, {"dp_shard": 2, "fsdp_reshard": "after_backward"}),
           "hsdp": (4, {"dp": 2, "dp_shard": 2})}
"""name -> (processes, ``[parallel]`` degrees)."""


def worker(args: argparse.Namespace) -> None:
    """One run (inside torchrun): build the trainer, one warm-up step, then the timed records (module docstring) in
    steps of this configuration's global batch; rank 0 prints ``{"tokens_per_s", "step_s"}`` (tokens over the summed
    step seconds, the median step) as JSON on its last line."""
    import torch.distributed as dist

    from plait.config.loader import load_config
    from plait.parallel.grad_sync import SumSync
    from plait.train.trainer import Trainer

    procs, parallel = CONFIGS[args.worker]
    batch = args.per_rank * procs
    timed = args.steps * args.per_rank * args.max_procs  # the same records for every configuration
    overrides = [f"--train.global_batch_size={batch}", f"--train.microbatch_size={max(1, args.per_rank // 2)}",
                 "--train.steps=1000", "--train.threads=1", f"--metrics.run_dir={args.folder}/run_{args.worker}",
                 "--metrics.progress=false", *[f"--parallel.{k}={v}" for k, v in parallel.items()]]
    cfg = load_config(ROOT / "configs" / "demo.toml", overrides)
    cfg.data.val = None
    cfg.data.train = str(Path(args.folder) / "train.jsonl")
    trainer = Trainer.build(cfg)
    if args.worker == "ddp_sync":  # no GradientReducer: the trainer sums every gradient after the last backward
        trainer.sync = SumSync([p for _, p in trainer.model.trainable_parameters()])
    order = trainer.loader.epoch_order(0).tolist()
    times, tokens = [], []
    warm = args.per_rank * args.max_procs  # the first step warms up on records no configuration times
    for k in range(-1, timed // batch):
        indices = [order[(warm + k * batch + i) % len(order)] for i in range(batch)]
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        res = trainer.train_step(indices)
        if k >= 0:
            times.append(time.perf_counter() - start)
            tokens.append(res.tokens)
    if trainer.info.is_main:
        print(json.dumps({"tokens_per_s": sum(tokens) / sum(times), "step_s": statistics.median(times)}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(name: str, args: argparse.Namespace, folder: Path, port: int) -> dict:
    """Run configuration ``name`` under torchrun; returns rank 0's JSON line."""
    procs = CONFIGS[name][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}",
           "--master_addr=127.0.0.1", str(Path(__file__).resolve()), "--worker", name, "--folder", str(folder),
           "--steps", str(args.steps), "--per-rank", str(args.per_rank), "--max-procs", str(args.max_procs)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--per-rank", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=64, help="training records used")
    parser.add_argument("--hsdp", action="store_true", help="also HSDP 2x2 (4 processes)")
    parser.add_argument("--sync", action="store_true", help="also DDP with the all-reduce after the backward")
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="run just these configurations (single "
                        "is always run: it is the reference)")
    parser.add_argument("--max-procs", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from bench.plan_holds import small_train_set
    from tests.distributed.spawning import free_port

    names = (["single", "ddp"] + (["ddp_sync"] if args.sync else []) + ["fsdp2", "fsdp2_kept"]
             + (["hsdp"] if args.hsdp else []))
    if args.only:
        names = ["single"] + [n for n in CONFIGS if n in args.only and n != "single"]
    args.max_procs = max(CONFIGS[n][0] for n in names)
    results: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small_train_set(ROOT / "data" / "demo" / "train.jsonl", args.samples, folder)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                results[name].append(launch(name, args, folder, free_port())["tokens_per_s"])
                print(f"round {r + 1}: {name:10s} {results[name][-1]:9.0f} tokens/s", flush=True)
    base = statistics.median(results["single"])
    print(f"\ndemo, {args.per_rank} samples per rank per step, the records of {args.steps} timed steps of "
          f"{args.max_procs} processes in every configuration, {args.rounds} interleaved rounds (median; min-max)")
    print(f"{'config':10s} {'procs':>5s} {'tokens/s':>10s} {'min-max':>15s} {'ideal':>7s}")
    for name in names:
        procs, vals = CONFIGS[name][0], results[name]
        ratio = statistics.median(vals) / (procs * base)
        print(f"{name:10s} {procs:5d} {statistics.median(vals):10.0f} {min(vals):7.0f}-{max(vals):<7.0f} "
              f"{ratio:7.2f}")


if __name__ == "__main__":
    main()
