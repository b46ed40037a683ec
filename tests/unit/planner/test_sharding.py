"""TP, FSDP2 and checkpointing as cost transforms (planner.sharding), the sharded gradient synchronisation
(search_model.grad_sync_*) and the search over the degrees (planner.search_parallel): hand-worked values, bounds,
and the search against an exhaustive loop over the degrees."""

from __future__ import annotations

import dataclasses
import math

import pytest

from plait.planner.cost.types import OptimizerSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.search.layout import plan_layout
from plait.planner.search.model import allreduce_s, grad_sync_s, grad_sync_terms
from plait.planner.search.parallel import degree_options, plan_parallel
from plait.planner.cost.sharding import gather_s, rank_memory, shard_buffer_bytes, shard_costs, tp_allreduce_s
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.sharding import toy_costs, toy_units, vit_llm

LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=1e9)


def test_tp_splits_layers_and_charges_two_allreduces_each_way():
    units, costs = toy_units(), toy_costs()
    out = shard_costs(units, costs, ParallelDegrees(tp=2), tp_link=LINK)
    ar = 2 * 1e-5 + 100 / 1e9  # ring all-reduce of 100 bytes over 2 ranks: 2 latencies + 2 (1/2) 100 B
    assert tp_allreduce_s(100, 2, LINK) == pytest.approx(ar)
    layer = out[4]
    assert layer.forward_s == pytest.approx(0.5 + 2 * ar)
    assert layer.input_grad_s == pytest.approx(0.5 + 2 * ar)
    assert layer.weight_grad_s == pytest.approx(0.5)
    assert layer.param_bytes == 400
    assert layer.activation_bytes == 400 + 300  # 4 x 100 whole, the other 600 halved
    assert out[0] == costs[0] and out[5] == costs[5]  # embeddings, head: replicated
    # a measured split backward is mapped as dX and dW are: B divided plus the all-reduces, W divided
    measured = [dataclasses.replace(c, split_input_grad_s=0.75, split_weight_grad_s=1.25) for c in costs]
    layer = shard_costs(units, measured, ParallelDegrees(tp=2), tp_link=LINK)[4]
    assert layer.split_input_grad_s == pytest.approx(0.375 + 2 * ar) and layer.split_weight_grad_s == 0.625


def test_checkpointing_after_tp_recomputes_the_split_forward():
    units, costs = toy_units(), toy_costs()
    out = shard_costs(units, costs, ParallelDegrees(tp=2, checkpointing="full"), tp_link=LINK)
    layer = out[4]
    assert layer.recompute_s == pytest.approx(layer.forward_s)
    assert layer.activation_bytes == 100  # only the input kept
    tp_only = shard_costs(units, costs, ParallelDegrees(tp=2), tp_link=LINK)
    assert out[1] == tp_only[1] and out[1].recompute_s == 0  # the frozen encoder layer runs no backward: kept


def test_fsdp_divides_state_and_charges_only_the_gather_beyond_compute():
    units, costs = toy_units(), toy_costs()
    slow = P2PModel(latency_s=0.0, bandwidth_Bps=100.0)  # gathering 800 B over 4 ranks: 600 B -> 6 s
    out = shard_costs(units, costs, ParallelDegrees(dp_shard=4), shard_link=slow)
    assert gather_s(800, 4, slow) == pytest.approx(6.0)
    layer = out[4]
    assert layer.param_bytes == 200
    assert layer.forward_s == pytest.approx(6.0)  # max(1 s of compute, 6 s of gather)
    assert layer.forward_s + layer.backward_s(units[4]) == pytest.approx(6.0 + 6.0)
    fast = shard_costs(units, costs, ParallelDegrees(dp_shard=4), shard_link=LINK)
    assert fast[4].forward_s == 1.0 and fast[4].input_grad_s == 1.0


def test_rank_memory_is_the_state_over_the_shard_degree():
    units, costs = toy_units(), toy_costs()
    opt = OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8)
    whole = rank_memory(units, costs, dtype="float32", optimizer=opt)
    assert whole.parameters == 2 * 800 + 4 * 200
    trained = 800 + 3 * 200  # the LLM layer, embed, head and the projector train
    assert whole.gradients == trained and whole.optimizer == 2 * trained
    assert whole.activations == 3 * 50 + 1000  # projector, LLM embed, layer, head; the frozen encoder keeps nothing
    sharded = rank_memory(units, costs, ParallelDegrees(dp_shard=2), dtype="float32", optimizer=opt)
    assert sharded.parameters == (800 + 200) + (800 + 3 * 200) / 2  # frozen encoder whole, trainable units halved
    assert sharded.gradients == whole.gradients / 2 and sharded.optimizer == whole.optimizer / 2
    assert sharded.activations == whole.activations
    assert sharded.buffer == 800 + 200 + 800  # a layer and its neighbour's parameters + the trainable layer's gradient
    assert shard_buffer_bytes(units, costs, ParallelDegrees(), "float32", opt) == 0.0


