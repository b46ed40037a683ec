"""The energy frontier (planner.energy_frontier / energy_exact / energy_profile): exact against brute force on
small DAGs, the fastest point equals the simulator's max-frequency iteration, replays reproduce every point."""

from __future__ import annotations

import itertools
import random

import pytest

from plait.planner.cost.analytic import unit_estimates
from plait.planner.cost.types import MicrobatchShape, ProfileKey
from plait.planner.energy.frontier import (
    energy_at_deadline,
    energy_frontier,
    energy_plan,
    replay_plan,
    schedule_energy_dag,
)
from plait.planner.energy.types import EnergyPlan, EnergyProfile
from plait.planner.energy.power_profile import (
    analytic_energy_profile, energy_profile_mismatch, gpu_preset, stage_action_options,
)
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.pipeline.interleaved import interleaved_1f1b
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import P2PModel

BLOCKING_W = 80.0


def _options(seed: int, stages: int, freqs: int) -> dict[tuple[int, str], list[tuple[int, float, float]]]:
    """Random per-stage F/B options: time ~ 1/x, energy ~ t (static/x + dynamic x^1.5), x = f / f_max."""
    rng = random.Random(seed)
    out = {}
    for s in range(stages):
        for kind in "FB":
            base = rng.uniform(1, 3) * (2 if kind == "B" else 1)
            out[(s, kind)] = [(1980 - 300 * i, base / (1 - 0.2 * i),
                               300 * base * (0.3 / (1 - 0.2 * i) + 0.7 * (1 - 0.2 * i) ** 1.5)) for i in range(freqs)]
    return out


def _brute_force(dag) -> list[tuple[float, float]]:
    """Pareto front of all frequency assignments: (time, energy), time ascending, energy strictly falling."""
    points = sorted(dag.evaluate(c) for c in itertools.product(*[range(len(o)) for o in dag.options]))
    front: list[tuple[float, float]] = []
    for t, e in points:
        if not front or e < front[-1][1] * (1 - 1e-12):
            front.append((t, e))
    return front


def _chain_schedule(stages: int, microbatches: int):
    plan = plan_pipeline(synthetic_units({}, [True] * stages), stages_per_module={"llm": stages})
    return one_f_one_b(plan, microbatches)


CASES = [(0, 2, 2, 3, 0.0), (1, 3, 2, 2, 0.1), (2, 2, 2, 2, 0.0), (3, 2, 3, 2, 0.05)]


@pytest.mark.parametrize("seed,stages,mbs,freqs,latency", CASES)
def test_exact_frontier_equals_brute_force(seed, stages, mbs, freqs, latency):
    schedule = _chain_schedule(stages, mbs)
    dag = schedule_energy_dag(schedule, _options(seed, stages, freqs), p2p=P2PModel(latency_s=latency),
                              blocking_w=BLOCKING_W)
    frontier = energy_frontier(dag, method="exact")
    brute = _brute_force(dag)
    assert len(frontier) == len(brute)
    for point, (t, e) in zip(frontier, brute):
        assert point.time_s == pytest.approx(t, rel=1e-6)
        assert point.energy_j == pytest.approx(e, rel=1e-6)


@pytest.mark.parametrize("seed,stages,mbs,freqs,latency", CASES[:2])
def test_lowtime_points_are_real_and_start_at_t_star(seed, stages, mbs, freqs, latency):
    """lowtime's points are assignments re-timed exactly: never below the brute-force front, and the fastest
    is the brute-force minimum time with the least energy the polish finds there."""
    schedule = _chain_schedule(stages, mbs)
    dag = schedule_energy_dag(schedule, _options(seed, stages, freqs), p2p=P2PModel(latency_s=latency),
                              blocking_w=BLOCKING_W)
    frontier = energy_frontier(dag, method="lowtime", steps=200)
    brute = _brute_force(dag)
    assert frontier[0].time_s == pytest.approx(brute[0][0], rel=1e-9)
    for point in frontier:
        best = min(e for t, e in brute if t <= point.time_s * (1 + 1e-9))
        assert point.energy_j >= best * (1 - 1e-9)
        assert dag.evaluate(point.choice) == pytest.approx((point.time_s, point.energy_j))


