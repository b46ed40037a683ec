"""``plait launch`` as the launch tests run it (tests/distributed/test_launch_resilient.py, test_launch_fsdp.py): one
launch on this machine's CPU to its end, and the per-step records its workers wrote. A test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LIMIT_S = 600
"""A hang guard per launch (about 30 s on an idle 2-core machine, minutes when loaded)."""


def launch(config: Path, nproc: int, pipelines: str, *flags: str) -> subprocess.CompletedProcess:
    """``plait launch --config CONFIG --nproc NPROC --pipelines PIPELINES`` with ``flags`` (faults: ``--kill W:S``,
    ``--rejoin W:S``), a 10 s collective timeout, planned for the CPU preset (the re-instantiations the tests assert
    are the planner's choice for its costs; the default, this host's CPU measured, varies with the machine and its
    load), to its end: its exit code and output (the launcher's and its workers'); ``subprocess.TimeoutExpired``
    after :data:`LIMIT_S` seconds."""
    cmd = [sys.executable, "-m", "plait.cli", "launch", "--config", str(config), "--nproc", str(nproc), "--pipelines",
           pipelines, "--timeout", "10", "--device", "cpu", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S)


def worker_records(run_dir: Path) -> tuple[dict[int, dict], list[dict]]:
    """A launch's worker logs (``run_dir/resilient/worker*.jsonl``): per step, one worker's record (asserting that
    every worker's agrees on its loss, 1e-6, and samples); and the events (reconfigurations, rejoins), in worker
    order."""
    steps, events = {}, []
    for path in sorted((run_dir / "resilient").glob("worker*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "event" in rec:
                events.append(rec)
                continue
            if rec["step"] in steps:
                assert abs(steps[rec["step"]]["loss"] - rec["loss"]) < 1e-6, (path, rec["step"])
                assert steps[rec["step"]]["samples"] == rec["samples"]
            steps.setdefault(rec["step"], rec)
    return steps, events
