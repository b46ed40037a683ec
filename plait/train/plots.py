"""Plots and trace files: pipeline timelines (Chrome trace JSON and PNG Gantt charts).

Predicted (simulator) and measured (runtime) timelines share one event format,
``plait.planner.pipeline.schedules.TimelineEvent``, and one pair of outputs:

- ``write_chrome_trace``: Chrome trace-event JSON (opens in https://ui.perfetto.dev or chrome://tracing),
  one process per timeline label, one thread (track) per rank, one complete event (``"ph": "X"``) per
  action, times in microseconds.
- ``plot_timeline``: a PNG Gantt chart (matplotlib, Agg canvas; no global backend switch), one panel per
  label, one row per rank, F/B/W in different colours, each box labelled with its stage and microbatch
  (``"F s1 m3"``, or ``"s1 m3"`` / ``"s1\nm3"`` when the box is narrower; none when even that does not fit).
  Given the encoder stages' modules, their actions take their module's colour (F plain, B hatched ``//``, W
  dotted), so encoder work on an LLM rank (in its bubbles) stands out from the LLM's F/B/W.

Either takes a sequence of events or ``{label: events}`` to lay timelines side by side (e.g.
``{"predicted": sim.events, "measured": measured}``); each label is shifted to start at time 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from plait.planner.pipeline.timeline import summarize_timeline
from plait.planner.pipeline.types import PipelinePlan, TimelineEvent
from plait.planner.energy.units import ENERGY_UNIT, TIME_SCALE, TIME_UNIT

__all__ = [
    "KIND_COLORS",
    "chrome_trace",
    "encoder_stage_modules",
    "new_figure",
    "loss_curve_figure",
    "plot_energy_frontier",
    "plot_frequency_timelines",
    "plot_loss_curve",
    "plot_timeline",
    "read_chrome_trace",
    "save_figure",
    "write_chrome_trace",
]

Timelines = Union[Sequence[TimelineEvent], Mapping[str, Sequence[TimelineEvent]]]

KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}
"""Colour of each action kind in PNG charts; other kinds are grey."""
MODULE_COLORS = ("#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD")
"""Colours of the encoder modules' actions in PNG charts (in the order the modules are first named)."""
_KIND_HATCH = {"F": "", "B": "//", "W": ".."}
_OTHER_COLOR = "#9A9A9A"
# Reserved colour names of the Chrome trace viewer (Perfetto colours slices by name instead).
_TRACE_CNAMES = {"F": "thread_state_runnable", "B": "thread_state_running", "W": "thread_state_iowait"}


def _by_label(events: Timelines, default_label: str) -> dict[str, list[TimelineEvent]]:
    """Normalise ``events`` to ``{label: events shifted to start at 0}``.

    Raises:
        ValueError: when an entry is not a ``TimelineEvent``.
    """
    groups = dict(events) if isinstance(events, Mapping) else {default_label: events}
    out = {}
    for label, group in groups.items():
        group = list(group)
        bad = [e for e in group if not isinstance(e, TimelineEvent)]
        if bad:
            raise ValueError(f"timeline {label!r}: expected TimelineEvent entries, got {type(bad[0]).__name__}")
        origin = min((e.start_s for e in group), default=0.0)
        out[str(label)] = [
            TimelineEvent(e.rank, e.kind, e.stage, e.microbatch, e.start_s - origin, e.end_s - origin, e.frequency_mhz)
            for e in group
        ]
    return out


def _event_name(event: TimelineEvent) -> str:
    """``"F s1 m3"``: the action's kind, stage and microbatch (the parts that are known, >= 0)."""
    return " ".join([event.kind] + _block_tags(event))


def _block_tags(event: TimelineEvent) -> list[str]:
    """``["s1", "m3"]``: the stage and microbatch of ``event`` that are known (>= 0)."""
    return ([f"s{event.stage}"] if event.stage >= 0 else []) + ([f"m{event.microbatch}"] if event.microbatch >= 0
                                                                 else [])


