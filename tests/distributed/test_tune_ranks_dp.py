"""A ``plait tune-ranks`` calibration run under torchrun (``--nproc 2``: DP = 2, gloo) measures what the same run in
one process measures: the same logged losses (rel 1e-5), hence the same convergence time, and the same validation
loss."""

from __future__ import annotations

import pytest

from plait.commands.train import train_command
from plait.commands.tune_ranks import SearchSettings, run_calibration, subset_records
from plait.config.loader import load_config
from plait.planner.ranks.types import CalibrationRun
from plait.train.metrics import read_metrics
from tests.helpers.cli_tune_ranks import tune_job


def test_calibration_run_under_torchrun_matches_one_process(tmp_path):
    job = tune_job(tmp_path)
    cfg = load_config(job, ["--train.microbatch_size=2", "--parallel.timeout_s=60"])
    records = subset_records(cfg.data.train, cfg.train.seed)
    run = CalibrationRun("llm", 4, 16, 4, 4)
    one = run_calibration(cfg, run, records, tmp_path / "one", SearchSettings(val_samples=4), train_command)
    two = run_calibration(cfg, run, records, tmp_path / "two", SearchSettings(val_samples=4, nproc=2))
    losses = [[r["loss"] for r in read_metrics(d / "runs" / run.name / "metrics.jsonl") if "loss" in r]
              for d in (tmp_path / "one", tmp_path / "two")]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert two.observation.convergence == one.observation.convergence
    assert two.observation.val_loss == pytest.approx(one.observation.val_loss, rel=1e-5)
    assert not one.resumed and not two.resumed and two.cpu_s > 0
