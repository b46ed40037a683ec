"""A stopped run keeps its work: SIGTERM (what torchrun forwards to its workers, a cluster's preemption notice) and
Ctrl-C let the step finish, every rank writes the checkpoint of the same step, the command exits 128 + the signal,
and ``--resume`` continues to exactly the losses of a run that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import ROOT, demo_records, write_jsonl
from tests.distributed.spawning import free_port

STEPS = 14


def job(tmp_path: Path, name: str) -> Path:
    """The demo job on 16 training records, no validation, a checkpoint only at the end (or when stopped)."""
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", limit=16))
    text = (ROOT / "configs" / "demo.toml").read_text()
    for old, new in (('"data/demo/train.jsonl"', train), ('"data/demo/tokenizer"', ROOT / "data/demo/tokenizer"),
                     ('"runs/demo"', tmp_path / name)):
        text = text.replace(old, json.dumps(str(new)))
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


SMALL = [f"--train.steps={STEPS}", "--train.global_batch_size=4", "--train.microbatch_size=2", "--data.val=",
         "--train.eval_every=0", "--checkpoint.every=0", "--metrics.progress=false", "--train.threads=1",
         "--train.warmup_steps=2"]


def command(nproc: int, config: Path, *extra: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "plait.cli", "train", "--config", str(config), *SMALL, *extra]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            "--master_addr=127.0.0.1", "-m", "plait.cli", "train", "--config", str(config), *SMALL, *extra]


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stop_after_step(cmd: list[str], run: Path, sig: int, step: int,
                    limit_s: float = 240) -> subprocess.CompletedProcess:
    """Run ``cmd``, send ``sig`` once ``run/metrics.jsonl`` shows ``step``, and wait for it to end."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and max(losses(run), default=0) >= step:
                proc.send_signal(sig)
                break
            time.sleep(0.05)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []


@pytest.mark.slow
def test_sigterm_under_torchrun_checkpoints_and_resumes_exactly(tmp_path):
    reference = run(command(2, job(tmp_path, "ref")))
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

    resumed = run(command(2, config, "--resume"))
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


LATE_SIGTERM = """
import os, signal, sys
import plait.commands.train as train
real = train.save_final
def save_final(*args, **kwargs):  # SIGTERM arrives while final/ is being written
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
train.save_final = save_final
from plait.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_final_is_written_waits_for_it(tmp_path):
    run_dir = tmp_path / "late"
    args = command(1, job(tmp_path, "late"))[3:]  # the arguments after `python -m plait.cli`
    done = run([sys.executable, "-c", LATE_SIGTERM, *args])
    assert done.returncode == 0, done.stderr[-3000:]  # the run finished: its final model is whole
    assert "SIGTERM received: finishing the final model" in done.stderr
    assert (run_dir / "final" / "plait_config.json").is_file() and (run_dir / "final" / "tokenizer").is_dir()
    assert not (run_dir / "plait.lock").exists()  # the lock released, not left stale
