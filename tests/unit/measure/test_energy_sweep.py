"""The GPU energy sweep (train.energy_profiler) on CPU against a fake zeus: clocks locked in order and reset,
time and energy per unit and clock in the planner's EnergyProfile, the weight-gradient rule of time profiles, the
skip reason without a GPU, and the sweep's clock choice."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from plait.models.units import unit_specs
from plait.planner.energy.types import EnergyProfile
from plait.measure.energy_sweep import (
    ClockControl,
    EnergyTimer,
    gpu_clock_control,
    measure_energy_profile,
    sweep_clocks,
)
from plait.measure.unit_timing import PassTiming, profile_key
from plait.measure.energy_sweep import _unit_row
from tests.distributed.pipeline_worker import apply_mode, make_batch, tiny_model


class FakeGpus:
    def __init__(self):
        self.calls, self.mhz = [], 1980

    def set_gpu_locked_clocks(self, index, lo, hi):
        self.calls.append(("lock", index, lo))
        self.mhz = lo

    def reset_gpu_locked_clocks(self, index):
        self.calls.append(("reset", index))
        self.mhz = 1980


class FakeMonitor:
    """Energy = (50 W + 0.1 W/MHz x clock) x elapsed seconds of the window."""

    def __init__(self, gpus):
        self.gpus, self.open = gpus, {}

    def begin_window(self, key):
        self.open[key] = time.perf_counter()

    def end_window(self, key):
        seconds = time.perf_counter() - self.open.pop(key)
        return SimpleNamespace(gpu_energy={0: (50.0 + 0.1 * self.gpus.mhz) * seconds}, time=seconds)


def test_sweep_on_cpu_with_a_fake_gpu():
    torch.manual_seed(0)
    model = apply_mode(tiny_model(), "projectors")  # frozen encoders and LLM: units with and without dW
    batches = [make_batch("i", 1)]  # no audio: the audio units have no call (all zeros)
    key = profile_key({"model": "tiny"}, batches, "float32", "cpu")
    gpus = FakeGpus()
    clocks = ClockControl(gpus, 0, (1980, 1500, 1000), "fake-gpu")
    lines = []
    profile = measure_energy_profile(model, batches, key, clocks, (1000, 1980), FakeMonitor(gpus), repeats=1,
                                     warmup=0, min_window_s=0.0, progress=lines.append)
    assert isinstance(profile, EnergyProfile) and profile.source == "measured" and profile.gpu == "fake-gpu"
    assert profile.frequencies_mhz == (1980, 1000)
    assert gpus.calls == [("lock", 0, 1980), ("lock", 0, 1980), ("lock", 0, 1000), ("reset", 0)]
    assert [u.name for u in profile.units] == [s.unit.name for s in unit_specs(model)]
    assert 50.0 + 0.1 * 1980 - 1 < profile.blocking_power_w < 50.0 + 0.1 * 1980 + 1  # the idle window's power
    assert len(lines) == 2 and "1000 MHz" in lines[1]
    ran = {s.unit.name for s in unit_specs(model) if not s.unit.name.startswith("encoders.audio")}
    for unit in profile.units:
        assert all(len(getattr(unit, f)) == 2 for f in ("forward_s", "forward_j", "weight_grad_j"))
        if unit.name in ran:  # energies by difference of two windows: >= 0 (noise on a shared CPU), most > 0
            assert all(t > 0 for t in unit.forward_s) and all(j >= 0 for j in unit.forward_j), unit.name
        else:
            assert unit.forward_s == unit.forward_j == (0.0, 0.0), unit.name
    assert sum(j for u in profile.units for j in u.forward_j + u.input_grad_j + u.weight_grad_j) > 0
    assert EnergyProfile.from_json(profile.to_json()) == profile


def test_unit_row_charges_weight_gradients_like_time_profiles():
    t = PassTiming(forward=1.0, dx=0.5, dw=0.75, fused=1.0, forward_j=10.0, dx_j=5.0, dw_j=7.5, fused_j=12.0)
    assert _unit_row([t], needs_input_grad=True) == (1.0, 10.0, 0.5, 5.0, 0.5, 7.0)
    assert _unit_row([t, t], needs_input_grad=False) == (1.0, 10.0, 0.5, 5.0, 0.75, 7.5)


def test_energy_timer_spans_the_minimum_window():
    gpus = FakeGpus()
    timer = EnergyTimer(torch.device("cpu"), FakeMonitor(gpus), repeats=2, warmup=0, min_window_s=0.05)
    runs = []
    seconds = timer.median(lambda s: (runs.append(s), time.sleep(0.01)), lambda: len(runs))
    assert seconds > 0.009 and len(runs) >= 2 + 2  # the median's runs, then >= 0.05 s of runs (at least 2)
    assert timer.last_joules > 0.01 * (50 + 198) * 0.9  # (power at the top clock) x (>= 10 ms per run)


def test_no_gpu_is_a_skip_reason():
    control, reason = gpu_clock_control(torch.device("cpu"))
    assert control is None and reason.startswith("no GPU (cpu device)")


def test_sweep_clocks():
    supported = list(range(1980, 200, -15))
    assert sweep_clocks(supported, 5) == (1980, 1740, 1485, 1245, 990)  # ties: the higher clock
    assert sweep_clocks([1410, 1395], 4) == (1410, 1395)
    with pytest.raises(ValueError, match="count >= 1"):
        sweep_clocks(supported, 0)
