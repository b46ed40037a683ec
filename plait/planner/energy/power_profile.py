"""Energy profiles as data: time and energy of each pipeline unit's passes per GPU SM frequency.

Perseus (Chung et al., "Perseus: Reducing Energy Bloat in Large Model Training", SOSP 2024, arXiv 2312.06902)
plans one SM frequency per forward and backward from each computation's
(time, energy) at every frequency. This module builds and reads those numbers (their types live in ``types``):

- :class:`UnitEnergy`: per pipeline unit, per frequency, the seconds and joules of its forward, input-gradient
  (dX) and weight-gradient (dW) passes for one microbatch shape; :class:`EnergyProfile` collects them under the
  same :class:`~plait.planner.cost.types.ProfileKey` as the time profiles (model, shapes, dtype, device, versions),
  so :func:`energy_profile_mismatch` refuses a stale one by the same rules as ``profile.profile_mismatch``.
  A measured profile (NVML through zeus, on a GPU) and an analytic one have the same form.
- :class:`GpuPowerModel` and :data:`GPU_PRESETS`: analytic presets for A100, H100 and H200 to plan without a
  GPU. :func:`analytic_energy_profile` combines them with the roofline cost model (``planner.cost_model``:
  each unit's compute seconds ``FLOPs / (peak * efficiency)`` and memory seconds ``bytes / HBM bandwidth``).
- :func:`stage_action_options`: per stage action (``F``/``B``/``W``), the ``(frequency, seconds, joules)``
  options, aggregated from units by the simulator's own rules (``simulator.stage_costs_from_units``: frozen
  units pay no dW, LoRA units their adapters' share, checkpointed units a second forward). A tensor-parallel
  encoder stage (``Stage.tensor_parallel``, ``[parallel.pp] encoder_tp``) is charged per TP rank by
  ``evaluate_plan``'s rule (``cost.sharding.tensor_parallel_unit_costs``): its layers' seconds and joules divided
  by ``t``, their all-reduces' seconds added at every clock (the link does not scale with the SM clock) at the
  blocking power (the SMs wait on the link).

The analytic model, per unit pass at SM clock ``f`` (``x = f / f_max``):

- time ``t(f) = max(t_compute * f_max / f, t_memory)``: matmul throughput scales with the SM clock (the
  tensor-core peak is ``SMs x ops/clock x f``), HBM bandwidth does not (memory clock is not changed);
- power ``P(f) = P_static + (P_tdp - P_static) * (a + (1 - a) * beta) * x**gamma`` with ``a`` the
  compute-bound share of the pass's time at ``f`` (``t_compute * f_max / f / t(f)``), ``beta`` the relative
  activity of memory-bound work, and ``gamma`` the exponent of dynamic power in the clock (``P_dyn ~ C V^2 f``
  with the voltage rising with the clock over the DVFS range gives 2-3); energy ``E = P(f) * t(f)``. A
  compute-bound pass at the top clock draws the board's TDP.

Numbers of the presets. From NVIDIA's data sheets: A100 SXM4 80 GB: 400 W TDP, 1410 MHz maximum SM (boost)
clock; H100 SXM5 80 GB: 700 W TDP, 1980 MHz; H200 SXM 141 GB: 700 W TDP, 1980 MHz. The rest are *assumptions*
chosen to reproduce the shape Perseus and Zeus (You et al., NSDI 2023) report for transformer forward and
backward passes on A100/H100, not measured values: energy per pass falls as the clock drops from the top,
by about 10-20% at 75-80% of the maximum clock, for a 20-30% longer pass; the energy-optimal clock of
compute-bound work lies near half the maximum: ``gamma = 2.5``, ``beta = 0.6``, a clock-independent busy
floor ``P_static`` of about 22% of TDP (A100 90 W, H100/H200 150 W) and a blocking power (GPU waiting on a
P2P receive, Perseus' ``P_blocking``) of 75 W (A100) and 110 W (H100/H200). Planned clocks: 9 steps from the
maximum down to about 57% of it. Replace them with a measured profile (same form) when a GPU is at hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from plait.planner.cost.sharding import tensor_parallel_unit_costs
from plait.planner.cost.types import DeviceSpec, ProfileKey, UnitEstimate
from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.cost.measured_profile import profile_mismatch
from plait.planner.energy.types import EnergyProfile, GpuPowerModel, UnitEnergy
from plait.planner.pipeline.simulator import stage_costs_from_units
from plait.planner.types import Unit, UnitCost

__all__ = [
    "GPU_PRESETS",
    "ActionOption",
    "analytic_energy_profile",
    "energy_profile_mismatch",
    "gpu_preset",
    "stage_action_options",
]


def _steps(top: int, step: int, count: int) -> tuple[int, ...]:
    return tuple(top - i * step for i in range(count))


GPU_PRESETS: dict[str, GpuPowerModel] = {
    "a100": GpuPowerModel("a100", DeviceSpec.a100(), 400.0, 90.0, 75.0, _steps(1410, 75, 9)),
    "h100": GpuPowerModel("h100", DeviceSpec.h100(), 700.0, 150.0, 110.0, _steps(1980, 105, 9)),
    "h200": GpuPowerModel("h200", DeviceSpec.h200(), 700.0, 150.0, 110.0, _steps(1980, 105, 9)),
}
"""The analytic presets (module docstring: data-sheet TDPs and clocks, assumed shape parameters)."""


def gpu_preset(name: str) -> GpuPowerModel:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ValueError: naming the presets when there is none of that name.
    """
    key = name.lower()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {name!r} for energy planning; choose one of {sorted(GPU_PRESETS)}")
    return GPU_PRESETS[key]


