"""``plait simulate``: the predicted timeline of a plan written by ``plait plan --out``.

The plan file is read back (``plait.planner.report.plan_from_json``), one iteration of its busiest replica is
simulated from the per-stage costs it carries (``plait.planner.report.simulate_choice``: the plan's schedule,
1F1B or interleaved) and the timeline is written as a Chrome trace and a PNG (``plait.train.plots``), the format
measured timelines use too (one schedule, one timeline format for predicted and measured runs).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from plait.planner.report import format_bytes, plan_from_json, simulate_choice
from plait.train.plots import encoder_stage_modules, plot_timeline, write_chrome_trace

__all__ = ["simulate_command"]

def simulate_command(plan_json: str | Path, out_dir: str | Path, *, out: TextIO | None = None) -> dict[str, Path]:
    """``plait simulate``: write ``<out_dir>/timeline.json`` (Chrome trace: open in https://ui.perfetto.dev) and
    ``<out_dir>/timeline.png`` (Gantt chart), one track per pipeline rank of one replica, and print the makespan,
    bubble and peak memory and the two paths to ``out`` (default stdout).

    Returns:
        ``{"trace": path, "png": path}``.

    Raises:
        FileNotFoundError: when ``plan_json`` does not exist; ValueError: naming the file when it is not a plan
            JSON written by ``plait plan --out`` (e.g. a profile or a ``timeline.json``), or when ``out_dir``
            exists and is not a folder.
    """
    path = Path(plan_json)
    if not path.is_file():
        raise FileNotFoundError(f"plan file {path} does not exist")
    try:
        choice = plan_from_json(path.read_text())
        result = simulate_choice(choice)
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:  # not JSON, not a plan
        raise ValueError(f"--plan {path} is not a plan JSON written by `plait plan --out` "
                         f"({type(exc).__name__}: {exc})") from exc
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out-dir {folder} exists and is not a folder")
    trace = write_chrome_trace(result.events, folder / "timeline.json", label="predicted")
    title = f"predicted: {choice.layout}, DP {choice.dp}, {choice.microbatches_per_replica} microbatches per replica"
    png = plot_timeline(result.events, folder / "timeline.png", title=title,
                        modules=encoder_stage_modules(choice.plan))
    stream = out or sys.stdout
    print(f"plait simulate: makespan {1e3 * result.makespan_s:.2f} ms, bubble "
          f"{100 * result.mean_bubble_fraction:.1f}%, peak memory {format_bytes(max(result.peak_memory_bytes))}; "
          f"wrote {trace} and {png}", file=stream)
    print(f"plait: predicted timeline {trace} (Chrome trace) and {png}", file=stream)
    return {"trace": trace, "png": png}
