"""Command line: ``plait train --config configs/demo.toml [--section.key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

__all__ = ["main"]


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch.distributed as dist

    from plait.config.loader import load_config
    from plait.train.plots import plot_loss_curve
    from plait.train.trainer import Trainer

    cfg = load_config(args.config, overrides)
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
        print(f"plait: trained {result['steps']} steps; loss curve {png}; model {final}")
        if result.get("timeline"):
            print(f"plait: pipeline timeline of the last step {result['timeline']} (Chrome trace; open in "
                  f"https://ui.perfetto.dev) and {result['timeline'].with_suffix('.png')}")
        for task, acc in result["eval"].items():
            print(f"plait: validation exact match {task}: {acc:.1%}")
    if dist.is_initialized():  # a clean shutdown: gloo's worker threads must not outlive the interpreter
        dist.destroy_process_group()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="plait", description="Train multimodal LLMs composed of Hugging Face parts.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a job (single process, or under torchrun for DP/CP/PP)")
    train.add_argument("--config", required=True, help="TOML job file, e.g. configs/demo.toml")
    train.add_argument("--resume", nargs="?", const=True, default=False,
                       help="resume from the newest checkpoint of the run (or from the given directory)")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --train.lr=1e-3")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return _train(args, rest)
    except (ValueError, FileNotFoundError) as exc:
        print(f"plait: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
