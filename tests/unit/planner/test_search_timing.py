"""The layout search times candidates with the simulator's core: its fast paths agree with ``simulate()``
exactly (same stage costs, transfers and activation bytes), on 1F1B chains, multimodal plans and
interleaved / attached plans."""

from __future__ import annotations

import itertools
import random

from plait.planner.search import layout as search_module
from plait.planner.search import bounds as search_bounds
from plait.planner.search import candidates as search_candidates
from plait.planner.search import model as search_model
from plait.planner.cost.types import OptimizerSpec
from plait.planner.pipeline.plan import stage_ranks, synthetic_units
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.pipeline.interleaved import interleaved_1f1b, interleaved_orders
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import P2PModel, StageMemory
from plait.planner.types import UnitCost


def _model(seed: int, encoders: int, llm_units: int = 8):
    rng = random.Random(seed)
    spec = {f"enc{k}": [False] * rng.randint(1, 3) + [True] for k in range(encoders)}
    units = synthetic_units(spec, [rng.random() < 0.5 for _ in range(llm_units)])
    costs = [UnitCost(rng.randint(1, 16) / 8, rng.randint(0, 16) / 8, rng.randint(0, 16) / 8,
                      param_bytes=rng.randint(0, 64), activation_bytes=rng.randint(1, 16),
                      output_bytes=rng.randint(0, 32)) for _ in units]
    return units, costs


def _simulate_stages(parts, plan, stages, nb, p2p, schedule):
    """``simulate()`` of ``schedule`` with the candidate's own per-stage seconds, boundary bytes and
    activation bytes (what the search's timing reads)."""
    costs = {}
    for s in range(plan.num_stages):
        costs[(s, "F")], costs[(s, "B")] = stages.forward[s], stages.backward[s]
    boundary = {s: sum(parts.chunk(a, b).output for a, b in chunks) for s, chunks in enumerate(stages.chunks)}
    memory = {s: StageMemory(0, int(a)) for s, a in enumerate(stages.activation)}
    return simulate(schedule, costs, p2p=p2p, boundary_bytes=boundary, memory=memory)


def test_one_stage_per_rank_timing_equals_simulate():
    p2p = P2PModel(latency_s=0.125, bandwidth_Bps=64.0)
    checked = 0
    for seed, encoders in itertools.product(range(4), (0, 1, 2)):
        units, costs = _model(seed, encoders)
        model = search_model.SearchModel(units, costs, True, "bfloat16", OptimizerSpec())
        parts = search_model.Partitions(model, None)
        layouts = ("encoder_parallel", "encoders_colocated") if encoders > 1 else ("encoder_parallel",)
        for layout, nb, llm in itertools.product(layouts, (1, 3, 7), (1, 2, 4)):
            counts = (2,) * encoders + (llm,)
            stages = search_model.build_stages(parts, layout, counts, nb, p2p)
            best = search_candidates.Best(stages=stages, layout=layout, counts=counts)
            plan = search_module._plan_from_stages(model, best).replace(num_microbatches=nb)
            sim = _simulate_stages(parts, plan, stages, nb, p2p, one_f_one_b(plan))
            assert search_candidates.time_1f1b(stages, nb) == sim.makespan_s
            checked += 1
    assert checked == 4 * (9 + 9 + 18)


def test_one_stage_per_rank_timing_hand_worked():
    # Uniform 3-stage chain, F = 1, B = 2, free transfers: 1F1B takes (M + S - 1)(F + B) = (4 + 2) * 3.
    units = synthetic_units({}, [True] * 3)
    costs = [UnitCost(1.0, 0.0, 2.0, output_bytes=0)] * 3  # B = dW = 2 on every stage
    model = search_model.SearchModel(units, costs, True, "bfloat16", OptimizerSpec())
    parts = search_model.Partitions(model, None)
    stages = search_model.build_stages(parts, "encoder_parallel", (3,), 4, P2PModel())
    assert search_candidates.time_1f1b(stages, 4) == 18.0


def test_interleaved_timing_and_peaks_equal_simulate():
    p2p = P2PModel(latency_s=0.0625, bandwidth_Bps=32.0)
    checked = 0
    for seed, encoders in itertools.product(range(4), (1, 2)):
        units, costs = _model(seed, encoders, llm_units=12)
        model = search_model.SearchModel(units, costs, True, "bfloat16", OptimizerSpec())
        parts = search_model.Partitions(model, None)
        for v, attached, nb in itertools.product((1, 2, 3), (False, True), (2, 5)):
            if v == 1 and not attached:
                continue
            stream = search_bounds.Stream("encoder_parallel", 1, nb, None, None, v=v, attached=attached)
            counts = (1,) * encoders + (2,)
            found = search_candidates.interleaved_candidate(parts, stream, counts, p2p, None)
            ranks = stage_ranks(encoders, 2, v, attached)
            plan = search_model.plan_from_chunks(model, model.view, "encoder_parallel", found.stages.chunks, ranks)
            plan = plan.replace(num_microbatches=nb)
            makespan, live = search_candidates.time_orders(plan, interleaved_orders(plan, nb), found.stages, nb)
            sim = _simulate_stages(parts, plan, found.stages, nb, p2p, interleaved_1f1b(plan, nb))
            assert makespan == sim.makespan_s and found.time == makespan
            assert live == list(sim.peak_memory_bytes)
            checked += 1
    assert checked == 8 * 10
