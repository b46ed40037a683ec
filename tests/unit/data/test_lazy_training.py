"""Lazy loading in training: the same batches and losses as the eager path (every sample processed up front),
bit for bit; an exact mid-epoch resume; the loader wait in metrics.jsonl."""

from __future__ import annotations

import json
import os

import pytest

from plait.data.sources import SampleError
from plait.train.trainer import Trainer
from tests.helpers.jobs import DEMO, demo_records
from tests.unit.data.lazy_reference import assert_same_batches, eager_run, record_batches

STEPS = int(os.environ.get("PLAIT_LAZY_STEPS", "12"))
"""Steps compared (the acceptance figure is 50: PLAIT_LAZY_STEPS=50)."""


def lazy_job(tiny_job, tmp_path, run: str, **data):
    recs = demo_records("train", limit=40)  # 10 global batches per epoch: the comparison crosses epochs
    return tiny_job(recs, train={"steps": STEPS, "global_batch_size": 4, "microbatch_size": 2},
                    data={"num_workers": 2, "prefetch": 2, "metadata_cache": str(tmp_path / "cache"), **data},
                    metrics={"run_dir": str(tmp_path / run), "progress": False, "tensorboard": False})


def test_lazy_batches_and_losses_equal_the_eager_path(tiny_job, tmp_path):
    cfg = lazy_job(tiny_job, tmp_path, "lazy")
    lazy = Trainer.build(cfg)
    lazy_batches = record_batches(lazy)
    result = lazy.fit()
    eager = Trainer.build(cfg)
    eager_batches = record_batches(eager)
    assert result["losses"] == eager_run(eager, STEPS)  # bit-identical
    assert_same_batches(lazy_batches, eager_batches)
    rows = [json.loads(line) for line in (tmp_path / "lazy" / "metrics.jsonl").read_text().splitlines()]
    waits = [r["data_wait_s"] for r in rows if "loss" in r]
    assert len(waits) == STEPS and all(w >= 0 for w in waits)
    assert all(r["dropped_samples"] == 0 for r in rows if "loss" in r) and result["dropped"] == 0


def test_in_process_loading_gives_the_same_losses(tiny_job, tmp_path):
    workers = Trainer.build(lazy_job(tiny_job, tmp_path, "w2")).fit(stop_after=4)["losses"]
    inline = Trainer.build(lazy_job(tiny_job, tmp_path, "w0", num_workers=0)).fit(stop_after=4)["losses"]
    assert workers == inline


def test_resume_mid_epoch_continues_exactly(tiny_job, tmp_path):
    full = Trainer.build(lazy_job(tiny_job, tmp_path, "full")).fit()["losses"]
    cut = STEPS // 2 + 1  # inside the first epoch (10 steps), not at a boundary
    cfg = lazy_job(tiny_job, tmp_path, "cut")
    first = Trainer.build(cfg).fit(stop_after=cut)["losses"]
    rest = Trainer.build(cfg).fit(resume=True)["losses"]
    assert first + rest == full


def corrupt_job(tiny_job, tmp_path, run: str, on_error: str):
    data = (DEMO / "img" / "000007.png").read_bytes()
    bad = tmp_path / "truncated.png"
    bad.write_bytes(data[: len(data) // 2])  # the header reads (the metadata pass accepts it), the pixels do not
    recs = demo_records("train", limit=7)
    corrupt = {**demo_records("train", ("image_digit",), limit=9)[-1], "images": [str(bad)]}
    cfg = tiny_job(recs[:1] + [corrupt] + recs[1:], train={"steps": 1, "global_batch_size": 4, "microbatch_size": 2},
                   data={"shuffle": False, "on_error": on_error, "num_workers": 1,
                         "metadata_cache": str(tmp_path / "cache")},
                   metrics={"run_dir": str(tmp_path / run), "progress": False, "tensorboard": False})
    return cfg, corrupt


def test_a_sample_failing_at_load_time_is_dropped_and_the_loss_counts_only_what_trained(tiny_job, tmp_path):
    cfg, corrupt = corrupt_job(tiny_job, tmp_path, "skip", "skip")
    trainer = Trainer.build(cfg)
    result = trainer.fit()
    where = f"{cfg.data.train}:2"
    assert result["dropped"] == 1 and [(s.id, s.source) for s in trainer.dropped] == [(corrupt["id"], where)]
    assert "cannot decode image" in trainer.dropped[0].reason
    reference = Trainer.build(cfg).train_step([0, 2, 3])  # the first global batch without the corrupt sample
    assert result["losses"] == [reference.loss]
    row = json.loads((tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["dropped_samples"] == 1 and row["target_tokens"] == reference.target_tokens


def test_a_sample_failing_at_load_time_stops_the_run_with_on_error_raise(tiny_job, tmp_path):
    cfg, corrupt = corrupt_job(tiny_job, tmp_path, "raise", "raise")
    with pytest.raises(SampleError, match=rf"^step 1: record '{corrupt['id']}' \({cfg.data.train}:2\): cannot decode"):
        Trainer.build(cfg).fit()
