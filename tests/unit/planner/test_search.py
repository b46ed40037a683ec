"""Layout search: optimum vs an exhaustive enumeration built from the public partitioner, schedule and
simulator; frozen-aware vs frozen-unaware; the Megatron even split by hand; bounds; JSON; scale."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.search import layout as search_module
from plait.planner.search import bounds as search_bounds
from plait.planner.search import candidates as search_candidates
from plait.planner.search import model as search_model
from plait.models.plan_inputs import plan_configs
from plait.planner.cost.arch import units_from_configs
from plait.planner.cost.analytic import unit_activation_bytes, unit_costs, unit_static_bytes
from plait.planner.cost.types import DeviceSpec, MicrobatchShape, OptimizerSpec
from plait.planner.search.partitioner import partition_chain
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import LAYOUTS, P2PModel, StageMemory
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.search.layout import evaluate_plan, megatron_even_split, plan_layout
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.pipeline.simulator import boundary_bytes_from_units, simulate, stage_costs_from_units
from plait.planner.types import Unit, UnitCost
from tests.helpers.search import random_model


# ----- an independent exhaustive enumeration -----------------------------------------------------
def _ring(nbytes: float, dp: int, link: P2PModel | None) -> float:
    if link is None or dp == 1:
        return 0.0
    return 2 * (dp - 1) * link.latency_s + 2 * (dp - 1) / dp * nbytes / link.bandwidth_Bps


def _all_trainable(units):
    """The frozen-unaware planner's view: every unit trains; input gradients follow (LLM embedding after
    the encoders needs one)."""
    out, any_encoder, upstream, module = [], False, False, None
    for u in units:
        if u.module != module:
            module, upstream = u.module, (any_encoder if u.module == "llm" else False)
        out.append(Unit(u.name, u.module, u.kind, True, upstream))
        upstream = True
        any_encoder |= u.module != "llm"
    return out


def _time_plan(plan, units, cost_map, nb, p2p, link, dp):
    """(1F1B makespan + gradient all-reduce, peak memory) of ``plan`` with ``nb`` microbatches."""
    plan = plan.replace(num_microbatches=nb)
    by = {u.name: u for u in units}
    memory = {s.index: StageMemory(int(sum(unit_static_bytes(by[n], cost_map[n]) for n in s.units)),
                                   int(sum(unit_activation_bytes(by[n], cost_map[n]) for n in s.units)))
              for s in plan.stages}
    sim = simulate(one_f_one_b(plan), stage_costs_from_units(plan, units, cost_map), p2p=p2p,
                   boundary_bytes=boundary_bytes_from_units(plan, cost_map), memory=memory)
    grads = [0.0] * plan.num_ranks
    for s in plan.stages:
        grads[s.rank] += sum(cost_map[n].param_bytes for n in s.units if by[n].trainable)
    return sim.makespan_s + max(_ring(g, dp, link) for g in grads), max(sim.peak_memory_bytes)


def _splits(units, work, static, act, encoders, counts, nb, cap):
    """Chunk starts per module from partition_chain (1F1B in-flight min(depth, nb)); None if none fits."""
    splits = {}
    for module, s in zip(encoders + ["llm"], counts):
        idx = [i for i, u in enumerate(units) if u.module == module]
        extra = counts[-1] if module != "llm" else 0
        flights = [min(s - i + extra, nb) for i in range(s)]
        w = [work[i] for i in idx]
        try:
            ranges = partition_chain(w, s) if cap is None else partition_chain(
                w, s, [static[i] for i in idx], cap, 0.0, [act[i] for i in idx], flights)
        except ValueError:
            return None
        splits[module] = [units[idx[a]].name for a, _ in ranges[1:]]
    return splits


def _exhaustive(units, costs, devices, microbatches, *, cap=None, p2p=None, link=None, aware=True, dps=None,
                layouts=LAYOUTS):
    """Every candidate of the search space, timed: ``(planning-view time, true time, layout)`` of those that
    fit ``cap``: every layout, DP degree (divisor of devices up to microbatches), stage count per module
    (colocated encoders share one), min-bottleneck partitions; plus all modules on one rank at the largest
    DP degree."""
    view_units = list(units) if aware else _all_trainable(units)
    view_costs = list(costs) if aware else [
        UnitCost(c.forward_s, 0.0, c.input_grad_s + c.weight_grad_s, c.param_bytes, c.activation_bytes,
                 c.output_bytes) for c in costs]
    true_map = {u.name: c for u, c in zip(units, costs)}
    view_map = {u.name: c for u, c in zip(view_units, view_costs)}
    modules = list(dict.fromkeys(u.module for u in units))
    encoders = [m for m in modules if m != "llm"]
    sizes = [sum(u.module == m for u in units) for m in encoders + ["llm"]]
    work = [c.forward_s + c.backward_s(u) for u, c in zip(view_units, view_costs)]
    static = [unit_static_bytes(u, c) for u, c in zip(units, costs)]
    act = [unit_activation_bytes(u, c) for u, c in zip(units, costs)]
    dps = dps or [d for d in range(1, min(devices, microbatches) + 1) if devices % d == 0]
    out = []

    def add(view_plan, true_plan, nb, dp):
        tv, _ = _time_plan(view_plan, view_units, view_map, nb, p2p, link, dp)
        tt, peak = _time_plan(true_plan, units, true_map, nb, p2p, link, dp)
        if cap is None or peak <= cap:
            out.append((tv, tt, true_plan.layout if true_plan.num_ranks > 1 else "one rank"))

    for dp, layout in itertools.product(dps, layouts):
        nb, pipe = -(-microbatches // dp), devices // dp
        for counts in itertools.product(*[range(1, n + 1) for n in sizes]):
            if layout == "encoders_colocated" and len(set(counts[:-1])) > 1:
                continue
            ranks = sum(counts) if layout == "encoder_parallel" else (counts[0] if encoders else 0) + counts[-1]
            splits = _splits(units, work, static, act, encoders, counts, nb, cap) if ranks <= pipe else None
            if splits is not None:
                add(plan_pipeline(view_units, layout, splits=splits), plan_pipeline(units, layout, splits=splits),
                    nb, dp)
    dp, ranks = max(dps), [0, 0] if encoders else [0]
    add(plan_pipeline(view_units, "encoders_colocated", ranks=ranks),
        plan_pipeline(units, "encoders_colocated", ranks=ranks), -(-microbatches // dp), dp)
    return out


# ----- random small models with exact (dyadic) costs -------------------------------------------------


@settings(max_examples=14, deadline=None)
@given(seed=st.integers(0, 10**6), encoders=st.integers(0, 2), devices=st.integers(1, 6),
       microbatches=st.integers(1, 5))
def test_search_finds_the_exhaustive_optimum(seed, encoders, devices, microbatches):
    units, costs, rng = random_model(seed, encoders)
    p2p = P2PModel(rng.choice([0.0, 0.125]), rng.choice([None, 64.0]))
    link = rng.choice([None, P2PModel(0.0625, 32.0)])
    brute = _exhaustive(units, costs, devices, microbatches, p2p=p2p, link=link)
    choice = plan_layout(units, costs, devices, microbatches=microbatches, machine=Machine(p2p=p2p, dp_link=link))
    assert choice.iteration_s == pytest.approx(min(t for _, t, _ in brute), rel=1e-12)
    # The search's own (array) timing agrees with simulator.simulate on the chosen plan.
    assert choice.planned_iteration_s == pytest.approx(choice.iteration_s, rel=1e-12)
    assert choice.devices_used <= devices and choice.method == "plait"


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), devices=st.integers(2, 6), microbatches=st.integers(1, 5),
       fraction=st.floats(0.2, 1.0))
def test_search_with_memory_cap_finds_the_exhaustive_optimum(seed, devices, microbatches, fraction):
    units, costs, _ = random_model(seed, 1)
    memory = sum(unit_static_bytes(u, c) + microbatches * unit_activation_bytes(u, c) for u, c in zip(units, costs))
    cap = max(1.0, fraction * memory)
    brute = _exhaustive(units, costs, devices, microbatches, cap=cap)
    if not brute:
        with pytest.raises(ValueError, match="no layout fits"):
            plan_layout(units, costs, devices, microbatches=microbatches, machine=Machine(memory_cap=cap))
        return
    choice = plan_layout(units, costs, devices, microbatches=microbatches, machine=Machine(memory_cap=cap))
    assert choice.iteration_s == pytest.approx(min(t for _, t, _ in brute), rel=1e-12)
    assert choice.fits_memory and max(choice.stage_memory_bytes) <= cap


def test_colocated_layout_when_ranks_are_scarce():
    # Two small encoders and a heavy LLM on 3 ranks: encoder_parallel can only give the LLM one stage,
    # encoders_colocated gives it two.
    units = synthetic_units({"vision": [False, True], "audio": [False, True]}, [False, False, False, False])
    costs = [UnitCost(0.25, 0.25, 0.25, output_bytes=8)] * 4 + [UnitCost(2.0, 2.0, 2.0, output_bytes=8)] * 4
    brute = _exhaustive(units, costs, 3, 6, dps=[1])
    best = min(t for _, t, _ in brute)
    assert min(t for _, t, lay in brute if lay == "encoder_parallel") > 1.2 * best
    choice = plan_layout(units, costs, 3, microbatches=6, space=SearchSpace(dp_degrees=[1]))
    assert choice.layout == "encoders_colocated" and choice.iteration_s == pytest.approx(best, rel=1e-12)
    assert choice.stages_per_module == (("vision", 1), ("audio", 1), ("llm", 2))


def test_stage_bounds_hand_worked():
    # Two trainable stages, F = B = 1 each, 10 s per transfer, 4 microbatches (simulated makespan 50).
    units = synthetic_units({}, [True, True])
    costs = [UnitCost(1.0, 0.0, 1.0, output_bytes=1)] * 2
    p2p = P2PModel(latency_s=10.0)
    model = search_model.SearchModel(units, costs, True, "bfloat16", OptimizerSpec())
    stages = search_model.build_stages(search_model.Partitions(model, None), "encoder_parallel", (2,), 4, p2p)
    # Stage 0: its first B waits for F (1) + round trip 10 + 1 + 1 + 10; then 4 B and the 2 F left: 29.
    # Stage 1: first F at 1 + 10; busy 4 x 2; after its last B: 10 + stage 0's B: 11 + 8 + 11 = 30.
    assert search_bounds.stage_bounds(stages, 4) == [29.0, 30.0]
    plan = plan_pipeline(units, stages_per_module={"llm": 2}, num_microbatches=4)
    sim = simulate(one_f_one_b(plan), {(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 1.0, (1, "B"): 1.0}, p2p=p2p)
    assert search_candidates.time_1f1b(stages, 4) == sim.makespan_s == 50.0


def test_frozen_aware_beats_frozen_unaware_on_frozen_encoder_and_llm():
    # Frozen encoder (4 units) + trainable projector, frozen LLM (6 units): the unaware model weighs the
    # encoder 3 f instead of f and the LLM f + dX + dW instead of f + dX.
    rng = random.Random(7)
    units = synthetic_units({"vision": [False] * 4 + [True]}, [False] * 6)
    costs = [UnitCost(f, f, f, param_bytes=64, activation_bytes=8, output_bytes=16)
             for f in [rng.randint(2, 16) / 8 for _ in units]]
    aware = _exhaustive(units, costs, 4, 8, dps=[1])
    unaware = _exhaustive(units, costs, 4, 8, aware=False, dps=[1])
    best_view = min(v for v, _, _ in unaware)
    unaware_true = {t for v, t, _ in unaware if v == best_view}
    optimum = min(t for _, t, _ in aware)
    assert min(unaware_true) > 1.2 * optimum  # the instance separates them (computed by enumeration)
    c = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1]))
    b = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1], frozen_aware=False))
    assert c.iteration_s == pytest.approx(optimum, rel=1e-12)
    assert any(b.iteration_s == pytest.approx(t, rel=1e-12) for t in unaware_true)
    assert b.planned_iteration_s == pytest.approx(best_view, rel=1e-12)
    assert b.method == "frozen_unaware" and b.iteration_s > c.iteration_s


def test_bounds_never_exceed_the_simulated_time():
    # Every candidate of the vectorised first bound, refined second bound and array timing, vs simulate().
    for seed in range(6):
        units, costs, rng = random_model(seed, 2)
        p2p, link = P2PModel(0.125, 64.0), P2PModel(0.0625, 32.0)
        for aware in (True, False):
            model = search_model.SearchModel(units, costs, aware, "bfloat16", OptimizerSpec())
            parts = search_model.Partitions(model, None)
            for layout, dp in itertools.product(LAYOUTS, (1, 2)):
                stream = search_bounds.layout_stream(parts, layout, dp, 6, 4, p2p, link)
                for row, first in zip(stream.counts, stream.bounds):
                    counts = search_candidates.counts_tuple(model, layout, row)
                    stages = search_model.build_stages(parts, layout, counts, stream.nb, p2p)
                    sync = search_candidates.sync_s(stages, dp, link)
                    fast = search_candidates.time_1f1b(stages, stream.nb)
                    second = max(search_bounds.stage_bounds(stages, stream.nb))
                    assert first <= fast + sync + 1e-9 and second <= fast + 1e-9
                    view = consistent_units(units, all_trainable=not aware)
                    plan = search_module._plan_from_stages(model, search_candidates.Best(stages=stages, layout=layout))
                    splits = {m: [plan.stages[i].module_units(m)[0] for i in plan.module_stages(m)[1:]]
                              for m in plan.modules}
                    view_costs = costs if aware else [search_module._unaware_cost(c) for c in costs]
                    timed, _ = _time_plan(plan_pipeline(view, layout, splits=splits), view,
                                          {u.name: c for u, c in zip(view, view_costs)}, stream.nb, p2p, None, 1)
                    assert fast == pytest.approx(timed, rel=1e-12)


# ----- Megatron even split ---------------------------------------------------------------------------
def test_megatron_even_split_by_hand():
    # 3 vision units + 4 LLM units over 3 ranks: 3, 2, 2 units; rank 0 = vision, rank 1 = llm.0-1, rank 2.
    units = synthetic_units({"vision": [False, False, True]}, [False] * 4)
    costs = [UnitCost(1.0, 1.0, 1.0, output_bytes=0) for _ in units]
    choice = megatron_even_split(units, costs, 3, microbatches=2, dp=1)
    assert [s.units for s in choice.plan.stages] == [("vision.0", "vision.1", "vision.2"), ("llm.0", "llm.1"),
                                                     ("llm.2", "llm.3")]
    assert [s.rank for s in choice.plan.stages] == [0, 1, 2]
    # 4 units over 3 ranks with a rank crossing the module boundary: vision.0-1 | vision.2 + llm.0 | llm.1
    units = synthetic_units({"vision": [False, False, True]}, [False] * 2)
    choice = megatron_even_split(units, [UnitCost(1.0, 1.0, 1.0) for _ in units], 3, microbatches=2, dp=1)
    assert [(s.units, s.rank) for s in choice.plan.stages] == [
        (("vision.0", "vision.1"), 0), (("vision.2",), 1), (("llm.0",), 1), (("llm.1",), 2)]
    # Stage costs by hand: F = 2, 1, 1, 1; B: vision.2 (projector, trains, nothing upstream) dW = 1,
    # llm.0 and llm.1 dX = 1 each (frozen, downstream of the projector); vision.0-1 forward only.
    expected = simulate(one_f_one_b(choice.plan.replace(num_microbatches=2)),
                        {(0, "F"): 2.0, (1, "F"): 1.0, (1, "B"): 1.0, (2, "F"): 1.0, (2, "B"): 1.0, (3, "F"): 1.0,
                         (3, "B"): 1.0})
    assert choice.iteration_s == pytest.approx(expected.makespan_s)
    assert choice.stage_forward_s == (2.0, 1.0, 1.0, 1.0) and choice.stage_backward_s == (0.0, 1.0, 1.0, 1.0)
    assert choice.lower_bound_s == pytest.approx(2 * (1 + 1 + 2 + 2 + 2) / 3)


def test_megatron_picks_dp_by_unaware_model_and_search_matches_or_beats_it():
    units, costs, _ = random_model(3, 2)
    a = megatron_even_split(units, costs, 4, microbatches=4)
    options = [megatron_even_split(units, costs, 4, microbatches=4, dp=d) for d in (1, 2, 4) if 4 // d <= len(units)]
    assert a.planned_iteration_s == min(o.planned_iteration_s for o in options)
    assert a.method == "megatron_even"


# ----- flags, JSON, errors, scale ------------------------------------------------------------------------
def test_consistent_units_mark_the_llm_embedding_downstream_of_trainable_encoders():
    configs = plan_configs({
        "vision": {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 96,
                   "num_attention_heads": 4, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8},
        "llm": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": 100}})
    units = units_from_configs(configs, {"vision": True, "vision.projector": False, "llm": True})
    fixed = {u.name: u for u in consistent_units(units)}
    assert fixed["llm.embed_tokens"].needs_input_grad and not fixed["llm.embed_tokens"].trainable
    assert not fixed["encoders.vision.layers.1"].needs_input_grad
    assert all(fixed[u.name].needs_input_grad == u.needs_input_grad for u in units if u.name != "llm.embed_tokens")
    costs = unit_costs(units, configs, {"vision": MicrobatchShape(16), "llm": MicrobatchShape(64)}, DeviceSpec.h100())
    choice = plan_layout(units, costs, 4, microbatches=4, space=SearchSpace(dp_degrees=[1]))
    assert choice.plan.stages[choice.plan.llm_stages[0]].needs_input_grad
    unaware = consistent_units(units, all_trainable=True)
    assert all(u.trainable for u in unaware) and not unaware[0].needs_input_grad and unaware[1].needs_input_grad


def test_layout_choice_json_round_trip():
    units, costs, _ = random_model(11, 2)
    choice = plan_layout(units, costs, 5, microbatches=4, machine=Machine(p2p=P2PModel(0.125, 64.0), memory_cap=1e9))
    again = LayoutChoice.from_json(choice.to_json(indent=1))
    assert again == choice
    assert json.loads(again.to_json()) == json.loads(choice.to_json())
    assert again.stage_work_s == pytest.approx([f + b for f, b in zip(choice.stage_forward_s, choice.stage_backward_s)])
    with pytest.raises(ValueError, match="unknown field"):
        LayoutChoice.from_dict({**choice.to_dict(), "extra": 1})


def test_evaluate_plan_times_a_given_plan_with_true_costs():
    units = synthetic_units({"vision": [False, True]}, [True, True])
    costs = [UnitCost(1.0, 0.5, 0.5, param_bytes=10) for _ in units]
    plan = plan_pipeline(units, stages_per_module={"vision": 1, "llm": 2})
    choice = evaluate_plan(plan, units, costs, dp=2, microbatches=3, machine=Machine(dp_link=P2PModel(0.0, 10.0)))
    # Two microbatches on the busiest replica; each rank all-reduces 10 bytes: 2 * 1/2 * 10 / 10 = 1 s.
    stage_costs = {(0, "F"): 2.0, (0, "B"): 0.5, (1, "F"): 1.0, (1, "B"): 1.0, (2, "F"): 1.0, (2, "B"): 1.0}
    expected = simulate(one_f_one_b(plan.replace(num_microbatches=2)), stage_costs).makespan_s
    assert choice.makespan_s == pytest.approx(expected) and choice.grad_sync_s == pytest.approx(1.0)
    assert choice.iteration_s == pytest.approx(expected + 1.0) and choice.devices_used == 6


def test_bad_input_raises_value_error():
    units, costs, _ = random_model(1, 1)
    with pytest.raises(ValueError, match="devices"):
        plan_layout(units, costs, 0, microbatches=2)
    with pytest.raises(ValueError, match="microbatches"):
        plan_layout(units, costs, 2, microbatches=0)
    with pytest.raises(ValueError, match="layouts"):
        plan_layout(units, costs, 2, microbatches=2, space=SearchSpace(layouts=("ring",)))
    with pytest.raises(ValueError, match="dp_degrees"):
        plan_layout(units, costs, 4, microbatches=2, space=SearchSpace(dp_degrees=[3]))
    with pytest.raises(ValueError, match=f"{len(units)} units but {len(units) - 1} costs"):
        plan_layout(units, costs[:-1], 2, microbatches=2)
    with pytest.raises(ValueError, match="no unit belongs"):
        plan_layout([u for u in units if u.module != "llm"], costs[: sum(u.module != "llm" for u in units)], 2,
                    microbatches=2)
    with pytest.raises(ValueError, match="no layout fits"):
        plan_layout(units, [dataclass_cost(c, 1000) for c in costs], 2, microbatches=2,
                    machine=Machine(memory_cap=10.0))


def dataclass_cost(cost: UnitCost, param_bytes: int) -> UnitCost:
    return UnitCost(cost.forward_s, cost.input_grad_s, cost.weight_grad_s, param_bytes=param_bytes)


def test_search_for_1024_devices_gives_a_valid_plan():  # its wall time: bench/pipeline_plans.py
    # Llama-3-70B + a 48-layer 5120-wide ViT + Whisper-large-v3 encoder (VALM-L-like), frozen, 1024 GPUs.
    configs = plan_configs({
        "vision": {"model_type": "clip_vision_model", "hidden_size": 5120, "intermediate_size": 20480,
                   "num_hidden_layers": 48, "num_attention_heads": 40, "image_size": 224, "patch_size": 14},
        "audio": {"model_type": "whisper", "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                  "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500},
        "llm": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
    })
    frozen = {"vision": True, "vision.projector": False, "audio": True, "audio.projector": False, "llm": True}
    units = units_from_configs(configs, frozen)
    shapes = {"vision": MicrobatchShape(257), "audio": MicrobatchShape(1500), "llm": MicrobatchShape(2780, 2780)}
    device = DeviceSpec.h100()
    costs = unit_costs(units, configs, shapes, device)
    cap = 0.9 * device.memory_bytes
    machine = Machine(memory_cap=cap, p2p=P2PModel(device.link_latency, device.link_bandwidth),
                      dp_link=P2PModel(1e-5, 50e9))
    choice = plan_layout(units, costs, 1024, microbatches=256, machine=machine)
    assert choice.devices_used <= 1024 and choice.fits_memory and max(choice.stage_memory_bytes) <= cap
    assert choice.iteration_s >= choice.lower_bound_s
    assert choice.planned_iteration_s == pytest.approx(choice.iteration_s, rel=1e-9)
    baseline = megatron_even_split(units, costs, 1024, microbatches=256, dp=choice.dp, machine=Machine(memory_cap=cap))
    assert choice.iteration_s < baseline.iteration_s or not baseline.fits_memory
    assert math.isfinite(choice.bubble_fraction) and 0 <= choice.bubble_fraction < 1


# ----- plan / simulate commands ----------------------------------------------------------------------------
def test_plan_and_simulate_commands_on_the_demo_config(tmp_path):
    import io

    from plait.config.loader import load_config
    from plait.commands.plan.command import plan_command
    from plait.models.plan_inputs import build_plan_inputs
    from plait.commands.simulate import simulate_command
    from plait.planner.report import plan_from_json
    from plait.train.plots import read_chrome_trace

    # demo.toml: 16 samples per microbatch, max_length 256, 32 x 32 images in 4 x 4 patches (64, no CLS),
    # 150 audio frames pooled by 2, global batch 32.
    inputs = build_plan_inputs(load_config("configs/demo.toml"), "cpu")
    assert inputs.microbatches == 2 and inputs.dtype == "float32"
    assert inputs.shapes["llm"] == MicrobatchShape(tokens=16 * 256, seq_len=256)
    assert inputs.shapes["vision"].tokens == 16 * 64 and inputs.shapes["audio"].tokens == 16 * 150
    assert inputs.model_configs["audio"].output_pool == 2
    text = io.StringIO()
    choice = plan_command("configs/demo.toml", 4, tmp_path / "plan.json", device="cpu-preset", dp_degrees=[1], out=text)
    assert plan_from_json((tmp_path / "plan.json").read_text()) == choice  # LayoutChoice + [parallel.pp] text
    table = text.getvalue()
    assert table.count("\n    ") >= choice.plan.num_stages - 1 and f"DP {choice.dp}" in table
    paths = simulate_command(tmp_path / "plan.json", tmp_path / "sim", out=io.StringIO())
    events = read_chrome_trace(paths["trace"])["predicted"]
    assert max(e.end_s for e in events) == pytest.approx(choice.makespan_s, rel=1e-6)
    assert len(events) == sum(2 * (2 if s.runs_backward else 1) for s in choice.plan.stages)
    assert paths["png"].stat().st_size > 0
    with pytest.raises(FileNotFoundError):
        simulate_command(tmp_path / "missing.json", tmp_path)
    with pytest.raises(ValueError, match="unknown device"):
        plan_command("configs/demo.toml", 4, device="tpu")


# ----- interleaved and attached-encoder candidates ---------------------------------------------------------
def _big_llm_model(seed: int, encoders: int):
    """Like ``_model`` with an 8-12 unit LLM (room for several chunks per rank) and a heavy last unit."""
    rng = random.Random(seed)
    spec = {name: [False] * rng.randint(0, 2) + [rng.random() < 0.7] for name in ("vision", "audio")[:encoders]}
    llm = [rng.random() < 0.3 for _ in range(rng.randint(8, 12))]
    units = synthetic_units(spec, llm)
    costs = [UnitCost(rng.randint(1, 16) / 8, rng.randint(0, 16) / 8, rng.randint(0, 16) / 8,
                      param_bytes=rng.randint(0, 64), activation_bytes=rng.randint(0, 16),
                      output_bytes=rng.randint(0, 32)) for _ in units]
    costs[-1] = dataclasses.replace(costs[-1], forward_s=3.0)
    return units, costs


def test_interleaved_and_attached_candidates_bounded_and_timed_like_the_simulator():
    from plait.planner.pipeline.schedules import build_schedule

    for seed in range(4):
        units, costs = _big_llm_model(seed, 1 + seed % 2)
        p2p, link = P2PModel(0.125, 64.0), P2PModel(0.0625, 32.0)
        model = search_model.SearchModel(units, costs, True, "bfloat16", OptimizerSpec())
        parts = search_model.Partitions(model, None)
        true_map = {u.name: c for u, c in zip(model.units, costs)}
        for v, attached, dp in itertools.product((1, 2, 3), (False, True), (1, 2)):
            if attached:
                stream = search_bounds.attached_stream(parts, dp, 8, 6, p2p, v)
            else:
                stream = search_bounds.layout_stream(parts, "encoder_parallel", dp, 8, 6, p2p, link, v)
            if stream is None or (v == 1 and not attached):
                continue
            for row, bound in zip(stream.counts, stream.bounds):
                counts = search_candidates.counts_tuple(model, stream.layout, row)
                total, stages = search_candidates.interleaved_candidate(parts, stream, counts, p2p, link)
                assert bound <= total + 1e-9
                best = search_candidates.Best(stages=stages, layout=stream.layout, counts=counts, v=v, attached=attached)
                plan = search_module._plan_from_stages(model, best).replace(num_microbatches=stream.nb)
                assert plan.virtual_stages == v and plan.num_ranks == counts[-1] + (0 if attached else sum(counts[:-1]))
                name = "interleaved_1f1b" if v > 1 or attached else "1f1b"
                sim = simulate(build_schedule(plan, name), stage_costs_from_units(plan, model.units, true_map),
                               p2p=p2p, boundary_bytes=boundary_bytes_from_units(plan, true_map))
                grads = [0.0] * plan.num_ranks
                for s in plan.stages:
                    grads[s.rank] += sum(true_map[n].param_bytes for n in s.units
                                         if model.units[[u.name for u in model.units].index(n)].trainable)
                assert total == pytest.approx(sim.makespan_s + max(_ring(g, dp, link) for g in grads), rel=1e-12)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), encoders=st.integers(1, 2), devices=st.integers(2, 8),
       microbatches=st.integers(1, 8), capped=st.booleans())
def test_more_schedules_never_hurt_and_times_agree(seed, encoders, devices, microbatches, capped):
    units, costs = _big_llm_model(seed, encoders)
    cap = None
    if capped:
        cap = 0.5 * sum(unit_static_bytes(u, c) + 2 * unit_activation_bytes(u, c) for u, c in zip(units, costs))
    machine = Machine(memory_cap=cap, p2p=P2PModel(0.125, 64.0))
    common = dict(microbatches=microbatches)
    try:
        plain = plan_layout(units, costs, devices, machine=machine, **common)
    except ValueError:
        plain = None
    wide = plan_layout(units, costs, devices, space=SearchSpace(virtual_stages=(1, 2, 4), attach_encoders=True),
                       machine=machine, **common) \
        if plain is not None else None
    if plain is None:
        return
    assert wide.iteration_s <= plain.iteration_s * (1 + 1e-12)
    assert wide.planned_iteration_s == pytest.approx(wide.iteration_s, rel=1e-12)
    assert wide.fits_memory and (cap is None or max(wide.stage_memory_bytes) <= cap or wide.plan.virtual_stages > 1)
    shared = wide.plan.num_ranks < wide.plan.num_stages and wide.plan.num_ranks > 1
    assert wide.schedule == ("interleaved_1f1b" if shared else "1f1b")
    assert LayoutChoice.from_json(wide.to_json()) == wide


def test_plan_layout_rejects_bad_virtual_stages():
    units, costs = _big_llm_model(0, 1)
    for bad in ((), (0,), (1.5,)):
        with pytest.raises(ValueError, match="virtual_stages"):
            plan_layout(units, costs, 4, microbatches=4, space=SearchSpace(virtual_stages=bad))


def test_memory_cap_is_checked_per_rank_not_per_stage_for_interleaved_plans():
    """Four equal trainable LLM units without activations: a stage of one unit holds ``S`` bytes, a rank of two
    interleaved chunks ``2 S``. With the cap at ``1.5 S`` every stage fits but no interleaved rank does."""
    from plait.planner.report import rank_peak_memory_bytes

    units = synthetic_units({}, [True] * 4)
    costs = [UnitCost(1.0, 1.0, 1.0, param_bytes=100, activation_bytes=0, output_bytes=8) for _ in units]
    static = unit_static_bytes(units[0], costs[0], "float32")
    cap = 1.5 * static
    plan = plan_pipeline(units, stages_per_module={"llm": 4}, ranks=[0, 1, 0, 1])
    given = evaluate_plan(plan, units, costs, dp=1, microbatches=4, schedule="interleaved_1f1b",
                          machine=Machine(memory_cap=cap, dtype="float32"))
    assert max(given.stage_memory_bytes) == pytest.approx(static) and static <= cap
    assert rank_peak_memory_bytes(given) == (2 * static, 2 * static)
    assert not given.fits_memory
    machine = Machine(dtype="float32")
    space = SearchSpace(dp_degrees=[1], virtual_stages=(2,))
    common = dict(microbatches=4)
    uncapped = plan_layout(units, costs, 2, machine=machine, space=space,
                           **common)  # without a cap the interleaved plan is the one chosen
    assert uncapped.plan.virtual_stages == 2 and uncapped.plan.num_ranks == 2
    with pytest.raises(ValueError, match="no layout fits"):
        plan_layout(units, costs, 2, machine=dataclasses.replace(machine, memory_cap=cap), space=space, **common)
    wide = plan_layout(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap),
                       space=dataclasses.replace(space, virtual_stages=(1, 2)), **common)
    assert wide.plan.num_ranks == 4 and max(rank_peak_memory_bytes(wide)) <= cap


def test_the_search_weighs_zero_bubble_schedules_and_keeps_the_fastest_that_fits():
    """A trainable 4-unit LLM on 4 ranks, 8 microbatches, per unit F 1, dX 1, dW 0.5 s (the first unit needs no
    dX): ZB-H2 reaches the last rank's bound, 3 x F + 8 x 2.5 = 23 s, at 7 microbatches in flight (70 bytes);
    ZB-H1 24 s at 1F1B's 4 (40 bytes); 1F1B 26.5 s. The search keeps the fastest schedule that fits the cap."""
    units = synthetic_units({}, [True] * 4)
    costs = [UnitCost(1.0, 1.0, 0.5, param_bytes=0, activation_bytes=10, output_bytes=0) for _ in units]
    space = SearchSpace(dp_degrees=[1], schedules=("1f1b", "zb_h1", "zb_h2"))
    one = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1]))
    assert (one.schedule, one.plan.num_ranks, one.iteration_s) == ("1f1b", 4, 26.5)
    for cap, schedule, seconds in ((None, "zb_h2", 23.0), (70, "zb_h2", 23.0), (69, "zb_h1", 24.0)):
        choice = plan_layout(units, costs, 4, microbatches=8, space=space, machine=Machine(memory_cap=cap))
        assert (choice.schedule, choice.iteration_s, choice.plan) == (schedule, seconds, one.plan)
        assert choice.fits_memory and choice.bubble_fraction < one.bubble_fraction
    with pytest.raises(ValueError, match="at least one schedule"):
        SearchSpace(schedules=())


