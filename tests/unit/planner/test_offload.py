"""FSDP2 CPU offload in the planner (planner.offload, planner.search_parallel): the hand-worked device, host and
time figures of a small model, and the search falling back to offload only when nothing fits without it."""

from __future__ import annotations

import dataclasses
import pytest

from plait.planner.cost.offload import offload_cost
from plait.planner.cost.types import HostSpec, ParallelDegrees
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.sharding import toy_costs, vit_llm, toy_units


def test_offload_cost_hand_worked():
    host = HostSpec(memory_bytes=1e6, h2d_Bps=1e3, d2h_Bps=2e3, adamw_params_per_s=100)
    cost = offload_cost(toy_units(), toy_costs(), ParallelDegrees(dp_shard=2), host)
    assert cost.device_static_bytes == 200 + 800  # the frozen vision embed and layer, whole on the device
    assert cost.activation_bytes == 50 + 50 + 1000 + 50  # units that run a backward
    assert cost.buffer_bytes == (200 + 800) + 800  # embed + layer unsharded, the layer's gradient
    assert cost.host_bytes == 8 * (100 + 100 + 400 + 100)  # bf16 shard + bf16 grad + 12 state bytes: 16 / 2
    assert cost.trainable_shard_params == 350
    assert cost.copy_s_per_microbatch == pytest.approx(2 * 350 * 4 / 1e3 + 350 * 4 / 2e3)  # fp32 H2D x2, D2H
    assert cost.adamw_s == pytest.approx(3.5)
    assert cost.step_s(3, 0.5) == pytest.approx(3 * 3.5 + 2 * 0.5 + 3.5)
    assert cost.device_bytes == 1000 + 1150 + 1800
    with pytest.raises(ValueError, match="dp_shard > 1"):
        offload_cost(toy_units(), toy_costs(), ParallelDegrees(dp_shard=1), host)
    with pytest.raises(ValueError, match="h2d_Bps"):
        HostSpec(h2d_Bps=0)


def test_offload_searched_only_when_nothing_fits_without_it():
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)
    whole = sum(plan_layout(units, costs, 1, microbatches=8).stage_memory_bytes)
    machine = Machine(p2p=link, dp_link=link)
    assert plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=0.3 * whole),
                         microbatches=8).offload == "none"  # sharding fits
    cap = 0.1 * whole
    with pytest.raises(ValueError, match="no plan fits"):
        plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap, host=None), microbatches=8)
    chosen = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap), microbatches=8)
    assert chosen.offload == "cpu" and chosen.fits_memory and chosen.dp_shard > 1 and chosen.plan.num_ranks == 1
    cost = offload_cost(units, costs, ParallelDegrees(chosen.tp, chosen.dp_shard, chosen.checkpointing))
    assert max(chosen.stage_memory_bytes) + chosen.shard_buffer_bytes <= cap
    assert chosen.host_memory_bytes == cost.host_bytes <= HostSpec().memory_bytes
    assert chosen.offload_s == pytest.approx(cost.step_s(chosen.microbatches_per_replica, chosen.grad_sync_s))
    assert chosen.iteration_s == pytest.approx(chosen.makespan_s + chosen.grad_sync_s + chosen.offload_s)
    assert chosen.iteration_s >= chosen.lower_bound_s
    with pytest.raises(ValueError, match="with CPU offload"):
        plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=cap,
                                                                   host=HostSpec(memory_bytes=1e6)), microbatches=8)


def test_a_jobs_own_offload_searches_offloaded_plans_only():
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)
    whole = sum(plan_layout(units, costs, 1, microbatches=8).stage_memory_bytes)
    machine = Machine(p2p=link, dp_link=link)
    space = SearchSpace(tp_degrees=[1], dp_shard_degrees=[4], prefer_plain=False)
    free = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=0.3 * whole), space=space,
                         microbatches=8)
    own = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=0.3 * whole),
                        space=dataclasses.replace(space, offload="cpu"), microbatches=8)
    assert free.offload == "none" and free.dp_shard == 4  # fits without offload: not offloaded unless asked
    assert (own.offload, own.dp_shard, own.plan.num_ranks, own.fits_memory) == ("cpu", 4, 1, True)
    cost = offload_cost(units, costs, ParallelDegrees(own.tp, own.dp_shard, own.checkpointing, own.fsdp_reshard))
    assert own.host_memory_bytes == cost.host_bytes and own.offload_s > 0 and own.iteration_s > free.iteration_s
    # the same plan as the search offloads when nothing else fits (its degrees, its time)
    forced = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=0.1 * whole), space=space,
                           microbatches=8)
    assert forced.offload == "cpu" and forced.iteration_s == pytest.approx(
        plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=0.1 * whole),
                      space=dataclasses.replace(space, offload="cpu"), microbatches=8).iteration_s)
    uncapped = plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, host=None),
                             space=dataclasses.replace(space,
                                                       offload="cpu"), microbatches=8)  # no cap: the device unchecked
    assert uncapped.offload == "cpu" and uncapped.memory_cap is None and uncapped.host_memory_bytes == cost.host_bytes
    with pytest.raises(ValueError, match=r"no plan fits the memory cap with the job's CPU offload .*with CPU offload"):
        plan_parallel(units, costs, 4, machine=dataclasses.replace(machine, memory_cap=1.0),
                      space=dataclasses.replace(space, offload="cpu"), microbatches=8)
    with pytest.raises(ValueError, match="offload must be 'auto' or 'cpu', got 'none'"):
        plan_parallel(units, costs, 4, machine=machine, space=dataclasses.replace(space, offload="none"),
                      microbatches=8)


def test_a_jobs_own_offload_is_kept_by_plait_plan_and_auto_plan():
    from plait.config.loader import config_from_dict, validate
    from plait.planner.search.auto_layout import AUTO_MACHINE, AUTO_SPACE, plan_auto_layout
    from plait.train.apply_plan import apply_layout_choice, kept_degrees
    from tests.helpers.jobs import tiny_config_dict

    def cfg(**parallel):
        return config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))

    assert "offload" not in kept_degrees(cfg(dp_shard=2), 2)  # "none": offload only when nothing else fits
    job = cfg(dp_shard=2, offload="cpu", fsdp_reshard="after_backward")
    kept = kept_degrees(job, 2)
    assert kept == dict(tp_degrees=[1], dp_shard_degrees=[2], prefer_plain=False, fsdp_reshard=["after_backward"],
                        offload="cpu")
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-4, bandwidth_Bps=2e9)
    machine = dataclasses.replace(AUTO_MACHINE, p2p=link, dp_link=link)
    space = dataclasses.replace(AUTO_SPACE, virtual_stages=(1,), base_checkpointing="full")
    free = plan_auto_layout(units, costs, 2, 2, machine=machine,
                            space=dataclasses.replace(space, **kept_degrees(cfg(dp_shard=2), 2)))
    own = plan_auto_layout(units, costs, 2, 2, machine=machine, space=dataclasses.replace(space, **kept))
    assert (free.offload, own.offload, own.dp_shard, own.plan.num_ranks, own.fsdp_reshard) == (
        "none", "cpu", 2, 1, "after_backward")
    resolved = apply_layout_choice(job, own, units)  # the config auto plan trains with, the table plait plan prints
    validate(resolved)
    assert (resolved.parallel.offload, resolved.parallel.fsdp_reshard, resolved.parallel.dp_shard) == (
        "cpu", "after_backward", 2)
