"""What a training run does before its first step, on the main rank: refuse or clear an earlier run in its run
folder (:func:`clear_earlier_run`) and report its setup (:func:`report_setup`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from plait.parallel.process_group import node_layout
from plait.train.checkpoint import CheckpointLayout, latest_checkpoint, remove_checkpoints
from plait.train.run_dir import check_new_run, earlier_run

__all__ = ["clear_earlier_run", "fsdp_description", "launch_logs", "layout_description", "nothing_to_train",
           "report_setup", "say"]

log = logging.getLogger("plait.train.trainer")


class _Stdout(logging.Handler):
    """Writes a record's message as one line to the current ``sys.stdout`` (looked up per record, so a replaced
    stream, e.g. a test's capture, receives it), flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


user = logging.getLogger("plait.user")
"""The run's user-facing summary lines (setup, resume, reconfiguration): INFO records written to standard output
as they are, whatever the root logger's configuration (not propagated)."""
if not user.handlers:
    user.addHandler(_Stdout())
    user.setLevel(logging.INFO)
    user.propagate = False


def say(line: str) -> None:
    """Log ``line`` to the user (:data:`user`: standard output)."""
    user.info(line)


def elastic_restart(run_dir: str | Path, resume: bool | str, overwrite: bool) -> tuple[bool | str, bool]:
    """``(resume, overwrite)`` of a job that ``torchrun --max-restarts`` restarted after a failure
    (``TORCHELASTIC_RESTART_COUNT`` > 0): resume from the newest complete checkpoint of ``run_dir`` (a checkpoint is
    complete once DCP wrote its ``.metadata``; a partial one is never taken), with the data order it recorded, and
    overwrite nothing; without one yet (the failure came before the first checkpoint) the flags as given (the run
    starts again). Unchanged outside a restart. Says what it does on rank 0."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart < 1:
        return resume, overwrite
    newest = latest_checkpoint(run_dir)
    main = os.environ.get("RANK", "0") == "0"
    if newest is None:
        if main:
            say(f"plait: torchrun restart {restart}: no complete checkpoint in {run_dir} yet, starting again")
        return resume, overwrite
    if main:
        say(f"plait: torchrun restart {restart}: resuming from {newest}, the newest complete checkpoint")
    return True, False


def launch_logs(run_dir: Path) -> list[Path]:
    """What an earlier ``plait launch`` left under ``<run_dir>/resilient``: its per-worker logs
    (``worker<id>.jsonl``) and final parameters (``final-worker<id>.pt``); its plan (``launch.json``), which the next
    launch replaces, is not counted."""
    out = Path(run_dir) / "resilient"
    return sorted(out.glob("worker*.jsonl")) + sorted(out.glob("final-worker*.pt"))


def clear_earlier_run(run_dir: Path, is_main: bool, world_size: int, overwrite: bool = False) -> None:
    """A new run into ``run_dir`` holding an earlier run's checkpoints or final model: refused
    (:func:`~plait.train.run_dir.check_new_run`, on every rank alike) unless ``overwrite``; then the main rank removes
    them together with an earlier launch's logs (:func:`launch_logs`) and warns saying how many, so a later
    ``--resume`` can only find this run's and no log of the old run is left beside the new one; every rank waits.

    Raises:
        ValueError: without ``overwrite``, naming the folder and how to resume or overwrite.
    """
    if not overwrite:
        check_new_run(run_dir)
    elif is_main:
        newest, final = latest_checkpoint(run_dir), run_dir / "final"
        held = earlier_run(run_dir)
        removed, logs = remove_checkpoints(run_dir), launch_logs(run_dir)
        if final.is_dir():
            shutil.rmtree(final)
        for old in (*logs, Path(run_dir) / "resilient" / "launch.json"):
            old.unlink(missing_ok=True)
        if held or logs:
            log.warning("%s already holds %s: removed its %d checkpoint(s)%s%s%s; this new run also "
                        "overwrites its metrics (--overwrite; use --resume to continue it instead)", run_dir,
                        "checkpoints of an earlier run" if held else "an earlier launch's logs",
                        removed, f" (newest {newest.name})" if newest else "",
                        " and its final model" if "a final model (final/)" in held else "",
                        f" and its {len(logs)} launch log file(s) (resilient/)" if logs else "")
    if dist.is_initialized() and world_size > 1:
        dist.barrier()


def nothing_to_train(resumed: int, total_steps: int, train: Any) -> str:
    """What a resumed run whose checkpoint (step ``resumed``) is at or past its length (``total_steps``, from
    ``train``: the job's ``TrainConfig``, ``steps`` or ``epochs``) says, and how to train on."""
    goal = f"train.steps = {train.steps}" if train.steps else f"train.epochs = {train.epochs} ({total_steps} steps)"
    if resumed == total_steps:
        return f"nothing to train: checkpoint is at step {resumed}, {goal} (longer: --train.steps=N above {resumed})"
    return (f"checkpoint at step {resumed} is past {goal}: nothing to train (train.steps counts from the run's "
            f"start, not from the checkpoint: {total_steps} more steps is --train.steps={resumed + total_steps})")


def layout_description(dims: Any) -> str:
    """A job's degrees in one phrase, e.g. ``DP 2 x PP 1 x CP 1 x TP 2; DP = 1 replica(s) x FSDP2 dp_shard 2`` (``dims``: its
    ``plait.parallel.dims.ParallelDims``; DP counts every data-parallel rank, replicas x shards; TP and the FSDP2
    shard degree only when above 1; EP when above 1), the form of the checkpoint layouts' ``describe``."""
    phrase = CheckpointLayout(world_size=dims.world_size, dp=dims.batch, pp=dims.pp, cp=dims.cp, tp=dims.tp,
                              dp_shard=dims.dp_shard).describe().split(" (", 1)[1][:-1]
    ep = int(getattr(dims, "ep", 1))
    return phrase + (f"; EP {ep} (each MoE layer's experts split over {ep} of the DP ranks)" if ep > 1 else "")


def fsdp_description(sharded: Any, pipeline: bool = False) -> str:
    """How FSDP2 runs, e.g. ``fsdp_reshard after_backward, offload cpu`` (``sharded``: the trainer's
    ``plait.parallel.fsdp.ShardedModel``, its ``reshard_after_forward`` and ``offload``, which
    ``parallel.fsdp_reshard`` and ``parallel.offload`` set; ``""`` for None: no FSDP2). Under pipeline stages
    (``pipeline``) each stage's parameters are gathered once per step whatever ``fsdp_reshard`` says, and said so."""
    if sharded is None:
        return ""
    reshard = ("parameters gathered once per step (pipeline stages)" if pipeline
               else f"fsdp_reshard {'after_forward' if sharded.reshard_after_forward else 'after_backward'}")
    return f"{reshard}, offload {'cpu' if sharded.offload else 'none'}"


def report_setup(run_dir: Path, config: dict[str, Any], counts: tuple[int, int], sets: Sequence[tuple[str, Any]],
                 total_steps: int, world_size: int, destinations: Sequence[str], dims: Any = None,
                 fsdp: str = "", extra: str | None = None) -> None:
    """Write ``config.json`` (the job ``config``) to ``run_dir``, print the data (``sets``: ``(name, dataset)``,
    train first), steps, the world size with the layout's degrees (``dims``, :func:`layout_description`) and how
    FSDP2 runs (``fsdp``, :func:`fsdp_description`), ``counts`` = (trainable, all) parameters and the run folder
    with where the metrics go (``destinations``) and ``extra`` (a step runner's own line, e.g. the pipeline), log
    skipped records. Call on the main rank."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    n_train, n_all = counts
    log.info("model: %.2fM parameters, %.2fM trainable", n_all / 1e6, n_train / 1e6)
    for name, ds in sets:
        if ds.skipped:
            log.warning("%s: skipped %d bad record(s), e.g. %s", name, len(ds.skipped), ds.skipped[0].reason)
    train = sets[0][1]
    n_val = len(sets[1][1]) if len(sets) > 1 else 0
    layout = f" ({'; '.join(x for x in (layout_description(dims), fsdp) if x)})" if dims is not None else ""
    nodes = node_layout()
    where = f" on {nodes.describe()}" if nodes.nodes > 1 else ""
    if dims is not None and dims.rank_order != "dp_outer":
        where += f", ranks numbered {dims.rank_order}"
    say(f"plait: {len(train)} train samples ({len(train.skipped)} skipped), {n_val} val samples, {total_steps} "
        f"steps, world size {world_size}{where}{layout}, {n_train / 1e6:.2f}M of {n_all / 1e6:.2f}M parameters "
        "trainable")
    say(f"plait: run folder {run_dir} (metrics to {', '.join(destinations)}; checkpoints/, final/)")
    if extra:
        say(extra)