def test_a_zero_bubble_plan_prints_and_simulates_its_b_and_w_apart():
    """The plan table names the schedule with the bubble; the report's simulation of the choice (B and W from
    ``stage_weight_grad_s``) gives the planned makespan back."""
    from plait.planner.report import format_plan, simulate_choice

    units = synthetic_units({}, [True] * 4)
    costs = [UnitCost(1.0, 1.0, 0.5, param_bytes=0, activation_bytes=10, output_bytes=0) for _ in units]
    choice = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1], schedules=("zb_h2",)))
    assert choice.stage_weight_grad_s == (0.5, 0.5, 0.5, 0.5) and choice.stage_backward_s == (0.5, 1.5, 1.5, 1.5)
    assert simulate_choice(choice).makespan_s == choice.makespan_s == 23.0
    assert "bubble 21.7% under zb_h2; " in format_plan(choice)
    assert LayoutChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


def test_the_v_shape_schedule_is_weighed_on_the_llm_cut_in_a_v():
    """8 uniform LLM units (F 1 s, B 1 s, W 0.5 s) on 4 ranks, 8 microbatches: 1F1B 54 s and ZB-H1 48 s on 4 stages of
    2 units; ZB-V cuts the LLM into 8 one-unit stages in a V (rank ``i`` holds stages ``i`` and ``7 - i``) and takes
    ``M (F + B + W) + (p - 1) F / 2 = 40 + 3 = 43`` s (every rank's first B waits one chunk round more than the
    chain bound, a second here), at 1F1B's activation peak. The report's simulation gives it back; the
    ``[parallel.pp]`` fields run it (``virtual_stages = 2``, ``zb_v``)."""
    from plait.config.loader import pipeline_plan_kwargs
    from plait.config.schema import PipelineConfig
    from plait.planner.report import simulate_choice
    from plait.planner.search.auto_layout import layout_pp_fields

    units = synthetic_units({}, [True] * 8)
    costs = [UnitCost(1.0, 1.0, 0.5, param_bytes=0, activation_bytes=10, output_bytes=0) for _ in units]
    h1 = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1], schedules=("1f1b", "zb_h1")))
    v = plan_layout(units, costs, 4, microbatches=8,
                    space=SearchSpace(dp_degrees=[1], schedules=("1f1b", "zb_h1", "zb_v")))
    assert (h1.schedule, h1.iteration_s, v.schedule, v.iteration_s) == ("zb_h1", 48.0, "zb_v", 43.0)
    assert [s.rank for s in v.plan.stages] == [0, 1, 2, 3, 3, 2, 1, 0]
    def rank_bytes(c):
        return max(sum(c.stage_memory_bytes[s.index] for s in c.plan.stages if s.rank == r)
                   for r in range(c.plan.num_ranks))
    assert rank_bytes(v) == rank_bytes(h1) == 80  # rank 0: 7 + 1 chunk microbatches of 10 B; 4 stage ones of 20 B
    assert simulate_choice(v).makespan_s == v.makespan_s == 43.0
    fields = layout_pp_fields(v, units)
    assert (fields["virtual_stages"], fields["schedule"], fields["stages"]) == (2, "zb_v", {"llm": 8})
    pp = PipelineConfig(**{k: fields[k] for k in ("degree", "layout", "stages", "virtual_stages", "schedule")})
    assert pipeline_plan_kwargs(pp, [])["ranks"] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert LayoutChoice.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    assert v.schedules_weighed == (("zb_v", 43.0, True), ("zb_h1", 48.0, True), ("1f1b", 54.0, True))


