"""Timeline outputs: Chrome trace JSON contents and the PNG Gantt chart."""

from __future__ import annotations

import json

import pytest

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.pipeline.types import TimelineEvent
from plait.planner.pipeline.simulator import simulate
from plait.train.plots import chrome_trace, plot_timeline, read_chrome_trace, write_chrome_trace


def _events():
    units = synthetic_units({"vision": [True, True]}, [True] * 3)
    plan = plan_pipeline(units, stages_per_module={"vision": 2, "llm": 3})
    costs = {"F": [0.002] * 5, "B": [0.001] * 5, "W": [0.001] * 5}
    schedule = one_f_one_b(plan, 6, split_backward=True, defer_weight_grad=True)
    return simulate(schedule, costs).events


def test_chrome_trace_contents(tmp_path):
    events = _events()
    path = write_chrome_trace(events, tmp_path / "out" / "trace.json", label="predicted")
    data = json.loads(path.read_text())
    records = data["traceEvents"]
    slices = [r for r in records if r["ph"] == "X"]
    assert len(slices) == len(events) == 5 * 6 * 3  # F, B and W of 5 trainable stages x 6 microbatches
    assert {r["tid"] for r in slices} == {0, 1, 2, 3, 4}
    threads = {r["tid"]: r["args"]["name"] for r in records if r["name"] == "thread_name"}
    assert threads == {r: f"rank {r}" for r in range(5)}
    assert [r["args"]["name"] for r in records if r["name"] == "process_name"] == ["predicted"]
    keys = [(r["tid"], r["ts"]) for r in slices]
    assert keys == sorted(keys)  # grouped by rank, in time order
    first = next(e for e in events if e.rank == 1 and e.kind == "B" and e.microbatch == 2)
    record = next(r for r in slices if r["tid"] == 1 and r["cat"] == "B" and r["args"]["microbatch"] == 2)
    assert record["name"] == "B s1 m2"
    assert record["ts"] == pytest.approx(first.start_s * 1e6) and record["dur"] == pytest.approx(1000.0)
    for tid in range(5):
        mine = [r for r in slices if r["tid"] == tid]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(mine, mine[1:]))


def test_chrome_trace_side_by_side_and_read_back(tmp_path):
    predicted = _events()
    measured = [
        TimelineEvent(e.rank, e.kind, e.stage, e.microbatch, 100 + 1.1 * e.start_s, 100 + 1.1 * e.end_s)
        for e in predicted
    ]
    path = write_chrome_trace({"predicted": predicted, "measured": measured}, tmp_path / "both.json")
    back = read_chrome_trace(path)
    assert list(back) == ["predicted", "measured"]
    assert {r["pid"] for r in json.loads(path.read_text())["traceEvents"]} == {0, 1}
    key = lambda e: (e.rank, e.start_s)  # noqa: E731
    for got, want in zip(sorted(back["predicted"], key=key), sorted(predicted, key=key)):
        assert (got.rank, got.kind, got.stage, got.microbatch) == (want.rank, want.kind, want.stage, want.microbatch)
        assert got.start_s == pytest.approx(want.start_s) and got.end_s == pytest.approx(want.end_s)
    # each label starts at 0: the measured run's wall-clock offset is removed
    assert min(e.start_s for e in back["measured"]) == pytest.approx(0.0)
    assert max(e.end_s for e in back["measured"]) == pytest.approx(1.1 * max(e.end_s for e in predicted))


def test_plot_timeline_png(tmp_path):
    from PIL import Image

    events = _events()
    path = plot_timeline(events, tmp_path / "timeline.png", title="1F1B, deferred W")
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 20_000
    with Image.open(path) as image:
        width, height = image.size
        pixels = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert width >= 1000 and height >= 300
    colours = {rgb for _, rgb in pixels}
    assert {(0x4C, 0x72, 0xB0), (0x55, 0xA8, 0x68), (0xDD, 0x84, 0x52)} <= colours  # F, B and W boxes drawn
    two = plot_timeline({"predicted": events, "measured": events}, tmp_path / "two.png")
    with Image.open(two) as image:
        assert image.size[1] > height  # one panel per label


