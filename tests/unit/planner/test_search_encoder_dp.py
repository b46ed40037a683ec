"""Per-encoder data-parallel degrees in the search (search.encoder_dp): a heavy frozen encoder beside a light LLM gets
replicas when they are faster, the plan's reported time is the simulator's, a trainable encoder pays its all-reduce over
its replicas x the DP replicas, and the homogeneous plan stays a candidate."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from plait.planner.pipeline.plan import plan_pipeline, stage_ranks, synthetic_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.report import format_plan, pp_toml
from plait.planner.search.auto_layout import layout_pp_fields
from plait.planner.search.encoder_dp import degree_vectors, encoder_dp_bounds, replicated_costs
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.model import allreduce_s
from plait.planner.search.parallel import plan_parallel
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.types import UnitCost

GB = 10**9
LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=5e9)
MICROBATCHES = 8


def _heavy_encoder(trainable: bool = False):
    """A vision tower of 2 s per microbatch (one stage: its projector is joined to it) and a 0.2 s LLM, each too big
    to share a rank with the other under a 10 GB cap: on 3 devices one encoder rank is the bottleneck."""
    units = list(synthetic_units({"vision": [trainable, True]}, [False, False]))
    units[1] = dataclasses.replace(units[1], joined=True)
    tower = UnitCost(2.0, 1.0, 1.0, param_bytes=(GB // 2 if trainable else 6 * GB), activation_bytes=GB,
                     output_bytes=10**6)
    projector = UnitCost(0.01, 0.01, 0.01, param_bytes=10**6, activation_bytes=10**6, output_bytes=10**6)
    layer = UnitCost(0.1, 0.1, 0.1, param_bytes=3 * GB, activation_bytes=10**8, output_bytes=10**6)
    return units, [tower, projector, layer, layer]


def test_frozen_heavy_encoder_gets_two_replicas_and_is_faster():
    units, costs = _heavy_encoder()
    machine = Machine(memory_cap=10 * GB, p2p=LINK, dp_link=LINK)
    homogeneous = plan_layout(units, costs, 3, microbatches=MICROBATCHES, machine=machine)
    chosen = plan_layout(units, costs, 3, microbatches=MICROBATCHES, machine=machine,
                         space=SearchSpace(encoder_dp=(("vision", 4),)))
    assert homogeneous.encoder_dp == () and homogeneous.plan.num_ranks == 3
    assert chosen.encoder_dp == (("vision", 2),)
    assert [(s.rank, s.replica, s.replicas) for s in chosen.plan.stages] == [(0, 0, 2), (1, 1, 2), (2, 0, 1)]
    assert chosen.stages_per_module == (("vision", 1), ("llm", 1)) and chosen.devices_used == 3
    # the encoder rank was the bottleneck (8 x 2.01 s); two replicas halve it
    assert homogeneous.iteration_s == pytest.approx(16.54084, rel=1e-6)
    assert chosen.iteration_s == pytest.approx(8.47544, rel=1e-6)
    again = evaluate_plan(chosen.plan, units, costs, dp=chosen.dp, microbatches=MICROBATCHES, devices=3,
                          machine=machine)
    assert again.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12) and again.fits_memory
    assert chosen.planned_iteration_s == pytest.approx(chosen.iteration_s, rel=1e-9)  # the search's model agrees
    # the complete search (TP, FSDP2, checkpointing, every divisor) takes it too
    complete = plan_parallel(units, costs, 3, microbatches=MICROBATCHES, machine=machine,
                             space=SearchSpace(encoder_dp=(("vision", 4),)))
    assert complete.encoder_dp == (("vision", 2),)
    assert complete.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12)


def test_a_replica_holds_the_whole_encoder_and_a_share_of_its_activations():
    units, costs = _heavy_encoder()
    machine = Machine(memory_cap=10 * GB, p2p=LINK, dp_link=LINK)
    plan = plan_pipeline(units, "encoder_parallel", replicas={"vision": 2})
    one = evaluate_plan(plan_pipeline(units, "encoder_parallel"), units, costs, dp=1, microbatches=MICROBATCHES,
                        machine=machine)
    two = evaluate_plan(plan, units, costs, dp=1, microbatches=MICROBATCHES, machine=machine)
    assert two.stage_static_bytes[:2] == (one.stage_static_bytes[0],) * 2
    assert two.stage_activation_bytes[0] == pytest.approx(one.stage_activation_bytes[0] / 2, abs=1)
    assert two.stage_boundary_bytes[0] == one.stage_boundary_bytes[0] / 2
    assert two.stage_forward_s[0] == pytest.approx(one.stage_forward_s[0] / 2)


def test_trainable_encoder_pays_its_all_reduce_over_replicas_times_dp():
    units, costs = _heavy_encoder(trainable=True)
    machine = Machine(memory_cap=None, p2p=LINK, dp_link=LINK)
    plan = plan_pipeline(units, "encoder_parallel", replicas={"vision": 2})
    choice = evaluate_plan(plan, units, costs, dp=2, microbatches=MICROBATCHES, machine=machine)
    grads = costs[0].param_bytes + costs[1].param_bytes  # the whole tower and projector on each replica rank
    expected = allreduce_s(grads, 4, LINK)  # 2 replicas x dp 2
    assert expected > allreduce_s(grads, 2, LINK) > 0
    assert choice.grad_sync_s == pytest.approx(expected, rel=1e-12)
    assert choice.iteration_s == pytest.approx(choice.makespan_s + expected, rel=1e-12)
    # frozen: nothing of the tower to all-reduce, only the projector's
    units_f, costs_f = _heavy_encoder()
    frozen = evaluate_plan(plan_pipeline(units_f, "encoder_parallel", replicas={"vision": 2}), units_f, costs_f, dp=2,
                           microbatches=MICROBATCHES, machine=machine)
    assert frozen.grad_sync_s == pytest.approx(allreduce_s(costs_f[1].param_bytes, 4, LINK), rel=1e-12)


def test_slow_all_reduce_keeps_the_homogeneous_plan():
    """When a trainable encoder's all-reduce over its replicas costs more than the replicas save, the search keeps
    every degree 1 and its time is the homogeneous search's."""
    units, costs = _heavy_encoder(trainable=True)
    slow = P2PModel(latency_s=1e-5, bandwidth_Bps=2e7)  # 0.5 GB of gradients over 2 replicas: 25 s
    machine = Machine(memory_cap=10 * GB, p2p=LINK, dp_link=slow)
    homogeneous = plan_layout(units, costs, 3, microbatches=MICROBATCHES, machine=machine)
    chosen = plan_layout(units, costs, 3, microbatches=MICROBATCHES, machine=machine,
                         space=SearchSpace(encoder_dp=(("vision", 2),)))
    forced = evaluate_plan(plan_pipeline(units, "encoder_parallel", replicas={"vision": 2}), units, costs, dp=1,
                           microbatches=MICROBATCHES, machine=machine)
    assert forced.iteration_s > homogeneous.iteration_s
    assert chosen.encoder_dp == () and chosen.iteration_s == homogeneous.iteration_s


