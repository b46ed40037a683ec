"""Memory figures in the plan report (``planner.report.format_bytes``): GiB from one GiB up, MiB below, so a
small cap or peak never reads as "0.0 GiB" and a fitting plan never looks over its cap."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.report import format_bytes, format_plan, memory_unit, rank_peak_memory_bytes
from plait.planner.search.layout import evaluate_plan
from plait.planner.types import UnitCost
from plait.planner.search.types import Machine

MIB, GIB = 2**20, 2**30


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0.0 MiB"), (1024, "0.0 MiB"), (MIB, "1.0 MiB"), (61.44 * MIB, "61.4 MiB"), (GIB - MIB, "1023.0 MiB"),
    (GIB, "1.00 GiB"), (12.345 * GIB, "12.35 GiB"), (80 * GIB, "80.00 GiB"),
])
def test_format_bytes_is_gib_from_one_gib_up_else_mib(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_format_bytes_in_the_unit_of_the_largest_figure():
    assert format_bytes(GIB // 2, largest=GIB) == "0.50 GiB"
    assert format_bytes(3 * GIB, largest=MIB) == "3072.0 MiB"
    assert memory_unit(GIB) == ("GiB", GIB, 2) and memory_unit(GIB - 1) == ("MiB", MIB, 1)


def _small_choice(cap: float | None):
    """Two pipeline ranks of two trainable LLM units of 8 MiB of fp32 parameters each (static: parameters, 4 B
    gradients and 12 B AdamW state per parameter = 40 MiB per unit, no activations): 80 MiB per stage and rank."""
    units = synthetic_units({}, [True] * 4)
    costs = [UnitCost(1e-3, 1e-3, 1e-3, param_bytes=8 * MIB, activation_bytes=0, output_bytes=8) for _ in units]
    plan = plan_pipeline(units, stages_per_module={"llm": 2}, ranks=[0, 1])
    choice = evaluate_plan(plan, units, costs, dp=1, microbatches=2, machine=Machine(dtype="float32"))
    return dataclasses.replace(choice, memory_cap=cap)


def test_plan_report_prints_small_caps_and_peaks_in_mib():
    choice = _small_choice(cap=100 * MIB)
    assert choice.stage_memory_bytes == (80 * MIB,) * 2 and rank_peak_memory_bytes(choice) == (80 * MIB,) * 2
    text = format_plan(choice)
    assert "peak memory per rank (device) 80.0 MiB (cap 100.0 MiB); ranks 80.0 / 80.0 MiB" in text
    assert text.splitlines()[0].endswith("stage MiB") and text.count("     80.0\n") == 2
    assert "GiB" not in text


def test_plan_report_gives_each_figure_its_own_unit():
    """A cap of 72 GiB and a peak of 80 MiB: each in its own unit (the cap does not turn the peak into 0.08 GiB)."""
    text = format_plan(_small_choice(cap=72 * GIB))
    assert "peak memory per rank (device) 80.0 MiB (cap 72.00 GiB)" in text