# ----- Chrome trace --------------------------------------------------------------------------------
def chrome_trace(events: Timelines, *, label: str = "plait") -> dict[str, Any]:
    """The Chrome trace-event JSON object of ``events`` (module docstring).

    Each action becomes ``{"name": "F s1 m3", "cat": "F", "ph": "X", "pid": p, "tid": rank, "ts": us,
    "dur": us, "args": {"stage", "microbatch", "kind"}}`` (and ``"frequency_mhz"`` when an energy plan set one);
    metadata events name each process (label) and thread (``"rank r"``) and keep ranks in order. Events are sorted
    by process, rank, start.

    Args:
        events: the timeline, or ``{label: timeline}``.
        label: process name for a plain sequence.

    Raises:
        ValueError: on entries that are not ``TimelineEvent``.
    """
    trace: list[dict[str, Any]] = []
    for pid, (name, group) in enumerate(_by_label(events, label).items()):
        trace.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for rank in sorted({e.rank for e in group}):
            trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
            trace.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}}
            )
        for event in sorted(group, key=lambda e: (e.rank, e.start_s, e.end_s)):
            trace.append(_trace_event(event, pid))
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _trace_event(event: TimelineEvent, pid: int) -> dict[str, Any]:
    out = {
        "name": _event_name(event),
        "cat": event.kind,
        "ph": "X",
        "pid": pid,
        "tid": event.rank,
        "ts": event.start_s * 1e6,
        "dur": event.duration_s * 1e6,
        "args": {"kind": event.kind, "stage": event.stage, "microbatch": event.microbatch},
    }
    if event.frequency_mhz:  # set or recorded by an energy plan (plait.parallel.energy)
        out["args"]["frequency_mhz"] = event.frequency_mhz
    if event.kind in _TRACE_CNAMES:
        out["cname"] = _TRACE_CNAMES[event.kind]
    return out


def write_chrome_trace(events: Timelines, path: str | Path, *, label: str = "plait") -> Path:
    """Write ``chrome_trace(events, label=label)`` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, label=label)))
    return path


def read_chrome_trace(path: str | Path) -> dict[str, list[TimelineEvent]]:
    """Read a trace written by ``write_chrome_trace`` back into ``{label: events}`` (times in seconds).

    Complete events without plait's ``args`` (e.g. from another profiler) keep their name as kind and
    get stage and microbatch -1.

    Raises:
        ValueError: when the file has no ``traceEvents`` list.
    """
    data = json.loads(Path(path).read_text())
    records = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(records, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    names = {r["pid"]: r["args"]["name"] for r in records if r.get("ph") == "M" and r.get("name") == "process_name"}
    out: dict[str, list[TimelineEvent]] = {}
    for r in records:
        if r.get("ph") != "X":
            continue
        args = r.get("args", {})
        start = float(r["ts"]) / 1e6
        event = TimelineEvent(
            rank=int(r["tid"]),
            kind=str(args.get("kind", r["name"])),
            stage=int(args.get("stage", -1)),
            microbatch=int(args.get("microbatch", -1)),
            start_s=start,
            end_s=start + float(r.get("dur", 0.0)) / 1e6,
            frequency_mhz=int(args.get("frequency_mhz", 0)),
        )
        out.setdefault(names.get(r["pid"], str(r["pid"])), []).append(event)
    return out


# ----- PNG -------------------------------------------------------------------------------------
def new_figure(width_in: float, height_in: float, nrows: int = 1, *, sharex: bool = True, dpi: int = 120):
    """A matplotlib ``(Figure, axes list)`` on an Agg canvas, without touching the global backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0]
    return fig, list(axes)


