"""Metrics JSONL (truncated on resume) and the loss-curve PNG."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from plait.train.metrics import MetricsWriter, read_metrics
from plait.train.plots import plot_loss_curve


def test_resume_drops_records_after_the_checkpoint_step(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 6):
        w.write({"step": step, "loss": 1.0 / step})
    w.write({"step": 5, "eval": {"image_digit": 0.5}})
    w2 = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)
    w2.write({"step": 4, "loss": 0.3})
    assert [(r["step"], r.get("loss")) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 0.5), (3, 1.0 / 3), (4, 0.3)]
    MetricsWriter(tmp_path, tensorboard=False)  # a fresh run starts an empty file
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_loss_curve_png(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(1, 30):
        w.write({"step": step, "loss": 5.0 / step})
    w.write({"step": 29, "eval": {"image_digit": 0.9, "audio_transcribe": 0.8}})
    png = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    with Image.open(png) as img:
        assert img.size[0] >= 800 and img.size[1] >= 450
        colours = np.unique(np.asarray(img.convert("RGB")).reshape(-1, 3), axis=0)
        assert len(colours) > 20  # something was drawn
    empty = MetricsWriter(tmp_path / "empty", tensorboard=False)
    empty.write({"step": 1, "eval": {}})
    with pytest.raises(ValueError, match="holds no training loss"):
        plot_loss_curve(tmp_path / "empty" / "metrics.jsonl", tmp_path / "x.png")