def test_the_plan_says_which_schedules_were_weighed_and_which_exceed_the_cap():
    """ZB-H2 (46 s) holds up to 7 stage microbatches of 20 B: over a 100-B cap, so ZB-V (43 s, 80 B) is chosen and the
    plan lists every schedule timed with its iteration, ZB-H2 apart."""
    from plait.planner.report import format_plan

    units = synthetic_units({}, [True] * 8)
    costs = [UnitCost(1.0, 1.0, 0.5, param_bytes=0, activation_bytes=10, output_bytes=0) for _ in units]
    space = SearchSpace(dp_degrees=[1], schedules=("1f1b", "zb_h1", "zb_h2", "zb_v"))
    choice = plan_layout(units, costs, 4, microbatches=8, space=space, machine=Machine(memory_cap=100))
    assert choice.schedules_weighed == (("zb_v", 43.0, True), ("zb_h2", 46.0, False), ("zb_h1", 48.0, True),
                                        ("1f1b", 54.0, True))
    assert ("schedules weighed, the fastest that fits memory chosen: zb_v 43000.00 ms (chosen), zb_h1 48000.00 ms, "
            "1f1b 54000.00 ms; over the memory cap: zb_h2 46000.00 ms") in format_plan(choice)
    alone = plan_layout(units, costs, 4, microbatches=8, space=SearchSpace(dp_degrees=[1]))
    assert alone.schedules_weighed == () and "schedules weighed" not in format_plan(alone)