@pytest.mark.parametrize("method", ["exact", "lowtime"])
def test_fastest_point_is_the_simulated_max_frequency_iteration_and_replays_match(method):
    stages, freqs = 3, 2
    options = _options(7, stages, freqs)
    schedule = _chain_schedule(stages, 3)
    p2p, boundary = P2PModel(latency_s=0.01, bandwidth_Bps=1e9), {0: 2e7, 1: 3e7}
    dag = schedule_energy_dag(schedule, options, p2p=p2p, boundary_bytes=boundary, blocking_w=BLOCKING_W)
    frontier = energy_frontier(dag, method=method)
    top = simulate(schedule, {key: opts[0][1] for key, opts in options.items()}, p2p=p2p, boundary_bytes=boundary)
    assert frontier[0].time_s == pytest.approx(top.makespan_s, rel=1e-6)
    plan = energy_plan(dag, frontier, "test", 1980)
    assert EnergyPlan.from_json(plan.to_json()) == plan
    for point in plan.points:
        result, energy, freqs_used = replay_plan(schedule, options, plan, point, p2p=p2p, boundary_bytes=boundary,
                                                 blocking_w=BLOCKING_W)
        assert result.makespan_s == pytest.approx(point.iteration_time_s, rel=1e-6)
        assert energy == pytest.approx(point.energy_j, rel=1e-6)
        assert len(freqs_used) == len(dag.actions)


def test_interleaved_schedule_replays_and_straggler_point():
    from plait.planner.pipeline.plan import interleaved_ranks

    plan = plan_pipeline(synthetic_units({}, [True] * 4), stages_per_module={"llm": 4},
                         ranks=interleaved_ranks([], 2, 2), num_microbatches=2)
    schedule = interleaved_1f1b(plan)
    options = _options(11, 4, 2)
    dag = schedule_energy_dag(schedule, options, blocking_w=BLOCKING_W)
    frontier = energy_frontier(dag, method="lowtime", steps=100)
    top = simulate(schedule, {key: opts[0][1] for key, opts in options.items()})
    assert frontier[0].time_s == pytest.approx(top.makespan_s, rel=1e-6)
    energy_plan_ = energy_plan(dag, frontier, "test", 1980)
    for point in energy_plan_.points:
        result, energy, _ = replay_plan(schedule, options, energy_plan_, point, blocking_w=BLOCKING_W)
        assert (result.makespan_s, energy) == pytest.approx((point.iteration_time_s, point.energy_j), rel=1e-6)
    t_star = energy_plan_.points[0].iteration_time_s
    straggler = energy_plan_.point_for(1.2 * t_star)
    assert straggler.iteration_time_s <= 1.2 * t_star
    # waiting for the straggler at the fastest point costs more than running the straggler point
    waiting = energy_at_deadline(energy_plan_.points[0], 1.2 * t_star, 2, BLOCKING_W)
    assert energy_at_deadline(straggler, 1.2 * t_star, 2, BLOCKING_W) < waiting


def _layer_profile(hidden: int, tokens: int):
    from plait.planner.cost.arch import units_from_configs

    configs = {"llm": dict(model_type="llama", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)}
    units = units_from_configs(configs, {"llm": False})
    estimates = unit_estimates(units, configs, MicrobatchShape(tokens=tokens, seq_len=1024))
    key = ProfileKey({"m": hidden}, [[tokens]], "bfloat16", "h100", "0", "0")
    profile = analytic_energy_profile(units, estimates, gpu_preset("h100"), key)
    index = next(i for i, u in enumerate(units) if u.name.endswith("layers.1"))
    return units, profile, profile.units[index], estimates[index]