def test_timeline_errors(tmp_path):
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([], tmp_path / "empty.png")
    with pytest.raises(ValueError, match="expected TimelineEvent"):
        chrome_trace([("F", 0, 0)])
    with pytest.raises(ValueError, match="end"):
        TimelineEvent(0, "F", 0, 0, 2.0, 1.0)


def test_timeline_blocks_are_labelled_with_stage_and_microbatch(tmp_path):
    from plait.train import plots

    events = [TimelineEvent(0, "F", 0, 0, 0.0, 0.5), TimelineEvent(1, "F", 1, 3, 0.5, 1.0),
              TimelineEvent(1, "B", 1, 3, 1.0, 1.005)]  # the last box is too narrow for any label
    names = [r["name"] for r in chrome_trace(events)["traceEvents"] if r["ph"] == "X"]
    assert names == ["F s0 m0", "F s1 m3", "B s1 m3"]
    seen = []
    real = plots.save_figure
    plots.save_figure = lambda fig, path: seen.append(fig) or real(fig, path)
    try:
        plot_timeline(events, tmp_path / "t.png")
    finally:
        plots.save_figure = real
    (ax,) = seen[0].axes
    assert sorted(t.get_text() for t in ax.texts) == ["F s0 m0", "F s1 m3"]
    assert plots._box_label(events[1], 40.0) == "s1 m3" and plots._box_label(events[1], 20.0) == "s1\nm3"
    assert plots._box_label(events[1], 10.0) == ""


def test_chrome_trace_keeps_the_frequency_of_energy_planned_actions(tmp_path):
    from plait.planner.pipeline.types import TimelineEvent
    from plait.train.plots import read_chrome_trace, write_chrome_trace

    events = [TimelineEvent(0, "F", 0, 0, 10.0, 10.5, 1500), TimelineEvent(1, "B", 1, 0, 10.5, 11.0)]
    path = write_chrome_trace(events, tmp_path / "t.json", label="measured")
    back = read_chrome_trace(path)["measured"]
    assert [(e.kind, e.frequency_mhz, e.start_s) for e in back] == [("F", 1500, 0.0), ("B", 0, 0.5)]
    import json
    args = [r["args"] for r in json.loads(path.read_text())["traceEvents"] if r.get("ph") == "X"]
    assert "frequency_mhz" not in args[1] and args[0]["frequency_mhz"] == 1500


def test_encoder_actions_take_their_modules_colour_with_the_kind_as_hatching(tmp_path, monkeypatch):
    from matplotlib.colors import to_hex

    from plait.planner.pipeline.plan import stage_ranks
    from plait.train import plots

    # the encoders in the LLM's bubbles: vision (stage 0) on LLM rank 1, audio (stage 1) on LLM rank 0
    units = synthetic_units({"vision": [True], "audio": [True]}, [True] * 2)
    plan = plan_pipeline(units, stages_per_module={"vision": 1, "audio": 1, "llm": 2},
                         ranks=stage_ranks(2, 2, in_bubble=True))
    modules = plots.encoder_stage_modules(plan)
    assert modules == {0: "vision", 1: "audio"}
    events = simulate(one_f_one_b(plan, 3), {"F": [0.002] * 4, "B": [0.001] * 4, "W": [0.0] * 4}).events
    seen = []
    real = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: seen.append(fig) or real(fig, path))
    plot_timeline(events, tmp_path / "t.png", modules=modules)
    (ax,) = seen[0].axes
    drawn = {(to_hex(c.get_facecolor()[0]), c.get_hatch()) for c in ax.collections}
    vision, audio, f, b = (c.lower() for c in (*plots.MODULE_COLORS[:2], plots.KIND_COLORS["F"], plots.KIND_COLORS["B"]))
    assert drawn == {(vision, None), (vision, "//"), (audio, None), (audio, "//"), (f, None), (b, None)}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["F forward", "B backward", "vision (B //, W ..)", "audio (B //, W ..)"]
