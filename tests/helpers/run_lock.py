"""Helpers of several test modules, taken from tests/unit/train/test_run_lock.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
# holds the lock of argv[1] until its stdin closes, then releases it (argv[2] == "release") or just exits
HOLDER = ("import sys\nfrom plait.train.run_lock import acquire_run_lock, release_run_lock\n"
          "acquire_run_lock(sys.argv[1])\nprint('held', flush=True)\nsys.stdin.read()\n"
          "if sys.argv[2] == 'release':\n    release_run_lock(sys.argv[1])\n")


def start_holder(run: Path, then: str = "release") -> subprocess.Popen:
    """A second process holding ``run``'s lock (it has taken it when this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), then], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop_holder(proc: subprocess.Popen) -> int:
    """Close the holder's stdin (it then ends as told) and return its exit status."""
    if proc.poll() is None:
        proc.stdin.close()
    rc = proc.wait(timeout=60)
    proc.stdout.close()
    return rc
