"""FSDP2 with pipeline stages in the planner (planner.sharding "FSDP2 under pipeline stages", planner.search_parallel):
hand-worked per-rank memory (whole parameters and gradients within the step, a shard of the optimizer state), and
the search choosing sharded pipeline stages where every-rank-a-DP-rank FSDP2 cannot run."""

from __future__ import annotations

import dataclasses
import pytest

from plait.planner.cost.types import ActionOverheads, OptimizerSpec, ParallelDegrees
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.planner.cost.sharding import (
    pipelined_optimizer, pipelined_overheads, pipelined_shard_costs, rank_memory, shard_costs,
)
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.sharding import toy_costs, vit_llm, toy_units

LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)


def test_pipelined_memory_is_whole_parameters_and_gradients_and_a_shard_of_the_state():
    units, costs = toy_units(), toy_costs()  # trainable: v.proj 200, llm.embed 200, llm.layers.0 800, llm.head 200 bytes
    mem = rank_memory(units, costs, ParallelDegrees(dp_shard=2), pipelined=True)  # bf16: 2 bytes per parameter
    assert mem.parameters == 2400  # frozen 1000 + trainable 1400, all whole
    assert mem.gradients == 1400  # bf16 gradients of the 700 trainable parameters, whole
    assert mem.optimizer == pytest.approx(700 * 12 / 2)  # AdamW state (fp32 master + moments) halved
    assert mem.activations == 50 + 50 + 1000 + 50 and mem.buffer == 0  # the frozen encoder runs no backward
    flat = rank_memory(units, costs, ParallelDegrees(dp_shard=2))  # without stages: everything of 1400 halved
    assert (flat.parameters, flat.gradients, flat.optimizer) == (1700, 700, pytest.approx(350 * 12))
    assert flat.buffer > 0
    assert rank_memory(units, costs, ParallelDegrees(), pipelined=True) == rank_memory(units, costs)


def test_pipelined_costs_keep_time_and_bytes_whole_and_shard_the_optimizer_step():
    units, costs = toy_units(), toy_costs()
    slow = P2PModel(latency_s=0.0, bandwidth_Bps=100.0)
    degrees = ParallelDegrees(tp=2, dp_shard=4, checkpointing="full")
    out = pipelined_shard_costs(units, costs, degrees, tp_link=slow)
    assert out == shard_costs(units, costs, ParallelDegrees(tp=2, checkpointing="full"), tp_link=slow)
    assert out[4].param_bytes == 400 and out[4].forward_s < 6.0  # TP-split, no per-microbatch all-gather
    assert pipelined_optimizer(OptimizerSpec(4.0, 12.0), 4) == OptimizerSpec(4.0, 3.0)
    assert pipelined_overheads(ActionOverheads(optimizer_s_per_byte=8e-9), 4).optimizer_s_per_byte == 2e-9


def test_search_shards_pipeline_stages_when_devices_outnumber_microbatches():
    # 8 devices, 4 microbatches: FSDP2 without stages needs dp = 8 > 4 microbatches, so only sharded stages can run.
    units, costs = vit_llm()
    machine = Machine(p2p=LINK, dp_link=LINK)
    common = dict(microbatches=4)
    plain = plan_layout(units, costs, 8, space=SearchSpace(dp_degrees=[2]), machine=machine, **common)
    cap = 0.8 * max(plain.stage_memory_bytes)
    with pytest.raises(ValueError):
        plan_layout(units, costs, 8, machine=dataclasses.replace(machine, memory_cap=cap),
                    space=SearchSpace(dp_degrees=[2]), **common)
    chosen = plan_parallel(units, costs, 8, machine=dataclasses.replace(machine, memory_cap=cap),
                           space=SearchSpace(tp_degrees=[1], dp_shard_degrees=[2], checkpointing=["none"],
                                             dp_degrees=[2]), **common)
    assert (chosen.dp, chosen.dp_shard, chosen.plan.num_ranks) == (2, 2, 4) and chosen.fits_memory
    assert chosen.shard_buffer_bytes == 0 and max(chosen.stage_memory_bytes) <= cap
    assert chosen.iteration_s >= chosen.lower_bound_s
    names = [u.name for u in units]
    for stage, static in zip(chosen.plan.stages, chosen.stage_static_bytes):  # the memory the runtime holds
        index = [names.index(n) for n in stage.units]
        mem = rank_memory([units[i] for i in index], [costs[i] for i in index], ParallelDegrees(dp_shard=2),
                          pipelined=True)
        assert static == pytest.approx(mem.state)