@pytest.mark.parametrize("encoders, seed, devices, microbatches", [(0, 12, 2, 8), (0, 7, 4, 8), (2, 3, 3, 6),
                                                                  (1, 5, 4, 16), (2, 9, 2, 8)])
def test_weighing_zero_bubble_schedules_never_gives_a_slower_plan(encoders, seed, devices, microbatches):
    """Interleaved and attached plans searched too: the zero-bubble schedules are weighed on the best plan of one
    stage per rank as well, and kept only when faster (the first case: interleaved 1F1B's 40.375 s, beaten by
    ZB-H2 on the best plan of one stage per rank, 39 s)."""
    units, costs, _ = random_model(seed, encoders)
    space = SearchSpace(virtual_stages=(1, 2), attach_encoders=True, dp_degrees=[1])
    base = plan_layout(units, costs, devices, microbatches=microbatches, space=space)
    weighed = plan_layout(units, costs, devices, microbatches=microbatches,
                          space=dataclasses.replace(space, schedules=("1f1b", "zb_h1", "zb_h2")))
    assert weighed.iteration_s <= base.iteration_s
    assert weighed.schedule == base.schedule or weighed.schedule in ("zb_h1", "zb_h2")
    if (encoders, seed) == (0, 12):
        assert (base.schedule, base.iteration_s, weighed.schedule, weighed.iteration_s) == (
            "interleaved_1f1b", 40.375, "zb_h2", 39.0)
