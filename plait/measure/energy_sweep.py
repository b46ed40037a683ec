"""Measured GPU energy profiles (as Perseus, Chung et al., SOSP 2024, profiles them): sweep SM clocks, measure
each pipeline unit's passes in time and energy with NVML (through zeus), into the planner's
:class:`~plait.planner.energy.types.EnergyProfile`.

Method, per clock of the sweep (:func:`measure_energy_profile`): the SM clock is locked
(``set_gpu_locked_clocks``, zeus's device layer), then every unit's passes are re-run in isolation exactly as the
time profiler does (:func:`plait.measure.unit_timing.unit_pass_timings`: forward, dX, dW, fused backward of every
captured call) with an :class:`EnergyTimer`: the time is the median of ``repeats`` runs; the energy per run is the
difference of two ``ZeusMonitor`` windows of ``n`` runs each, one of the pass with its setup (a backward's forward
graph), one of the setup alone, divided by ``n`` (``n`` enough for ``min_window_s``: NVML's energy counter moves
every few to 100 ms, so short windows would read nothing).
A unit's weight-gradient pass is charged as the time profile charges it (``UnitMeasurement.to_cost``: the fused
backward minus dX when the unit needs an input gradient, else dW), for time and energy alike. The blocking power
(``P_blocking``, Perseus) is the GPU's power over an idle window. Clocks are reset at the end.

Where clocks cannot be locked (no GPU, zeus not installed, no ``SYS_ADMIN``), :func:`gpu_clock_control` says why
and the caller skips the sweep with that message (``plait profile --energy``, ``bench/gpu_energy_check.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from plait.data.collate import Batch
from plait.models.multimodal import MultimodalModel
from plait.models.units import unit_specs
from plait.planner.energy.types import EnergyProfile, UnitEnergy
from plait.planner.cost.types import ProfileKey
from plait.measure.unit_timing import KwargsFn, PassTiming, device_name, median_seconds, unit_pass_timings

__all__ = ["ClockControl", "EnergyTimer", "gpu_clock_control", "measure_energy_profile", "sweep_clocks"]


@dataclass
class ClockControl:
    """Locking one GPU's SM clock through zeus.

    Attributes:
        gpus: zeus's GPU collection (``zeus.device.get_gpus()``; tests pass a fake).
        index: the GPU's index in it.
        supported_mhz: SM clocks the GPU supports (MHz), descending.
        name: the GPU's name.
    """

    gpus: Any
    index: int
    supported_mhz: tuple[int, ...]
    name: str

    def lock(self, mhz: int) -> None:
        """Lock the SM clock at ``mhz``."""
        self.gpus.set_gpu_locked_clocks(self.index, mhz, mhz)

    def reset(self) -> None:
        """Give the clock back to the driver."""
        self.gpus.reset_gpu_locked_clocks(self.index)


def gpu_clock_control(device: torch.device) -> tuple[ClockControl | None, str]:
    """``(control, "")`` when ``device``'s SM clock can be locked, else ``(None, reason)``: not a CUDA device,
    zeus not installed (``pip install -e ".[energy]"``), or locking refused (needs ``SYS_ADMIN``). Tries one lock at
    the top clock and resets it."""
    if device.type != "cuda":
        return None, f"no GPU ({device.type} device): NVML energy and clock locking need a CUDA GPU"
    try:
        from zeus.device import get_gpus

        gpus = get_gpus()
    except Exception as exc:  # ImportError, NVML initialisation
        return None, f"zeus GPU control unavailable ({type(exc).__name__}: {exc}); pip install -e \".[energy]\""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        memory = max(gpus.get_supported_memory_clocks(index))
        supported = tuple(sorted(set(gpus.get_supported_graphics_clocks(index, memory)), reverse=True))
        gpus.set_gpu_locked_clocks(index, supported[0], supported[0])
        gpus.reset_gpu_locked_clocks(index)
    except Exception as exc:  # zeus's ZeusGPUNoPermissionError and friends
        return None, (f"locking GPU {index}'s SM clock was refused ({type(exc).__name__}: {exc}); it needs SYS_ADMIN "
                      "(https://ml.energy/zeus/getting_started/#system-privileges)")
    return ClockControl(gpus, index, supported, gpus.get_name(index)), ""


def sweep_clocks(supported_mhz: Sequence[int], count: int, lowest_fraction: float = 0.5) -> tuple[int, ...]:
    """``count`` clocks of ``supported_mhz`` for a sweep, descending: the top one and the supported clocks nearest
    to evenly spaced targets down to ``lowest_fraction`` of it (the range where Perseus' frontier lives).

    Raises:
        ValueError: on no supported clock, ``count < 1`` or a fraction outside (0, 1].
    """
    clocks = sorted(set(supported_mhz), reverse=True)
    if not clocks or count < 1 or not 0 < lowest_fraction <= 1:
        raise ValueError(f"sweep_clocks needs supported clocks, count >= 1 and a fraction in (0, 1], got "
                         f"{len(clocks)} clocks, {count}, {lowest_fraction}")
    top = clocks[0]
    targets = [top * (1 - (1 - lowest_fraction) * i / max(1, count - 1)) for i in range(count)]
    chosen = {min(clocks, key=lambda c: (abs(c - t), -c)) for t in targets}
    return tuple(sorted(chosen, reverse=True))


class EnergyTimer:
    """A timer of :func:`~plait.measure.unit_timing.unit_pass_timings` that also measures energy (module docstring):
    :meth:`median` returns the median seconds of ``repeats`` runs and leaves the joules per run in
    ``last_joules``.

    Args:
        device: the device to synchronise.
        monitor: a ``ZeusMonitor`` (``begin_window(key)`` / ``end_window(key)`` -> ``gpu_energy``: index -> J).
        repeats, warmup: timed and discarded runs of the time median.
        min_window_s: the least seconds of runs per energy measurement.
        max_runs: the most runs per energy window.
    """

    clock = "wall"
    _WINDOW = "plait_energy_profile"

    def __init__(self, device: torch.device, monitor: Any, repeats: int, warmup: int, min_window_s: float = 0.2,
                 max_runs: int = 5000) -> None:
        self.device, self.monitor, self.repeats, self.warmup = device, monitor, repeats, warmup
        self.min_window_s, self.max_runs = min_window_s, max_runs
        self.last_joules = 0.0

    def now(self) -> float:
        """Seconds (``time.perf_counter``), the device synchronised."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def median(self, fn: Callable[[Any], Any], setup: Callable[[], Any]) -> float:
        """Median seconds of ``fn(setup())`` over ``repeats`` runs after ``warmup``; ``last_joules``: the energy
        per run of ``fn`` alone, by difference of two windows of ``n`` runs each (``n`` enough for
        ``min_window_s``, at most ``max_runs``): ``setup`` then ``fn``, and ``setup`` alone."""
        seconds = median_seconds(fn, setup, self.now, self.repeats, self.warmup)
        runs = min(self.max_runs, max(self.repeats, math.ceil(self.min_window_s / max(seconds, 1e-9))))
        both = self._window(runs, lambda: fn(setup()))
        alone = self._window(runs, setup)
        self.last_joules = max(0.0, both - alone) / runs
        return seconds

    def _window(self, runs: int, work: Callable[[], Any]) -> float:
        """Joules of one monitor window around ``runs`` calls of ``work`` (the device synchronised)."""
        self.now()
        self.monitor.begin_window(self._WINDOW)
        for _ in range(runs):
            work()
        return sum(self.monitor.end_window(self._WINDOW).gpu_energy.values())


def _unit_row(timings: Sequence[PassTiming], needs_input_grad: bool) -> tuple[float, ...]:
    """Mean over microbatches of (forward s, J; dX s, J; weight-gradient s, J) of one unit at one clock, the
    weight-gradient pass charged as ``UnitMeasurement.to_cost`` does."""
    n = len(timings)
    mean = lambda f: sum(t.get(f) for t in timings) / n  # noqa: E731
    out = [mean("forward"), mean("forward_j"), mean("dx"), mean("dx_j")]
    if needs_input_grad:
        out += [max(0.0, mean("fused") - mean("dx")), max(0.0, mean("fused_j") - mean("dx_j"))]
    else:
        out += [mean("dw"), mean("dw_j")]
    return tuple(out)


def _blocking_power_w(monitor: Any, seconds: float = 0.5) -> float:
    """The GPU's power (W) over an idle window of about ``seconds`` (its energy over its measured time)."""
    monitor.begin_window("plait_blocking")
    time.sleep(seconds)
    measurement = monitor.end_window("plait_blocking")
    return sum(measurement.gpu_energy.values()) / max(measurement.time, 1e-9)


def measure_energy_profile(model: MultimodalModel, microbatches: Sequence[Batch], key: ProfileKey,
                           clocks: ClockControl, frequencies_mhz: Sequence[int], monitor: Any, *, repeats: int = 5,
                           warmup: int = 2, min_window_s: float = 0.2, llm_kwargs: KwargsFn | None = None,
                           autocast: Callable[[], AbstractContextManager] = nullcontext,
                           progress: Callable[[str], None] | None = None) -> EnergyProfile:
    """Per unit of ``model`` and per clock of ``frequencies_mhz``, the seconds and joules of its passes on
    ``microbatches`` (module docstring), as a measured :class:`EnergyProfile` (``gpu`` = ``clocks.name``).

    Args:
        model, microbatches, llm_kwargs, autocast: as :func:`plait.measure.unit_timing.measure_profile`.
        key: the profile key (same keying as time profiles, ``profile_key``).
        clocks: the GPU's clock control (:func:`gpu_clock_control`); frequencies_mhz: the sweep (any order).
        monitor: a ``ZeusMonitor`` of that GPU.
        repeats, warmup, min_window_s: as :class:`EnergyTimer`.
        progress: called with a line per clock (e.g. ``print``).

    Raises:
        ValueError: on no microbatch, no frequency, or ``repeats < 1``.
    """
    freqs = tuple(sorted(set(frequencies_mhz), reverse=True))
    if not microbatches or not freqs or repeats < 1:
        raise ValueError(f"measure_energy_profile needs microbatches, frequencies and repeats >= 1, got "
                         f"{len(microbatches)}, {freqs}, {repeats}")
    llm_kwargs = llm_kwargs or (lambda batch: {})
    specs = unit_specs(model)
    device = microbatches[0].input_ids.device
    rows: list[list[tuple[float, ...]]] = [[] for _ in specs]
    try:
        clocks.lock(freqs[0])
        blocking = _blocking_power_w(monitor)
        for mhz in freqs:
            clocks.lock(mhz)
            timer = EnergyTimer(device, monitor, repeats, warmup, min_window_s)
            per_mb = [unit_pass_timings(model, specs, b, timer, llm_kwargs, autocast, split=False)
                      for b in microbatches]
            for i, spec in enumerate(specs):
                rows[i].append(_unit_row([t[i] for t in per_mb], spec.unit.needs_input_grad))
            if progress is not None:
                progress(f"energy profile: {mhz} MHz measured ({len(specs)} units)")
    finally:
        clocks.reset()
    units = tuple(UnitEnergy(spec.unit.name, *(tuple(r[k] for r in rows[i]) for k in range(6)))
                  for i, spec in enumerate(specs))
    return EnergyProfile(key, clocks.name or device_name(device), blocking, freqs, units, "measured")
