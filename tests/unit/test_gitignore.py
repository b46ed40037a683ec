"""What runs write into the repository (training runs, profiles, plans, simulated timelines, bench figures, a
scratch folder) is git-ignored, and the sources are not."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.jobs import ROOT

IGNORED = ["runs/demo/metrics.jsonl", "runs/profiles/profile-abc.json", "runs/demo/energy/frontier.png",
           "runs/sim_vs_measured/1f1b.png", "scratch/notes.txt", "scratch/run/metrics.jsonl", "sim/timeline.json",
           "models/my-llava/config.json", "imported/llava15/job.toml", "plan.json", "profile.json", "loss.png",
           "trace.prof", "tests/unit/runs/test/metrics.jsonl"]
KEPT = ["plait/models/new_family.py", "plait/cli.py", "data/demo/img/new.png", "configs/new.toml", "bench/new.py",
        "tests/unit/test_new.py", "docs/guide.md"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and a git checkout")


def _ignored(paths: list[str]) -> set[str]:
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr  # 1: none ignored
    return set(done.stdout.split())


def test_run_outputs_are_ignored():
    assert _ignored(IGNORED) == set(IGNORED)


def test_sources_are_not_ignored():
    assert _ignored(KEPT) == set()