def save_figure(fig, path: str | Path) -> Path:
    """Save ``fig`` (PNG by suffix) with tight layout, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s >= 1.0:
        return "s", 1.0
    if span_s >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def plot_timeline(events: Timelines, path: str | Path, title: str | None = None,
                  modules: Mapping[int, str] | None = None) -> Path:
    """Draw ``events`` as a Gantt chart PNG at ``path`` (module docstring); returns the path.

    Each panel's title gives its label, makespan and mean bubble fraction (``summarize_timeline``). ``modules``:
    encoder stage index -> module name (e.g. ``"vision"``, ``"vision+audio"`` for a colocated stage); those
    stages' actions are drawn in their module's colour (:data:`MODULE_COLORS`; F plain, B hatched, W dotted).

    Raises:
        ValueError: on entries that are not ``TimelineEvent`` or a timeline without events.
    """
    groups = _by_label(events, title or "timeline")
    if not any(groups.values()):
        raise ValueError("plot_timeline: no events to draw")
    span = max(e.end_s for g in groups.values() for e in g)
    unit, scale = TIME_UNIT, TIME_SCALE  # plait energy's one time unit (planner.energy.units)
    rows = [1 + max((e.rank for e in g), default=0) for g in groups.values()]
    fig, axes = new_figure(12.0, sum(0.45 * r + 1.1 for r in rows), nrows=len(groups))
    names = list(dict.fromkeys((modules or {}).values()))
    colors = {name: MODULE_COLORS[i % len(MODULE_COLORS)] for i, name in enumerate(names)}
    stage_colors = {stage: colors[name] for stage, name in (modules or {}).items()}
    for ax, (label, group) in zip(axes, groups.items()):
        _draw_panel(ax, group, scale, span * scale, stage_colors)
        summary = summarize_timeline(group)
        name = label if isinstance(events, Mapping) else (title or "pipeline timeline")
        ax.set_title(
            f"{name}: makespan {summary.makespan_s * scale:.4g} {unit}, "
            f"bubble {100 * summary.mean_bubble_fraction:.1f}%"
        )
    axes[-1].set_xlabel(f"time ({unit})")
    if title and isinstance(events, Mapping):
        fig.suptitle(title)
    drawn = {e.stage for g in groups.values() for e in g}
    _legend(axes[0], {e.kind for g in groups.values() for e in g},
            {name: c for name, c in colors.items() if any(modules[s] == name for s in drawn if s in modules)})
    return save_figure(fig, path)


def encoder_stage_modules(plan: PipelinePlan) -> dict[int, str]:
    """Encoder stage index -> its module name(s) (``"vision"``, or ``"vision+audio"`` for a colocated stage): the
    ``modules`` of :func:`plot_timeline`."""
    return {s.index: "+".join(s.modules) for s in plan.stages if not s.is_llm}


def _draw_panel(ax, events: Sequence[TimelineEvent], scale: float, xmax: float,
                stage_colors: Mapping[int, str] | None = None) -> None:
    ranks = 1 + max((e.rank for e in events), default=0)
    ax.set_xlim(0, xmax)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.grid(axis="x", alpha=0.3)
    fig = ax.figure
    axes_px = ax.get_position().width * fig.get_figwidth() * fig.dpi
    px_per_unit = axes_px / xmax if xmax > 0 else 0.0
    stage_colors = stage_colors or {}
    boxes: dict[tuple[int, str, str, str], list[tuple[float, float]]] = {}
    for event in events:
        if event.stage in stage_colors:  # an encoder stage: its module's colour, the kind by hatching
            key = (event.rank, event.kind, stage_colors[event.stage], _KIND_HATCH.get(event.kind, "xx"))
        else:
            key = (event.rank, event.kind, KIND_COLORS.get(event.kind, _OTHER_COLOR), "")
        boxes.setdefault(key, []).append((event.start_s * scale, event.duration_s * scale))
    for (rank, _, color, hatch), spans in boxes.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.5,
                       hatch=hatch or None)
    for event in events:
        start, width = event.start_s * scale, event.duration_s * scale
        text = _box_label(event, width * px_per_unit)
        if text:
            ax.text(start + width / 2, event.rank, text, ha="center", va="center", fontsize=7, color="white",
                    linespacing=0.9)


def _box_label(event: TimelineEvent, width_px: float) -> str:
    """The longest label of ``event`` that fits a box ``width_px`` pixels wide (about 6 px per character at
    font size 7): ``"F s1 m3"``, ``"s1 m3"``, ``"s1\nm3"`` (stacked), or ``""``."""
    tags = _block_tags(event)
    if not tags:
        return ""
    for text in (_event_name(event), " ".join(tags), "\n".join(tags)):
        if width_px >= 6.0 * max(len(line) for line in text.split("\n")) + 4:
            return text
    return ""


def _legend(ax, kinds: set[str], modules: Mapping[str, str] | None = None) -> None:
    from matplotlib.patches import Patch

    labels = {"F": "F forward", "B": "B backward", "W": "W weight grad"}
    ordered = [k for k in KIND_COLORS if k in kinds] + sorted(kinds - set(KIND_COLORS))
    handles = [Patch(color=KIND_COLORS.get(k, _OTHER_COLOR), label=labels.get(k, k)) for k in ordered]
    handles += [Patch(facecolor=c, label=f"{name} (B //, W ..)") for name, c in (modules or {}).items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


# ----- loss curve ------------------------------------------------------------------------------
def plot_loss_curve(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Training loss per step (log scale) and validation scores (right axis) as a PNG: :func:`loss_curve_figure`
    of the records of ``metrics_path`` saved to ``out_path``.

    Raises:
        ValueError: when the metrics file holds no loss record.
    """
    from plait.train.metrics import read_metrics

    return save_figure(loss_curve_figure(read_metrics(metrics_path), str(metrics_path)), out_path)


