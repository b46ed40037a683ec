"""``plait plan --energy`` names the GPU preset it plans for in one line: this host's GPU, else H100 by default (a
CPU host), or ``--device``; ``--device cpu`` is refused with the presets there are."""

from __future__ import annotations

import io

import pytest

from plait.cli import main
from plait.commands.plan.energy import _energy_preset
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def test_energy_preset_is_announced_in_one_line(monkeypatch):
    monkeypatch.setattr("plait.measure.host_costs.host_device", lambda: ("cpu", "this host has no GPU"))
    out = io.StringIO()
    assert _energy_preset(None, out).name == "h100"
    assert out.getvalue() == ("plait plan --energy: planning for the h100 GPU preset (H100-SXM; this host has no GPU: "
                              "the default; --device a100|h100|h200 for another)\n")
    monkeypatch.setattr("plait.measure.host_costs.host_device", lambda: ("h200", "this host's GPU is NVIDIA H200"))
    out = io.StringIO()
    assert _energy_preset(None, out).name == "h200"
    assert "h200 GPU preset (H200-SXM; this host's GPU is NVIDIA H200;" in out.getvalue()
    out = io.StringIO()
    assert _energy_preset("a100", out).name == "a100" and "(A100-SXM-80GB; --device;" in out.getvalue()


def test_energy_plan_with_a_cpu_device_is_refused_naming_the_presets():
    with pytest.raises(ValueError, match=r"--device cpu has no energy preset; choose one of \['a100', 'h100', 'h200'\]"):
        _energy_preset("cpu", io.StringIO())


def test_plan_energy_cli_prints_the_preset_first(capsys):
    assert main(["plan", "--config", str(DEMO), "--devices", "1", "--energy", "--device", "h200"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("plait plan --energy: planning for the h200 GPU preset (H200-SXM; --device;")