def test_grad_sync_reduce_scatter_then_allreduce():
    assert grad_sync_s(1000, 4, LINK) == allreduce_s(1000, 4, LINK)
    latency, per_byte = grad_sync_terms(4, 4, LINK)  # pure FSDP2: reduce-scatter of the 4 x 250 B gradient
    assert latency == pytest.approx(3e-5) and per_byte * 250 == pytest.approx(3 * 250 / 1e9)
    latency, per_byte = grad_sync_terms(4, 2, LINK)  # HSDP 2 x 2: RS over 2 then AR over 2 of the shard
    assert latency == pytest.approx((1 + 2) * 1e-5) and per_byte == pytest.approx((1 + 1) / 1e9)
    with pytest.raises(ValueError, match="must divide"):
        grad_sync_terms(6, 4, LINK)


def test_degrees_validated_and_enumerated():
    with pytest.raises(ValueError, match="tp"):
        ParallelDegrees(tp=0)
    with pytest.raises(ValueError, match="checkpointing"):
        ParallelDegrees(checkpointing="some")
    options = degree_options(8, checkpointing=("none",))
    assert {(o.tp, o.dp_shard) for o in options} == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4),
                                                      (4, 1), (4, 2), (8, 1)}


def test_plain_plan_kept_when_it_fits():
    units, costs = vit_llm()
    plain = plan_layout(units, costs, 4, microbatches=8)
    chosen = plan_parallel(units, costs, 4, microbatches=8, machine=Machine(memory_cap=1e12))
    assert (chosen.tp, chosen.dp_shard, chosen.checkpointing) == (1, 1, "none")
    assert chosen.iteration_s == plain.iteration_s


def test_tight_cap_searched_exactly_over_the_degrees():
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)
    cap = 0.3 * sum(plan_layout(units, costs, 1, microbatches=8).stage_memory_bytes)  # the whole model: 1 rank
    machine = Machine(p2p=link, dp_link=link)
    common = dict(microbatches=8)
    with pytest.raises(ValueError):
        plan_layout(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap), **common)
    chosen = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap), **common)
    assert chosen.fits_memory and not (chosen.tp == chosen.dp_shard == 1 and chosen.checkpointing == "none")
    assert chosen.devices_used <= 4
    assert chosen.iteration_s >= chosen.lower_bound_s
    peak = max(chosen.stage_memory_bytes) + chosen.shard_buffer_bytes
    assert peak <= cap
    best = math.inf  # every option alone, as plan_parallel's per-option search
    for degrees in degree_options(4):
        try:
            one = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap),
                                space=SearchSpace(tp_degrees=[degrees.tp], dp_shard_degrees=[degrees.dp_shard],
                                                  checkpointing=[degrees.checkpointing], prefer_plain=False), **common)
        except ValueError:
            continue
        assert (one.tp, one.dp_shard, one.checkpointing) == (degrees.tp, degrees.dp_shard, degrees.checkpointing)
        if one.dp_shard > 1:  # at this cap FSDP2 without pipeline stages beats FSDP2 under stages for every option
            assert one.plan.num_ranks == 1 and one.dp * one.tp == 4, (degrees, one.plan.num_ranks, one.dp)
        best = min(best, one.iteration_s)
    assert chosen.iteration_s == pytest.approx(best)
    free = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=1e12),
                         space=SearchSpace(prefer_plain=False), **common)
    assert free.iteration_s <= plan_layout(units, costs, 4, machine=machine, **common).iteration_s


def test_first_bounds_stay_below_the_timing_with_tp_costs_and_sharded_gradients():
    # search_bounds' LB1 (with the reduce-scatter + all-reduce of search_model.grad_sync_terms) never exceeds a
    # candidate's 1F1B time + its gradient synchronisation, on TP-split costs with FSDP2 over 2 of 2 DP ranks.
    from plait.planner.search import bounds as search_bounds
    from plait.planner.search import candidates as search_candidates
    from plait.planner.search import model as search_model
    from plait.planner.pipeline.types import LAYOUTS
    from tests.helpers.search import random_model

    p2p, link = P2PModel(0.125, 64.0), P2PModel(0.0625, 32.0)
    for seed in range(6):
        units, costs, _ = random_model(seed, 2)
        units = consistent_units(units)
        split = shard_costs(units, costs, ParallelDegrees(tp=2, dp_shard=2), tp_link=link, shard_link=link)
        model = search_model.SearchModel(units, split, True, "bfloat16", OptimizerSpec(), dp_shard=2)
        parts = search_model.Partitions(model, None)
        for layout in LAYOUTS:
            stream = search_bounds.layout_stream(parts, layout, 2, 6, 4, p2p, link)
            for row, first in zip(stream.counts, stream.bounds):
                counts = search_candidates.counts_tuple(model, layout, row)
                stages = search_model.build_stages(parts, layout, counts, stream.nb, p2p)
                sync = search_candidates.sync_s(stages, 2, link, dp_shard=2)
                assert first <= search_candidates.time_1f1b(stages, stream.nb) + sync + 1e-9