def energy_profile_mismatch(stored: EnergyProfile, wanted: ProfileKey, gpu: str) -> str | None:
    """Why ``stored`` must not be used for a job keyed ``wanted`` on ``gpu`` (None when it may): the time
    profiles' rule (``profile.profile_mismatch``: every key field equal) plus the GPU name."""
    reasons = [r for r in (profile_mismatch(stored.key, wanted),) if r]
    if stored.gpu.lower() != gpu.lower():
        reasons.append(f"gpu differs (stored {stored.gpu!r}, wanted {gpu!r})")
    return "; ".join(reasons) or None


def analytic_energy_profile(units: Sequence[Unit], estimates: Sequence[UnitEstimate], gpu: GpuPowerModel,
                            key: ProfileKey, device: DeviceSpec | None = None) -> EnergyProfile:
    """The preset's ``EnergyProfile`` of ``units`` from their roofline estimates (``cost_model.unit_estimates``).

    Each pass splits as the cost model times it (``UnitEstimate.to_cost``): forward ``W + A`` FLOPs against the
    forward bytes, dX ``W + 2A`` FLOPs (none without an input gradient), dW ``W`` FLOPs (none without
    parameters) against the dW bytes; compute seconds scale with ``f_max / f`` (module docstring).

    Args:
        units, estimates: the units and their estimates, in the same order.
        gpu: the power model; key: the profile key (``key.device`` should name the GPU).
        device: the roofline device (default ``gpu.device``).

    Raises:
        ValueError: when ``units`` and ``estimates`` differ in length.
    """
    if len(units) != len(estimates):
        raise ValueError(f"{len(units)} units but {len(estimates)} estimates")
    spec = device or gpu.device
    peak = spec.peak_flops * spec.efficiency
    rows = []
    for unit, est in zip(units, estimates):
        parts = {
            "forward": (est.weight_flops + est.attention_flops, est.forward_bytes),
            "input_grad": (est.weight_flops + 2 * est.attention_flops, est.forward_bytes) if est.input_grad else (0, 0),
            "weight_grad": (est.weight_flops, est.weight_grad_bytes) if est.params else (0, 0),
        }
        values: dict[str, tuple[float, ...]] = {}
        for name, (flops, nbytes) in parts.items():
            pairs = [gpu.pass_time_energy(flops / peak, nbytes / spec.hbm_bandwidth, f) for f in gpu.frequencies_mhz]
            values[f"{name}_s"] = tuple(p[0] for p in pairs)
            values[f"{name}_j"] = tuple(p[1] for p in pairs)
        rows.append(UnitEnergy(unit.name, **values))
    return EnergyProfile(key, gpu.name, gpu.blocking_w, gpu.frequencies_mhz, tuple(rows), "analytic")


ActionOption = tuple[int, float, float]
"""One way to run an action: ``(frequency_mhz, seconds, joules)``."""


