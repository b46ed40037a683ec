"""FSDP2 without pipeline stages keeping each unit's gathered parameters from its forward to its backward
(``parallel.fsdp_reshard = "after_backward"``, ``ParallelDegrees.fsdp_reshard``): no backward all-gather charged,
every trainable unit's unsharded parameters charged in FSDP2's buffer; ``plan_parallel`` chooses it when the cap
allows and it is faster, the emitted ``[parallel]`` table and the auto-plan config carry it. Hand-worked values."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.cost.types import GradAccumulation, OptimizerSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.report import degrees_line, pp_toml
from plait.planner.search.parallel import degree_options, plan_parallel
from plait.planner.cost.sharding import (
    accumulated_grad_bytes, kept_param_bytes, rank_memory, shard_buffer_bytes, shard_costs,
)
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.sharding import toy_costs, vit_llm, toy_units

OPT = OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8)
KEPT = ParallelDegrees(dp_shard=2, fsdp_reshard="after_backward")


def test_kept_parameters_skip_the_backward_gather():
    units, costs = toy_units(), toy_costs()
    slow = P2PModel(latency_s=0.0, bandwidth_Bps=100.0)  # gathering 800 B over 4 ranks: 600 B -> 6 s
    kept = shard_costs(units, costs, ParallelDegrees(dp_shard=4, fsdp_reshard="after_backward"), shard_link=slow)
    freed = shard_costs(units, costs, ParallelDegrees(dp_shard=4), shard_link=slow)
    assert kept[4].forward_s == freed[4].forward_s == pytest.approx(6.0)  # the forward's gather: beyond 1 s compute
    assert kept[4].backward_s(units[4]) == pytest.approx(2.0)  # dX + dW, no second gather
    assert freed[4].backward_s(units[4]) == pytest.approx(6.0)
    assert kept[4].param_bytes == freed[4].param_bytes == 200
    assert kept[1] == freed[1] == costs[1]  # the frozen encoder layer: not sharded
    with pytest.raises(ValueError, match="fsdp_reshard must be one of"):
        ParallelDegrees(dp_shard=2, fsdp_reshard="never")


def test_buffer_holds_every_trainable_units_parameters():
    units, costs = toy_units(), toy_costs()
    # trainable parameters (fp32 = gradient bytes): projector 200, LLM embed 200, LLM layer 800, head 200
    assert kept_param_bytes(units, costs, KEPT, "float32", OPT) == 1400
    assert kept_param_bytes(units, costs, ParallelDegrees(dp_shard=2), "float32", OPT) == 0.0
    assert kept_param_bytes(units, costs, dataclasses.replace(KEPT, dp_shard=1), "float32", OPT) == 0.0
    # backward in reverse unit order: at the layer, the parameters of projector, embed and layer + its gradient
    assert shard_buffer_bytes(units, costs, KEPT, "float32", OPT) == (200 + 200 + 800) + 800
    assert shard_buffer_bytes(units, costs, KEPT, "float32", OPT, accumulate=True) == 1400 + 1400
    assert accumulated_grad_bytes(units, costs, KEPT, "float32", OPT) == 2800 - 2000
    tp = dataclasses.replace(KEPT, tp=2)  # the layer halved on each TP rank: 400 of parameters, 400 of gradient
    assert shard_buffer_bytes(units, costs, tp, "float32", OPT) == (200 + 200 + 400) + 400
    memory = {m: rank_memory(units, costs, KEPT, dtype="float32", optimizer=OPT,
                             accumulation=GradAccumulation(microbatches=m)) for m in (1, 3)}
    assert (memory[1].buffer, memory[3].buffer) == (2000, 2800)
    freed = rank_memory(units, costs, ParallelDegrees(dp_shard=2), dtype="float32", optimizer=OPT)
    assert memory[1].state == freed.state and freed.buffer == 1800  # only the transient buffer differs


def test_degree_options_offer_both_only_with_sharding():
    got = degree_options(2, [1], [1, 2], ["none"])
    assert got == [ParallelDegrees(1, 1, "none"), ParallelDegrees(1, 2, "none", "after_forward"),
                   ParallelDegrees(1, 2, "none", "after_backward")]
    assert degree_options(2, [1], [2], ["none"], ["after_forward"]) == [ParallelDegrees(1, 2, "none")]


def test_plan_parallel_keeps_parameters_gathered_when_the_cap_allows():
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-4, bandwidth_Bps=2e9)  # slow enough that the backward's gathers show
    machine = Machine(p2p=link, dp_link=link, host=None)
    space = SearchSpace(tp_degrees=[1], dp_shard_degrees=[2], checkpointing=["full"], prefer_plain=False,
                        dp_degrees=[2])
    common = dict(microbatches=2)
    freed = plan_parallel(units, costs, 2, space=dataclasses.replace(space, fsdp_reshard=["after_forward"]),
                          machine=machine, **common)
    kept = plan_parallel(units, costs, 2, space=dataclasses.replace(space, fsdp_reshard=["after_backward"]),
                         machine=machine, **common)
    assert (freed.plan.num_ranks, kept.plan.num_ranks, freed.fsdp_reshard, kept.fsdp_reshard) == (
        1, 1, "after_forward", "after_backward")
    assert kept.iteration_s < freed.iteration_s and kept.shard_buffer_bytes > freed.shard_buffer_bytes
    true = consistent_units(units)
    degrees = ParallelDegrees(1, 2, "full", "after_backward")
    assert kept.shard_buffer_bytes == pytest.approx(shard_buffer_bytes(true, costs, degrees))
    assert kept_param_bytes(true, costs, degrees) > 0.5 * sum(c.param_bytes for u, c in zip(true, costs)
                                                              if u.trainable)
    need = {c.fsdp_reshard: sum(c.stage_memory_bytes) + c.shard_buffer_bytes for c in (freed, kept)}  # one rank
    roomy = plan_parallel(units, costs, 2, machine=dataclasses.replace(machine, memory_cap=1.01 * need["after_backward"]),
                          space=space, **common)
    assert roomy.fsdp_reshard == "after_backward" and roomy.iteration_s == pytest.approx(kept.iteration_s)
    between = (need["after_forward"] + need["after_backward"]) / 2
    tight = plan_parallel(units, costs, 2, machine=dataclasses.replace(machine, memory_cap=between), space=space,
                          **common)
    assert tight.fsdp_reshard == "after_forward" and tight.iteration_s == pytest.approx(freed.iteration_s)
    assert "parameters kept gathered from forward to backward" in degrees_line(roomy)
    assert "kept gathered" not in degrees_line(tight)


def test_emitted_table_and_auto_plan_config_carry_the_choice():
    from plait.config.loader import config_from_dict, validate
    from plait.planner.search.layout import plan_layout
    from plait.train.apply_plan import apply_layout_choice
    from tests.helpers.jobs import tiny_config_dict

    fields, degrees = {"degree": 1}, dict(dp=1, dp_shard=2, tp=1, activation_checkpointing="none")
    assert pp_toml(fields, 2, degrees | {"fsdp_reshard": "after_backward"}).endswith(
        'tp = 1\ncp = 1\nfsdp_reshard = "after_backward"\n')  # no pipeline: no [parallel.pp]
    assert all("fsdp_reshard" not in pp_toml(fields, 2, degrees | {"fsdp_reshard": r})
               for r in ("auto", "after_forward"))  # a manual job's "auto" runs "after_forward"
    cfg = config_from_dict(tiny_config_dict("train.jsonl"))
    flat = plan_layout(toy_units(), toy_costs(), 2, microbatches=4, machine=Machine(dp_shard=2),
                       space=SearchSpace(dp_degrees=[2]))
    kept = apply_layout_choice(cfg, dataclasses.replace(flat, fsdp_reshard="after_backward"), toy_units())
    validate(kept)
    assert (kept.parallel.fsdp_reshard, kept.parallel.dp_shard, kept.parallel.pp.degree) == ("after_backward", 2, 1)
    assert apply_layout_choice(cfg, flat, toy_units()).parallel.fsdp_reshard == "after_forward"
    plain = plan_layout(toy_units(), toy_costs(), 2, microbatches=4, space=SearchSpace(dp_degrees=[2]))
    assert apply_layout_choice(cfg, plain, toy_units()).parallel.fsdp_reshard == "auto"  # no FSDP2: not its field


def test_a_jobs_own_fsdp_reshard_is_kept_by_plait_plan_and_auto_plan():
    from plait.config.loader import config_from_dict
    from plait.planner.search.auto_layout import AUTO_MACHINE, AUTO_SPACE, plan_auto_layout
    from plait.train.apply_plan import kept_degrees
    from tests.helpers.jobs import tiny_config_dict

    def cfg(**parallel):
        return config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))

    assert "fsdp_reshard" not in kept_degrees(cfg(dp_shard=2), 2)  # "auto": both searched
    kept = kept_degrees(cfg(dp_shard=2, fsdp_reshard="after_forward"), 2)
    assert kept == dict(tp_degrees=[1], dp_shard_degrees=[2], prefer_plain=False, fsdp_reshard=["after_forward"])
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-4, bandwidth_Bps=2e9)
    machine = dataclasses.replace(AUTO_MACHINE, p2p=link, dp_link=link)
    space = dataclasses.replace(AUTO_SPACE, virtual_stages=(1,), base_checkpointing="full")
    free = plan_auto_layout(units, costs, 2, 2, machine=machine,
                            space=dataclasses.replace(space, **kept_degrees(cfg(dp_shard=2), 2)))
    own = plan_auto_layout(units, costs, 2, 2, machine=machine, space=dataclasses.replace(space, **kept))
    assert (free.dp_shard, free.plan.num_ranks, free.fsdp_reshard) == (2, 1, "after_backward")  # faster, no cap
    assert (own.dp_shard, own.plan.num_ranks, own.fsdp_reshard) == (2, 1, "after_forward")
