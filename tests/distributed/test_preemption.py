"""A stopped run keeps its work: SIGTERM (what torchrun forwards to its workers, a cluster's preemption notice) and
Ctrl-C let the step finish, every rank writes the checkpoint of the same step, the command exits 128 + the signal,
and ``--resume`` continues to exactly the losses of a run that was never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cli import cli_rank, plait_on_ranks
from tests.helpers.demo_runs import SMALL, STEPS, job, losses, start, wait_for_step
from tests.distributed.spawning import free_port


def command(nproc: int, config: Path, *extra: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "plait.cli", "train", "--config", str(config), *SMALL, *extra]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "--master_addr=127.0.0.1", "-m", "plait.cli", "train", "--config", str(config), *SMALL, *extra]


def stop_after_step(cmd: list[str], run: Path, sig: int, step: int,
                    limit_s: float = 240) -> subprocess.CompletedProcess:
    """Run ``cmd``, send ``sig`` once ``run/metrics.jsonl`` shows ``step``, and wait for it to end."""
    proc = start(cmd)
    deadline = time.monotonic() + limit_s
    try:
        if wait_for_step(proc, run, step, deadline):
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []


@pytest.mark.slow
def test_sigterm_under_torchrun_checkpoints_and_resumes_exactly(tmp_path):
    # the uninterrupted run and the resume: the same 2 ranks, forked without torchrun (no launcher, no interpreter
    # start per rank); the stop is what runs under torchrun, which forwards the SIGTERM
    reference = plait_on_ranks(2, "train", "--config", str(job(tmp_path, "ref")), *SMALL, limit_s=240)
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, STEPS + 1))

    stopped_run = tmp_path / "stopped"
    config = job(tmp_path, "stopped")
    stopped = stop_after_step(command(2, config), stopped_run, signal.SIGTERM, 2)
    assert stopped.returncode != 0, "the run ended before the signal: make STEPS larger"
    got = losses(stopped_run)
    last = max(got)
    assert 2 <= last < STEPS, got
    assert checkpoints(stopped_run) == [f"step_{last:06d}"]  # every rank stopped after the same step
    assert not (stopped_run / "final").exists()  # not finished: no final model
    assert "stopped by SIGTERM at step" in stopped.stderr and "continue with --resume" in stopped.stderr

    resumed = plait_on_ranks(2, "train", "--config", str(config), *SMALL, "--resume", limit_s=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = losses(stopped_run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), step
    assert (stopped_run / "final" / "plait_config.json").is_file()


def test_ctrl_c_of_one_process_checkpoints_and_exits_130(tmp_path):
    run_dir = tmp_path / "one"
    stopped = stop_after_step(command(1, job(tmp_path, "one")), run_dir, signal.SIGINT, 1)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = max(losses(run_dir))
    assert last < STEPS and checkpoints(run_dir) == [f"step_{last:06d}"]
    assert "SIGINT received: finishing this step" in stopped.stderr
    assert "stopped by SIGINT at step" in stopped.stderr and not (run_dir / "final").exists()


def late_sigterm_rank(logs: str, *argv: str) -> None:
    """``plait <argv>`` (``cli.cli_rank``) with a SIGTERM arriving while final/ is being written."""
    import plait.commands.train as train

    real = train.save_final

    def save_final(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    train.save_final = save_final
    cli_rank(logs, *argv)


def test_sigterm_while_final_is_written_waits_for_it(tmp_path):
    run_dir = tmp_path / "late"
    args = command(1, job(tmp_path, "late"))[3:]  # the arguments after `python -m plait.cli`
    done = plait_on_ranks(1, *args, limit_s=240, entry="tests.distributed.test_preemption:late_sigterm_rank")
    assert done.returncode == 0, done.stderr[-3000:]  # the run finished: its final model is whole
    assert "SIGTERM received: finishing the final model" in done.stderr
    assert (run_dir / "final" / "plait_config.json").is_file() and (run_dir / "final" / "tokenizer").is_dir()
    assert not (run_dir / "plait.lock").exists()  # the lock released, not left stale
