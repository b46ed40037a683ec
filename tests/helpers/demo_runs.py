"""The demo job as a real command line (``python -m plait.cli train`` or under ``torch.distributed.run``): the job
file on a few records, the short-run flags, running and stopping it, and reading its losses. Shared by the
preemption and multi-node tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.jobs import ROOT, demo_records, write_jsonl

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


def small(steps: int = STEPS) -> list[str]:
    """Overrides of a short run: ``steps`` steps of 4 samples, no validation, no periodic checkpoint, one thread."""
    return [f"--train.steps={steps}", "--train.global_batch_size=4", "--train.microbatch_size=2", "--data.val=",
            "--train.eval_every=0", "--checkpoint.every=0", "--metrics.progress=false", "--train.threads=1",
            "--train.warmup_steps=2"]


SMALL = small()


def losses(run: Path) -> dict[int, float]:
    """Step -> loss of the run in folder ``run`` (the last row of a step written twice)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def env() -> dict[str, str]:
    """The environment of a launched command: this checkout importable, one OpenMP thread."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def run(cmd: list[str], limit_s: float = 240) -> subprocess.CompletedProcess:
    """``cmd`` to its end (``limit_s`` seconds at most), from the repository root."""
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=limit_s, cwd=ROOT)


def start(cmd: list[str]) -> subprocess.Popen:
    """``cmd`` started from the repository root, its output piped as text."""
    return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def wait_for_step(proc: subprocess.Popen, run: Path, step: int, deadline: float) -> bool:
    """Poll ``run/metrics.jsonl`` until it shows ``step`` (True) or ``proc`` ends or ``deadline`` (monotonic) passes
    (False)."""
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and max(losses(run), default=0) >= step:
            return True
        time.sleep(0.05)
    return False




PYTHON_M_TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
"""The torchrun launcher of this interpreter (``torchrun`` itself may not be on PATH)."""
