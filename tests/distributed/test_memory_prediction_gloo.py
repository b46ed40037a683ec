"""The planner's per-rank memory (``planner.sharding.rank_memory``) within 15% of ``bench/memory.py``'s bytes measured
from real storages under torchrun (gloo): tensor parallelism and FSDP2 over 2 ranks (issue 14, acceptance)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.memory import KINDS, job_config, predicted, run_column
from bench.plan_holds import small_train_set
from plait.train.trainer import Trainer
from tests.conftest import ROOT


@pytest.mark.parametrize("label", ["TP 2", "FSDP2 2"])
def test_planner_within_15_percent_of_measured_per_rank(label):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train = small_train_set(ROOT / "data" / "demo" / "train.jsonl", 8, folder)
        got = run_column("demo", label, "none", 4, folder, train)
        assert isinstance(got, dict), got
        one = Trainer.build(job_config("demo", 1, 1, "none", 4, str(train), str(folder / "one")))
        pred = predicted(one, label, got["rank_llm_tokens"])
    for kind in KINDS:
        assert pred[kind] == pytest.approx(got[kind], rel=0.15), kind
    assert sum(pred.values()) == pytest.approx(sum(got[k] for k in KINDS), rel=0.15)