_SERIES_COLORS = ("tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                  "tab:gray")
"""Colours of the validation scores in the loss curve, after the training loss (blue) and validation loss (red)."""


def loss_curve_figure(records: Sequence[Mapping[str, Any]], source: str = "metrics"):
    """The loss-curve figure of metrics rows ``records``: the training loss per step as a line (log scale), the
    validation loss (rows' ``val_loss``) as points on the same axis, and each validation score (the numbers of
    the rows' ``eval`` dicts, e.g. exact match per task) as points on a right axis from 0 to 1 (markers, no
    lines: validation is measured at a few steps only). Every series has its own colour (scores past the 8th
    reuse them); one legend for both axes sits below the axes, so it covers no point.

    Returns:
        The matplotlib ``Figure`` (axes: the loss axis, then the validation axis when there are scores).

    Raises:
        ValueError: when ``records`` hold no training loss (``source`` names them in the message).
    """
    from matplotlib.ticker import LogFormatter, MaxNLocator

    class PlainLogFormatter(LogFormatter):
        """The ticks ``LogFormatter`` labels, as plain numbers: "6.05", not "6.05x10^0", on a short loss range."""

        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if not losses:
        raise ValueError(f"{source} holds no training loss")
    fig, (ax,) = new_figure(8, 4.5, dpi=110)
    ax.plot(*zip(*losses), color="tab:blue", lw=1.2, label="train loss")
    val_losses = [(r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    if val_losses:
        ax.plot(*zip(*val_losses), color="tab:red", marker="s", ms=5, linestyle="none", label="validation loss")
    ax.set(xlabel="step", ylabel="loss (mean token cross-entropy)", yscale="log", title="plait training")
    ax.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also on short runs
    ax.grid(alpha=0.3)
    handles = list(ax.get_lines())
    evals = [r for r in records if isinstance(r.get("eval"), Mapping) and r["eval"]]  # validation off: empty
    if evals:
        ax2 = ax.twinx()
        names = sorted({k for r in evals for k, v in r["eval"].items() if isinstance(v, (int, float))})
        for k, name in enumerate(names):
            points = [(r["step"], r["eval"][name]) for r in evals if isinstance(r["eval"].get(name), (int, float))]
            ax2.plot(*zip(*points), color=_SERIES_COLORS[k % len(_SERIES_COLORS)], marker="o", ms=4,
                     linestyle="none", label=f"val {name}")
        ax2.set(ylabel="validation exact match", ylim=(0, 1.02))
        handles += list(ax2.get_lines())
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(handles), 4),
              fontsize=8, frameon=False)
    return fig


# ----- energy -----------------------------------------------------------------------------------
def plot_energy_frontier(points: Sequence[tuple[float, float]], path: str | Path, *,
                         marks: Mapping[str, tuple[float, float]] | None = None, title: str = "") -> Path:
    """The time-energy frontier as a PNG: energy per iteration (J) against iteration time (ms;
    ``planner.energy.units``, the units of ``plait energy``'s table), one dot per
    frontier point joined by steps, and each of ``marks`` (``{label: (seconds, joules)}``, e.g. the all-top-clock
    iteration ``"max frequency"`` and the chosen plans) as a labelled marker.

    Raises:
        ValueError: when ``points`` is empty.
    """
    if not points:
        raise ValueError("plot_energy_frontier: no frontier point")
    fig, (ax,) = new_figure(7.5, 4.5, dpi=110)
    times, energies = zip(*sorted(points))
    ax.plot([t * TIME_SCALE for t in times], energies, marker="o", ms=3, lw=1, drawstyle="steps-post",
            color="tab:blue", label="frontier")
    for (label, (t, e)), marker in zip((marks or {}).items(), "*sD^v"):
        ax.plot([t * TIME_SCALE], [e], marker=marker, ms=11 if marker == "*" else 7, linestyle="none", label=label)
    ax.set(xlabel=f"iteration time ({TIME_UNIT})", ylabel=f"energy per iteration ({ENERGY_UNIT})",
           title=title or "time-energy frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_frequency_timelines(timelines: Mapping[str, tuple[Sequence[TimelineEvent], Mapping[tuple[int, str], int]]],
                             path: str | Path, *, title: str = "") -> Path:
    """Timelines side by side with each action coloured by its GPU frequency (one colour scale, MHz, shared by
    all panels): ``{label: (events, {(rank, "F s1 m3"): frequency_mhz})}``, e.g. the top-clock iteration beside
    an energy plan's. Actions without a frequency are grey. Times in ms (``planner.energy.units``).

    Raises:
        ValueError: when no panel has events.
    """
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    groups = {label: list(events) for label, (events, _) in timelines.items()}
    if not any(groups.values()):
        raise ValueError("plot_frequency_timelines: no events to draw")
    freqs = [f for _, fmap in timelines.values() for f in fmap.values()]
    norm = Normalize(min(freqs, default=0), max(freqs, default=1) + (0 if len(set(freqs)) > 1 else 1))
    cmap = colormaps["viridis"]
    span = max(e.end_s for g in groups.values() for e in g)
    unit, scale = TIME_UNIT, TIME_SCALE  # plait energy's one time unit (planner.energy.units)
    rows = [1 + max((e.rank for e in g), default=0) for g in groups.values()]
    fig, axes = new_figure(12.0, sum(0.45 * r + 1.1 for r in rows), nrows=len(groups))
    for ax, (label, (events, fmap)) in zip(axes, timelines.items()):
        ranks = 1 + max((e.rank for e in events), default=0)
        ax.set(xlim=(0, span * scale), ylim=(ranks - 0.5, -0.5), yticks=range(ranks),
               yticklabels=[f"rank {r}" for r in range(ranks)])
        for event in events:
            f = fmap.get((event.rank, _event_name(event)))
            color = _OTHER_COLOR if f is None else cmap(norm(f))
            ax.broken_barh([(event.start_s * scale, event.duration_s * scale)], (event.rank - 0.4, 0.8),
                           facecolors=color, edgecolor="white", linewidth=0.5)
        makespan = max((e.end_s for e in events), default=0.0) - min((e.start_s for e in events), default=0.0)
        ax.set_title(f"{label}: iteration {makespan * scale:.4g} {unit}")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel(f"time ({unit})")
    from matplotlib.cm import ScalarMappable

    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0.0, 0.0, 0.9, 1.0))
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), cax=fig.add_axes((0.92, 0.15, 0.015, 0.7)),
                 label="SM frequency (MHz)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