def test_replicated_costs_and_degree_vectors():
    units, costs = _heavy_encoder()
    scaled = replicated_costs(units, costs, {"vision": 4})
    assert scaled[0].forward_s == 0.5 and scaled[0].activation_bytes == GB // 4 and scaled[0].param_bytes == 6 * GB
    assert scaled[2] == costs[2]  # the LLM is not replicated
    with pytest.raises(ValueError, match="encoder_dp"):
        replicated_costs(units, costs, {"llm": 2})
    assert degree_vectors(["vision", "audio"], {"vision": 4, "audio": 2}, 16) == [
        {"vision": 1, "audio": 2}, {"vision": 2, "audio": 1}, {"vision": 2, "audio": 2}, {"vision": 4, "audio": 1},
        {"vision": 4, "audio": 2}]
    assert degree_vectors(["vision"], {"vision": 8}, 3) == [{"vision": 2}]
    assert encoder_dp_bounds(units, 4) == (("vision", 4),) and encoder_dp_bounds(units, 1) == ()


def _light_encoder():
    """A frozen 0.4 s vision tower (1 GB) and four 0.3 s LLM layers (1 GB each) under a 2.5 GB cap: no two LLM layers
    share a rank, an encoder replica fits beside one."""
    units = list(synthetic_units({"vision": [False, True]}, [False] * 4))
    units[1] = dataclasses.replace(units[1], joined=True)
    tower = UnitCost(0.4, 0.0, 0.0, param_bytes=GB, activation_bytes=GB, output_bytes=10**6)
    projector = UnitCost(0.01, 0.01, 0.01, param_bytes=10**6, activation_bytes=10**6, output_bytes=10**6)
    layer = UnitCost(0.1, 0.1, 0.1, param_bytes=GB, activation_bytes=10**8, output_bytes=10**6)
    return units, [tower, projector] + [layer] * 4


