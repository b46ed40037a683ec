"""The real ``plait`` command matches options by their full name only: an abbreviated flag is refused before
anything is read or removed (argparse's prefix matching ran ``--o`` as ``--overwrite`` and deleted a run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.cli import plait
from tests.helpers.jobs import ROOT


def earlier_run(tmp_path):
    """A job whose run folder holds an earlier run's checkpoint and final model."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "state.bin").write_bytes(b"weights")
    (run / "final").mkdir()
    (run / "final" / "plait_config.json").write_text("{}")
    job = tmp_path / "job.toml"
    job.write_text((ROOT / "configs" / "demo.toml").read_text().replace('"runs/demo"', repr(str(run)).replace("'", '"')))
    return job, run


@pytest.mark.parametrize("flag, full", [("--o", "--overwrite"), ("--over", "--overwrite"),
                                        ("--overwrit", "--overwrite"), ("--resum", "--resume"), ("--re", "--resume")])
def test_an_abbreviated_flag_is_refused_and_the_earlier_run_kept(tmp_path, flag, full):
    job, run = earlier_run(tmp_path)
    out = plait("train", "--config", str(job), flag, "--train.steps=1")
    assert out.returncode == 2, out.stderr
    assert f"unrecognised argument '{flag}'" in out.stderr and full in out.stderr
    assert "full name" in out.stderr
    assert (run / "checkpoints" / "step_000002" / "state.bin").read_bytes() == b"weights"
    assert (run / "final" / "plait_config.json").is_file()


def test_a_misspelt_option_is_named_with_a_suggestion():
    out = plait("train", "--confg", "configs/demo.toml")
    assert out.returncode == 2
    assert "unrecognised argument '--confg'" in out.stderr and "did you mean --config?" in out.stderr
    assert "required" not in out.stderr  # not reported as a missing --config
    launch = plait("launch", "--config", "configs/demo.toml", "--npro", "2")
    assert launch.returncode == 2 and "did you mean --nproc?" in launch.stderr
    gen = plait("generate", "--mod", "runs/demo/final", "--prompt", "hi")
    assert gen.returncode == 2 and "did you mean --model?" in gen.stderr


def test_an_override_without_a_value_is_named():
    out = plait("train", "--config", "configs/demo.toml", "--train.steps", "3")
    assert out.returncode == 2 and "--train.steps=VALUE" in out.stderr


def test_demo_builder_refuses_abbreviations():
    out = subprocess.run([sys.executable, "-m", "plait.data.demo.build", "--ou", "x"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "unrecognized arguments: --ou" in out.stderr


def test_the_earlier_run_message_suggests_commands_with_the_users_overrides(tmp_path):
    job, run = earlier_run(tmp_path)
    elsewhere = tmp_path / "job2.toml"
    elsewhere.write_text(job.read_text().replace(str(run), str(tmp_path / "other")))
    out = plait("train", "--config", str(elsewhere), f"--metrics.run_dir={run}", "--train.steps=1")
    assert out.returncode == 2, out.stderr
    assert f"plait train --config {elsewhere} --metrics.run_dir={run} --train.steps=1 --resume" in out.stderr
    assert f"plait train --config {elsewhere} --metrics.run_dir={run} --train.steps=1 --overwrite" in out.stderr
