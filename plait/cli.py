"""Command line.

``plait train --config configs/demo.toml [--section.key=value ...] [--resume]``: train a job.
``plait plan --config configs/demo.toml --devices 8 [--out plan.json]``: choose a layout and partition with
the analytic, frozen-aware cost model and print it.
``plait simulate --plan plan.json --out-dir DIR``: the predicted timeline of a plan (Chrome trace + PNG).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

__all__ = ["main"]


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch.distributed as dist

    from plait.config.loader import load_config
    from plait.train.plots import plot_loss_curve
    from plait.train.trainer import Trainer

    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as exc:
        exc.same_on_every_rank = True  # type: ignore[attr-defined]  # every rank reads the same file
        raise
    if cfg.parallel.pp.degree > 1:
        from plait.train.pipeline_trainer import PipelineTrainer

        trainer: Trainer = PipelineTrainer(cfg)
    else:
        trainer = Trainer(cfg)
    result = trainer.fit(resume=args.resume)
    if trainer.info.is_main:
        png = plot_loss_curve(trainer.run_dir / "metrics.jsonl", trainer.run_dir / "loss.png")
        final = trainer.run_dir / "final"
        trainer.full_model().save_pretrained(final)  # under PP: assembled on rank 0 from the last checkpoint
        trainer.tokenizer.save_pretrained(final / "tokenizer")
        for spec in trainer.processor.specs.values():
            spec.hf_processor.save_pretrained(final / "processors" / spec.encoder)
        print(f"plait: trained {result['steps']} steps; loss curve {png}; model {final}")
        if result.get("timeline"):
            print(f"plait: pipeline timeline of the last step {result['timeline']} (Chrome trace; open in "
                  f"https://ui.perfetto.dev) and {result['timeline'].with_suffix('.png')}")
        for task, acc in result["eval"].items():
            print(f"plait: validation exact match {task}: {acc:.1%}")
    if dist.is_initialized():  # a clean shutdown: gloo's worker threads must not outlive the interpreter
        dist.destroy_process_group()
    return 0


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.planner.plan_cli import plan_command

    plan_command(args.config, args.devices, args.out, overrides=overrides, device=args.device,
                 microbatches=args.microbatches, frozen_aware=not args.frozen_unaware)
    return 0


def _simulate(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.planner.plan_cli import simulate_command

    if overrides:
        raise ValueError(f"plait simulate takes no overrides, got {overrides}")
    paths = simulate_command(args.plan, args.out_dir)
    print(f"plait: predicted timeline {paths['trace']} (Chrome trace) and {paths['png']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="plait", description="Train multimodal LLMs composed of Hugging Face parts.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a job (single process, or under torchrun for DP/CP/PP)")
    train.add_argument("--config", required=True, help="TOML job file, e.g. configs/demo.toml")
    train.add_argument("--resume", nargs="?", const=True, default=False,
                       help="resume from the newest checkpoint of the run (or from the given directory)")
    plan = sub.add_parser("plan", help="choose a pipeline layout/partition for N devices (analytic costs)")
    plan.add_argument("--config", required=True, help="TOML job file (its [model] section is planned)")
    plan.add_argument("--devices", type=int, required=True, help="number of GPUs to plan for")
    plan.add_argument("--out", default=None, help="write the chosen plan as JSON here")
    plan.add_argument("--device", default="h100", help="device preset: h100, h200, a100 or cpu")
    plan.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: from the job)")
    plan.add_argument("--frozen-unaware", action="store_true", help="plan with backward = 2x forward everywhere")
    simulate = sub.add_parser("simulate", help="predicted timeline (Chrome trace + PNG) of a plan JSON")
    simulate.add_argument("--plan", required=True, help="plan JSON written by `plait plan --out`")
    simulate.add_argument("--out-dir", required=True, help="folder for timeline.json and timeline.png")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --train.lr=1e-3")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bars per checkpoint/final save
    try:
        return {"train": _train, "plan": _plan, "simulate": _simulate}[args.command](args, rest)
    except (ValueError, FileNotFoundError) as exc:
        _report_error(exc)
        return 2


def _report_error(exc: Exception) -> None:
    """Print ``exc`` as one ``plait: error:`` line. Under torchrun an error every rank hits alike (a bad config)
    is printed by rank 0 only; any other error names the rank that raised it."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and getattr(exc, "same_on_every_rank", False):
        if rank == 0:
            print(f"plait: error: {exc}", file=sys.stderr)
        return
    where = f" (rank {rank} of {world})" if world > 1 else ""
    print(f"plait: error{where}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