def stage_action_options(plan: PipelinePlan, units: Sequence[Unit], profile: EnergyProfile, *,
                         split_backward: bool = False, checkpointed: Mapping[str, bool] | None = None,
                         output_bytes: Mapping[str, int] | None = None,
                         tp_link: P2PModel | None = None) -> dict[tuple[int, str], list[ActionOption]]:
    """Per stage action ``(stage, kind)``, its options at every profiled frequency (descending).

    Time and energy of a stage action are the sums over its units at that frequency, by the simulator's rules
    (``simulator.stage_costs_from_units``; energies are summed by the same function, given as the ``UnitCost``
    fields). ``checkpointed``: unit name -> whether it is activation-checkpointed (its backward runs its
    forward again).

    A tensor-parallel encoder stage's units (``plan.tensor_parallel``) are charged as each of its ``t`` ranks runs
    them, by ``evaluate_plan``'s rule (``cost.sharding.tensor_parallel_unit_costs`` on ``tp_link``, its default
    ``p2p``; None: free all-reduces): a layer's seconds and joules divided by ``t``; the seconds of its two
    all-reduces of ``output_bytes[unit]`` bytes (its output, bytes) per forward and per input gradient added at
    every clock, and their joules as those seconds at ``profile.blocking_power_w`` (W; the GPU waits on the
    link, as on a P2P receive). Megatron-LM's rule (Shoeybi et al. 2019, section 3).

    Raises:
        ValueError: when a unit of the plan is not in ``units`` or has no entry in ``profile``, or a unit of a
            tensor-parallel stage has no entry in ``output_bytes``.
    """
    by_name = {u.name: u for u in profile.units}
    missing = [n for s in plan.stages for n in s.units if n not in by_name]
    if missing:
        raise ValueError(f"energy profile has no entry for unit(s) {missing[:5]} of the plan")
    split = [n for s in plan.stages if s.tensor_parallel for n in s.units]
    unsized = [n for n in split if n not in (output_bytes or {})]
    if unsized:
        raise ValueError(f"tensor-parallel encoder stage unit(s) {unsized[:5]} have no output_bytes: their "
                         "all-reduces cannot be charged")
    marks = checkpointed or {}
    names = [u.name for u in units if u.name in by_name]
    kept = [u for u in units if u.name in by_name]
    out: dict[tuple[int, str], list[ActionOption]] = {}
    for index, frequency in enumerate(profile.frequencies_mhz):
        seconds = {n: by_name[n].at(index, False, marks.get(n, False)) for n in names}
        joules = {n: by_name[n].at(index, True, marks.get(n, False)) for n in names}
        if split:
            seconds, joules = _tensor_parallel_costs(plan, kept, seconds, joules, output_bytes or {}, tp_link,
                                                     profile.blocking_power_w)
        times = stage_costs_from_units(plan, kept, seconds, split_backward=split_backward)
        energies = stage_costs_from_units(plan, kept, joules, split_backward=split_backward)
        for key, value in times.items():
            out.setdefault(key, []).append((frequency, value, energies[key]))
    return out


def _tensor_parallel_costs(plan: PipelinePlan, units: Sequence[Unit], seconds: Mapping[str, UnitCost],
                           joules: Mapping[str, UnitCost], output_bytes: Mapping[str, int], link: P2PModel | None,
                           blocking_w: float) -> tuple[dict[str, UnitCost], dict[str, UnitCost]]:
    """``seconds`` and ``joules`` (unit name -> one frequency's whole-unit costs) per TP rank of the plan's
    tensor-parallel stages (:func:`stage_action_options`): ``tensor_parallel_unit_costs`` on ``link`` for the
    seconds; on no link (division only) for the joules, plus the all-reduce seconds at ``blocking_w``."""
    sized = {n: dataclasses.replace(c, output_bytes=output_bytes.get(n, 0)) for n, c in seconds.items()}
    timed = tensor_parallel_unit_costs(plan, units, sized, link)
    divided = tensor_parallel_unit_costs(plan, units, sized, None)
    energy = tensor_parallel_unit_costs(plan, units, dict(joules), None)
    for name, cost in timed.items():
        if cost is sized[name]:
            continue
        comm_f, comm_dx = cost.forward_s - divided[name].forward_s, cost.input_grad_s - divided[name].input_grad_s
        spent = energy[name]
        energy[name] = dataclasses.replace(spent, forward_s=spent.forward_s + blocking_w * comm_f,
                                           input_grad_s=spent.input_grad_s + blocking_w * comm_dx)
    return dict(timed), energy