def test_analytic_profile_combines_with_the_cost_model():
    gpu = gpu_preset("h100")
    peak, bandwidth = gpu.device.peak_flops * gpu.device.efficiency, gpu.device.hbm_bandwidth
    # a compute-bound layer: time grows as f_max / f, the top clock draws the TDP
    units, profile, layer, est = _layer_profile(1024, 8192)
    compute, memory = (est.weight_flops + est.attention_flops) / peak, est.forward_bytes / bandwidth
    assert compute > memory
    assert layer.forward_s[0] == pytest.approx(compute)
    assert layer.forward_j[0] == pytest.approx(700.0 * compute)
    assert layer.forward_s[-1] == pytest.approx(compute * 1980 / gpu.frequencies_mhz[-1])
    assert layer.forward_j[3] < layer.forward_j[0]  # lower clocks save energy
    assert EnergyProfile.from_json(profile.to_json()) == profile
    assert energy_profile_mismatch(profile, profile.key, "H100") is None
    assert "gpu differs" in energy_profile_mismatch(profile, profile.key, "a100")
    plan = plan_pipeline(units, stages_per_module={"llm": 2})
    options = stage_action_options(plan, units, profile)
    assert [o[0] for o in options[(0, "F")]] == list(gpu.frequencies_mhz)
    stage0 = plan.stages[0].units
    assert options[(0, "F")][0][1] == pytest.approx(sum(u.forward_s[0] for u in profile.units if u.name in stage0))
    # a memory-bound layer: the same time at a lower clock, less energy (memory-bound activity beta)
    _, _, small, est = _layer_profile(256, 4096)
    compute, memory = (est.weight_flops + est.attention_flops) / peak, est.forward_bytes / bandwidth
    assert compute < memory * 1875 / 1980
    assert small.forward_s[1] == small.forward_s[0] == pytest.approx(memory)
    share = compute / memory
    assert small.forward_j[0] == pytest.approx(memory * (150 + 550 * (share + (1 - share) * 0.6)))
    assert small.forward_j[1] < small.forward_j[0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_preset("v100")
    schedule = _chain_schedule(2, 2)
    with pytest.raises(ValueError, match="no frequency options"):
        schedule_energy_dag(schedule, {(0, "F"): [(1, 1.0, 1.0)]})
    with pytest.raises(ValueError, match="message overheads"):
        schedule_energy_dag(schedule, _options(0, 2, 2), p2p=P2PModel(send_overhead_s=1e-3))
    dag = schedule_energy_dag(schedule, _options(0, 2, 2))
    with pytest.raises(ValueError, match="method"):
        energy_frontier(dag, method="greedy")


def test_deadline_points_and_refined_t_star_match_brute_force():
    """A deadline gets its own point (the least energy within it, as brute force finds on this small DAG), and the
    MILP refinement of lowtime's T* point reaches the brute-force least energy at T*."""
    schedule = _chain_schedule(3, 2)
    dag = schedule_energy_dag(schedule, _options(5, 3, 2), p2p=P2PModel(latency_s=0.05), blocking_w=BLOCKING_W)
    brute = _brute_force(dag)
    t_star = brute[0][0]
    deadline = 1.2 * t_star
    frontier = energy_frontier(dag, method="lowtime", steps=20, deadlines=[deadline], max_slowdown=1.3,
                               refine_s=5.0)
    assert frontier[0].time_s == pytest.approx(t_star, rel=1e-9)
    assert frontier[0].energy_j == pytest.approx(brute[0][1], rel=1e-6)
    best_within = min(e for t, e in brute if t <= deadline)
    ours = min(c.energy_j for c in frontier if c.time_s <= deadline)
    assert ours == pytest.approx(best_within, rel=1e-6)
    with pytest.raises(ValueError, match="max_slowdown"):
        energy_frontier(dag, max_slowdown=0.5)
