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


def test_rows_carry_utc_time_and_elapsed_seconds_that_continue_on_resume(tmp_path, monkeypatch):
    import datetime

    import plait.train.metrics as metrics

    clock = iter([100.0, 101.5, 103.25, 500.0, 502.0, 504.0])  # monotonic seconds seen by the writers
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    w = MetricsWriter(tmp_path, tensorboard=False)  # starts at 100
    before = datetime.datetime.now(datetime.timezone.utc)
    w.write({"step": 1, "loss": 2.0})  # 101.5
    w.write({"step": 2, "loss": 1.0})  # 103.25
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["elapsed_s"] for r in rows] == [1.5, 3.25]
    stamp = datetime.datetime.fromisoformat(rows[0]["time"].replace("Z", "+00:00"))
    assert rows[0]["time"].endswith("Z") and stamp.utcoffset() == datetime.timedelta(0)
    assert abs((stamp - before).total_seconds()) < 5
    # a resumed run (from step 1) keeps step 1's row and continues its clock: 1.5 + (502 - 500)
    w2 = MetricsWriter(tmp_path, tensorboard=False, resume_step=1)  # starts at 500
    w2.write({"step": 2, "loss": 0.9})  # 502
    w2.write({"step": 2, "eval": {"image_digit": 0.5}})  # 504
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["elapsed_s"]) for r in rows] == [(1, 1.5), (2, 3.5), (2, 5.5)]
    assert all("time" in r for r in rows)


class FakeWandb:
    """A stand-in for the ``wandb`` module that records what plait gives it."""

    def __init__(self) -> None:
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)

    def log(self, data, step=None):
        self.logs.append((step, dict(data)))

    def finish(self):
        self.finished += 1


def test_wandb_gets_every_numeric_field_when_enabled(tmp_path, monkeypatch):
    import sys

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = MetricsWriter(tmp_path / "myjob", tensorboard=False, wandb=True, wandb_project="proj",
                      config={"train": {"lr": 0.001}})
    w.write({"step": 3, "loss": 0.5, "lr": 1e-4, "workload": {"llm": {"cv": 0.25}}, "note": "text"})
    w.write({"step": 3, "eval": {"image_digit": 0.75}})
    w.close()
    assert fake.inits == [{"project": "proj", "name": "myjob", "dir": str(tmp_path / "myjob"),
                           "config": {"train": {"lr": 0.001}}}]
    (s1, first), (s2, second) = fake.logs
    assert (s1, s2) == (3, 3)
    assert {k: v for k, v in first.items() if k != "elapsed_s"} == {"loss": 0.5, "lr": 1e-4, "workload/llm/cv": 0.25}
    assert set(second) == {"eval/image_digit", "elapsed_s"} and second["eval/image_digit"] == 0.75
    assert first["elapsed_s"] >= 0 and fake.finished == 1
    assert w.destinations() == ["metrics.jsonl", "Weights & Biases"]
    MetricsWriter(tmp_path / "off", tensorboard=False).close()  # off by default: nothing more logged
    assert len(fake.inits) == 1 and len(fake.logs) == 2


def test_wandb_enabled_but_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"metrics.wandb = true but the wandb package is not installed: "
                                         r"pip install -e \"\.\[wandb\]\""):
        MetricsWriter(tmp_path, tensorboard=False, wandb=True)


def test_loss_plot_draws_validation_scores_as_points_not_lines():
    from plait.train.plots import loss_curve_figure

    records = [{"step": s, "loss": 4.0 / s} for s in range(1, 21)]
    records += [{"step": 10, "eval": {"image_digit": 0.4, "audio": 0.2}, "val_loss": 1.5},
                {"step": 20, "eval": {"image_digit": 0.9, "audio": 0.6}, "val_loss": 0.5}]
    fig = loss_curve_figure(sorted(records, key=lambda r: r["step"]))
    loss_ax, val_ax = fig.axes
    loss_line, val_loss = loss_ax.get_lines()
    assert list(loss_line.get_xdata()) == list(range(1, 21)) and loss_line.get_linestyle() == "-"
    assert val_loss.get_label() == "validation loss" and val_loss.get_linestyle() == "None"
    assert val_loss.get_marker() == "s" and list(val_loss.get_xdata()) == [10, 20]
    assert list(val_loss.get_ydata()) == [1.5, 0.5]
    series = {line.get_label(): line for line in val_ax.get_lines()}
    assert set(series) == {"val audio", "val image_digit"}
    for name, values in {"val image_digit": [0.4, 0.9], "val audio": [0.2, 0.6]}.items():
        line = series[name]
        assert line.get_linestyle() == "None" and line.get_marker() == "o"  # points, no line between them
        assert list(line.get_xdata()) == [10, 20] and list(line.get_ydata()) == values


def test_loss_plot_gives_each_series_its_colour_and_keeps_the_legend_off_the_data(tmp_path):
    from matplotlib.colors import to_hex

    from plait.train.plots import loss_curve_figure, save_figure

    records = [{"step": s, "loss": 4.0 / s} for s in range(1, 21)]
    records += [{"step": s, "eval": {f"task{k}": 0.1 * k for k in range(5)}, "val_loss": 2.0 / s} for s in (10, 20)]
    fig = loss_curve_figure(sorted(records, key=lambda r: r["step"]))
    save_figure(fig, tmp_path / "loss.png")
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert len(lines) == 7
    colours = [to_hex(line.get_color()) for line in lines]
    assert len(set(colours)) == len(colours), colours
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1  # one legend naming every series of both axes
    assert [t.get_text() for t in legends[0].get_texts()] == [line.get_label() for line in lines]
    renderer = fig.canvas.get_renderer()
    box = legends[0].get_window_extent(renderer)
    for ax in fig.axes:  # outside every axes: it covers no point
        assert not box.overlaps(ax.get_window_extent(renderer))
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # and not cut off


def test_tensorboard_gets_the_numeric_fields_when_installed(tmp_path, monkeypatch):
    import sys
    import types

    scalars, closed = [], []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, name, value, step):
            scalars.append((name, value, step))

        def close(self):
            closed.append(self.log_dir)

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    w = MetricsWriter(tmp_path)  # tensorboard on by default (metrics.tensorboard)
    w.write({"step": 2, "loss": 0.5, "eval": {"text": 1.0}, "predictions": "p.jsonl"})
    w.close()
    assert [(n, v, s) for n, v, s in scalars if n != "elapsed_s"] == [("loss", 0.5, 2), ("eval/text", 1.0, 2)]
    assert [s for n, _, s in scalars if n == "elapsed_s"] == [2] and closed == [str(tmp_path / "tensorboard")]
    assert w.destinations() == ["metrics.jsonl", "TensorBoard (tensorboard/)"]


def test_loss_axis_labels_are_plain_numbers_on_a_short_range_and_a_long_one():
    from plait.train.plots import loss_curve_figure

    for losses, shown in (([6.3, 6.2, 6.1, 6.0, 5.9], "6.05"), ([7.0, 2.0, 0.5, 0.08, 0.05], "0.1")):
        fig = loss_curve_figure([{"step": s + 1, "loss": v} for s, v in enumerate(losses)])
        (ax,) = fig.axes
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
        assert shown in labels and all(float(text) > 0 for text in labels), labels  # not "6.05x10^0", "2e-01"
