"""``plait energy`` end to end on the demo job: table, frequency plan JSON, frontier JSON and plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from plait.cli import main
from plait.planner.energy.types import EnergyPlan

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"


def _row(text: str, name: str) -> tuple[float, float]:
    match = re.search(rf"^{re.escape(name)}\s+(\S+)\s+(\S+)", text, re.M)
    assert match, f"no row {name!r} in\n{text}"
    return float(match.group(1)), float(match.group(2))


def test_energy_cli_on_the_demo_job(tmp_path, capsys):
    out = tmp_path / "energy"
    assert main(["energy", "--config", str(DEMO), "--devices", "2", "--dp", "1", "--microbatches", "4", "--straggler", "1.3",
                 "--method", "lowtime",
                 "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    t_max, e_max = _row(text, "max frequency")
    t_star, e_star = _row(text, "plan at T*")
    assert t_star == pytest.approx(t_max, rel=1e-4)  # same iteration time (printed to 5 digits)
    assert e_star <= e_max
    t_wait, e_wait = _row(text, "max frequency, waiting 1.3x")
    _, e_strag = _row(text, "plan at 1.3x T*")
    assert t_wait == pytest.approx(1.3 * t_max, rel=1e-4) and e_strag <= e_wait
    plan = EnergyPlan.from_json((out / "energy_plan.json").read_text())
    assert plan.gpu == "h100" and plan.max_frequency_mhz == 1980 and plan.points
    frontier = json.loads((out / "frontier.json").read_text())
    times = [p["iteration_time_s"] for p in frontier]
    assert times == sorted(times) and times[0] == pytest.approx(plan.points[0].iteration_time_s)
    for name in ("frontier.png", "timelines.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_energy_cli_refuses_a_bad_straggler(capsys):
    assert main(["energy", "--config", str(DEMO), "--devices", "2", "--straggler", "0.5"]) != 0
    assert "--straggler must be >= 1" in capsys.readouterr().err


def test_plan_energy_breaks_ties_by_energy(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(DEMO), "--devices", "2", "--energy", "0.6", "--device", "h100",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = re.findall(r"^  (\S+)\s+DP (\d+)\s+\d+ ranks per replica: iteration (\S+) ms, (\S+) J", text, re.M)
    assert rows, text
    fastest = min(float(t) for _, _, t, _ in rows)
    assert len(rows) == 2 and all(float(t) <= 1.6 * fastest for _, _, t, _ in rows)
    layout, dp, _, _ = min(rows, key=lambda r: float(r[3]))
    assert f"chose {layout}, DP {dp}" in text
    assert json.loads(out.read_text())


def test_energy_with_a_measured_profile(tmp_path, capsys):
    """A measured energy profile (the form ``plait profile --energy`` stores) replaces the preset: its GPU name,
    clocks and blocking power go into the plan."""
    import dataclasses

    from plait.train.job_file import load_config_for_planning
    from plait.models.plan_inputs import build_plan_inputs, device_spec
    from plait.planner.cost.analytic import unit_estimates
    from plait.planner.energy.power_profile import analytic_energy_profile, gpu_preset
    from plait.planner.cost.types import ProfileKey

    cfg, _ = load_config_for_planning(DEMO)
    inputs = build_plan_inputs(cfg, device_spec("a100"))
    gpu = dataclasses.replace(gpu_preset("a100"), name="NVIDIA A100 (measured)", frequencies_mhz=(1410, 1110, 810))
    key = ProfileKey({"job": "demo"}, [], inputs.dtype, gpu.name, "", "")
    profile = analytic_energy_profile(inputs.units, unit_estimates(inputs.units, inputs.model_configs, inputs.shapes),
                                      gpu, key)
    path = tmp_path / "energy-profile.json"
    path.write_text(dataclasses.replace(profile, source="measured").to_json())
    assert main(["energy", "--config", str(DEMO), "--devices", "2", "--dp", "1", "--gpu", "a100", "--method", "lowtime",
                 "--energy-profile", str(path), "--out-dir", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert f"measured energy profile {path} (NVIDIA A100 (measured), clocks 810-1410 MHz)" in text
    plan = EnergyPlan.from_json((tmp_path / "out" / "energy_plan.json").read_text())
    assert plan.gpu == "NVIDIA A100 (measured)" and plan.max_frequency_mhz == 1410
    assert {f.frequency_mhz for p in plan.points for f in p.frequencies} <= {1110, 810}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["energy", "--config", str(DEMO), "--devices", "2", "--energy-profile", str(bad)]) == 2
    assert "is not an energy profile" in capsys.readouterr().err


def test_energy_refuses_a_plan_without_a_pipeline_and_says_what_to_do(tmp_path, capsys):
    # the demo on 8 GPUs without encoder replicas: 2 microbatches per step, plain DP 2 is planned (no pipeline,
    # nothing to clock; with them, the default, DP 2 x a 4-rank pipeline with audio on 2 ranks is 9% faster)
    assert main(["energy", "--config", str(DEMO), "--devices", "8", "--method", "lowtime", "--no-encoder-dp",
                 "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "the plan for 8 devices has no pipeline" in err and "parallel.pp.degree > 1" in err and "--dp 1" in err
    assert not (tmp_path / "out" / "energy_plan.json").exists()


def test_energy_units_agree_across_table_plot_and_timelines(tmp_path, capsys):
    assert main(["energy", "--config", str(DEMO), "--devices", "2", "--dp", "1", "--microbatches", "4",
                 "--method", "lowtime", "--out-dir", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^\s+iteration \(ms\)\s+energy \(J\)\s+savings$", text, re.M), text
    t_max, e_max = _row(text, "max frequency")
    frontier = json.loads((tmp_path / "out" / "frontier.json").read_text())
    assert t_max == pytest.approx(1e3 * frontier[0]["iteration_time_s"], rel=1e-4)  # the table's time is in ms
    from plait.planner.energy.units import format_energy, format_time

    assert format_time(0.0002475) == "0.2475 ms" and format_energy(1234.5) == "1234.5 J"
    import inspect

    from plait.train import plots

    source = inspect.getsource(plots.plot_energy_frontier) + inspect.getsource(plots.plot_frequency_timelines)
    assert "kJ" not in source and "_time_unit(" not in source  # the plots use the table's units
