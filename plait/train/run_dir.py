"""A run's folder (``metrics.run_dir``): what an earlier run left in it, and the guard that keeps a new run from
removing it (the lock that keeps two live runs out of one folder is :mod:`plait.train.run_lock`). The default
folder, ``runs/<job file name>``, is set by ``plait.config.loader.read_config_data``."""

from __future__ import annotations

from pathlib import Path

from plait.train.checkpoint import latest_checkpoint

__all__ = ["check_new_run", "earlier_run", "no_checkpoint_message"]


def earlier_run(run_dir: str | Path) -> list[str]:
    """What an earlier run left in ``run_dir`` that a new run would remove or replace: its checkpoints (naming the
    newest) and its final model (``final/``); ``[]`` when there is none."""
    run_dir = Path(run_dir)
    found = []
    newest = latest_checkpoint(run_dir)
    if newest is not None:
        count = sum(1 for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
        found.append(f"{count} checkpoint(s), newest {newest.name}")
    if (run_dir / "final").is_dir():
        found.append("a final model (final/)")
    return found


def check_new_run(run_dir: str | Path) -> None:
    """Refuse to start a new run in a folder holding an earlier run's checkpoints or final model.

    Raises:
        ValueError: naming the folder, what it holds, and how to continue (``--resume``), replace
            (``--overwrite``) or go elsewhere (``--metrics.run_dir``).
    """
    found = earlier_run(run_dir)
    if found:
        raise ValueError(
            f"{run_dir} holds an earlier run ({'; '.join(found)}), which a new run would remove: continue it with "
            "`plait train --config JOB --resume` (longer: add --train.steps=N), replace it with `plait train "
            f"--config JOB --overwrite`, or write this run elsewhere with --metrics.run_dir=DIR (in Python: "
            "Trainer.fit(resume=True) or fit(overwrite=True))")


def no_checkpoint_message(run_dir: str | Path) -> str:
    """Why ``--resume`` cannot continue the run in ``run_dir`` (it has no checkpoint under ``checkpoints/``) and
    what to do instead: name the folder, what it holds (a final model, metrics) and the commands that start a new
    run there or resume from a checkpoint elsewhere."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        held = "the folder does not exist"
    else:
        parts = [what for what, name in (("a final model (final/)", "final"), ("metrics.jsonl", "metrics.jsonl"))
                 if (run_dir / name).exists()]
        held = f"the folder holds {' and '.join(parts)} but no checkpoint" if parts else "it holds no checkpoint"
    return (f"no checkpoint to resume from under {run_dir / 'checkpoints'} ({held}; checkpoints are written every "
            "checkpoint.every steps and at the end of a run): start a new run with `plait train --config JOB` "
            "(add --overwrite to replace what the folder holds), or resume from a checkpoint directory with "
            "--resume=DIR")
