"""Command line: ``plait train --config configs/demo.toml [--section.key=value ...] [--resume]``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

__all__ = ["main"]


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from plait.config.loader import load_config
    from plait.train.plots import plot_loss_curve
    from plait.train.trainer import Trainer

    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg)
    result = trainer.fit(resume=args.resume)
    if trainer.info.is_main:
        png = plot_loss_curve(trainer.run_dir / "metrics.jsonl", trainer.run_dir / "loss.png")
        final = trainer.run_dir / "final"
        trainer.model.save_pretrained(final)
        print(f"plait: trained {result['steps']} steps; loss curve {png}; model {final}")
        for task, acc in result["eval"].items():
            print(f"plait: validation exact match {task}: {acc:.1%}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="plait", description="Train multimodal LLMs composed of Hugging Face parts.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a job (single process, or under torchrun for DP)")
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