def test_encoder_replicas_in_the_llm_ranks_bubbles():
    units, costs = _light_encoder()
    machine = Machine(memory_cap=2.5 * GB, p2p=LINK, dp_link=LINK)
    space = SearchSpace(in_bubble=True)
    homogeneous = plan_layout(units, costs, 4, microbatches=MICROBATCHES, machine=machine, space=space)
    own = plan_layout(units, costs, 4, microbatches=MICROBATCHES, machine=machine,
                      space=SearchSpace(encoder_dp=(("vision", 4),)))
    chosen = plan_layout(units, costs, 4, microbatches=MICROBATCHES, machine=machine,
                         space=dataclasses.replace(space, encoder_dp=(("vision", 4),)))
    assert homogeneous.encoder_dp == () and homogeneous.iteration_s == pytest.approx(4.13126, rel=1e-6)
    assert own.encoder_dp == (("vision", 2),) and own.iteration_s == pytest.approx(3.81212, rel=1e-6)
    # four replicas, one on each LLM rank from the last, each a quarter of the tower in that rank's bubbles
    assert chosen.encoder_dp == (("vision", 4),) and chosen.devices_used == 4
    assert [(s.rank, s.replica) for s in chosen.plan.stages[:4]] == [(3, 0), (2, 1), (1, 2), (0, 3)]
    assert [s.rank for s in chosen.plan.stages[4:]] == [0, 1, 2, 3]
    assert chosen.iteration_s == pytest.approx(3.22806, rel=1e-6)
    again = evaluate_plan(chosen.plan, units, costs, dp=chosen.dp, microbatches=MICROBATCHES, devices=4,
                          machine=machine, schedule=chosen.schedule)
    assert again.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12) and again.fits_memory


@pytest.mark.parametrize("in_bubble", [False, True])
def test_written_tables_rebuild_the_plan(in_bubble):
    """``layout_pp_fields`` (what ``parallel.plan = "auto"`` and ``plait plan`` write) and its TOML table give back the
    chosen plan: stage counts without the replicas, the degrees in ``encoder_dp``, ranks by ``stage_ranks``."""
    units, costs = _light_encoder() if in_bubble else _heavy_encoder()
    machine = Machine(memory_cap=(2.5 if in_bubble else 10) * GB, p2p=LINK, dp_link=LINK)
    devices = 4 if in_bubble else 3
    choice = plan_layout(units, costs, devices, microbatches=MICROBATCHES, machine=machine,
                         space=SearchSpace(encoder_dp=(("vision", 4),), in_bubble=in_bubble))
    fields = layout_pp_fields(choice, units)
    assert fields["encoder_dp"] == dict(choice.encoder_dp) == {"vision": 4 if in_bubble else 2}
    assert fields["stages"] == {"vision": 1, "llm": 4 if in_bubble else 1}
    assert fields["layout"] == "encoder_parallel" and fields["encoders_in_bubble"] is in_bubble
    table = tomllib.loads(pp_toml(fields, choice.dp))["parallel"]["pp"]
    assert table["encoder_dp"] == fields["encoder_dp"] and table["degree"] == choice.plan.num_ranks
    replicas = table["encoder_dp"]
    encoder_stages = sum(replicas.get(m, 1) * n for m, n in table["stages"].items() if m != "llm")
    llm_ranks = table["stages"]["llm"] // table.get("virtual_stages", 1)
    rebuilt = plan_pipeline(units, table["layout"], splits=table.get("splits", {}),
                            stages_per_module={m: n for m, n in table["stages"].items()
                                               if m not in table.get("splits", {})},
                            ranks=stage_ranks(encoder_stages, llm_ranks, in_bubble=table["encoders_in_bubble"]),
                            replicas=replicas)
    assert rebuilt.stages == choice.plan.stages
    assert "encoder data-parallel degrees (each stage's replicas): vision" in format_plan(choice)
