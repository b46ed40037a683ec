"""Where ranks sit (planner.cost.topology) and the search charging each collective by it (planner.search.placement):
hand-worked crossings, a brute-force check of ``crossing_axes`` over every group's ranks, the inter-node link charged
when a plan forces a group across nodes (exact cost-formula values), and the JSON round trips."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.cost.node_presets import INFINIBAND_NDR_LINK, NVLINK4_LINK, nvlink_infiniband
from plait.planner.cost.sharding import shard_costs
from plait.planner.cost.topology import RANK_AXES, RANK_ORDERS, Topology, crossing_axes, plan_rank_order
from plait.planner.cost.types import ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.auto_layout import plan_auto_layout
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.model import grad_sync_s
from plait.planner.search.parallel import plan_parallel
from plait.planner.search.placement import placed_machine, retime
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.types import Unit, UnitCost
from tests.helpers.sharding import toy_costs, toy_units

FAST = P2PModel(latency_s=1e-6, bandwidth_Bps=1e12)  # "NVLink"
SLOW = P2PModel(latency_s=1e-3, bandwidth_Bps=100.0)  # "InfiniBand", slow enough that every byte shows


def test_32_gpus_in_nodes_of_8_with_pp_4_tp_2_dp_shard_4():
    sizes = {"dp": 1, "dp_shard": 4, "pp": 4, "cp": 1, "tp": 2}
    # dp_outer (dp, dp_shard, pp, cp, tp): dp_shard's stride is pp x cp x tp = 8, its groups span 8 x 4 = 32 ranks
    # (4 nodes); pp's stride is 2, its groups 2 x 4 = 8 ranks tile the nodes; tp's 2 ranks too
    assert crossing_axes(RANK_ORDERS["dp_outer"], sizes, 8) == ("dp_shard",)
    # pp_outer (pp, dp, dp_shard, cp, tp): pp's stride is 8 (across the 4 nodes), dp_shard's 2 x 4 = 8 ranks a node
    assert crossing_axes(RANK_ORDERS["pp_outer"], sizes, 8) == ("pp",)
    assert plan_rank_order(sizes, 8) == "pp_outer"
    # one node of 8: nothing crosses, the default order
    small = {"dp": 1, "dp_shard": 2, "pp": 2, "cp": 1, "tp": 2}
    assert crossing_axes(RANK_ORDERS["dp_outer"], small, 8) == () == crossing_axes(RANK_ORDERS["pp_outer"], small, 8)
    assert plan_rank_order(small, 8) == "dp_outer"


def _brute_force(order: tuple[str, ...], sizes: dict[str, int], gpus_per_node: int) -> tuple[str, ...]:
    """Every group of every axis enumerated: ranks numbered row-major over ``order`` (outermost first), an axis
    crosses when one of its groups holds ranks of two nodes (``rank // gpus_per_node``)."""
    degrees = [sizes.get(a, 1) for a in order]
    strides = [math.prod(degrees[i + 1:]) for i in range(len(order))]
    out = []
    for i, axis in enumerate(order):
        others = [range(d) if j != i else range(1) for j, d in enumerate(degrees)]
        for coords in itertools.product(*others):
            base = sum(c * s for c, s in zip(coords, strides))
            nodes = {(base + k * strides[i]) // gpus_per_node for k in range(degrees[i])}
            if len(nodes) > 1:
                out.append(axis)
                break
    return tuple(out)


@settings(max_examples=200, deadline=None)
@given(degrees=st.lists(st.integers(1, 4), min_size=len(RANK_AXES), max_size=len(RANK_AXES)),
       gpus_per_node=st.integers(1, 16), order=st.sampled_from(sorted(RANK_ORDERS)))
def test_crossing_axes_equals_enumerating_every_group(degrees, gpus_per_node, order):
    sizes = dict(zip(RANK_AXES, degrees))
    assert crossing_axes(RANK_ORDERS[order], sizes, gpus_per_node) == _brute_force(RANK_ORDERS[order], sizes,
                                                                                   gpus_per_node)


def test_placed_machine_links_per_axis():
    topology = Topology(8, intra_link=FAST, inter_link=SLOW)
    machine = Machine(topology=topology, p2p=P2PModel(9.0), dp_link=P2PModel(9.0))
    placed, order = placed_machine(machine, tp=2, dp=4, dp_shard=4, pp=4)  # the 32-GPU case: pipeline outermost
    assert order == "pp_outer"
    assert (placed.p2p, placed.dp_link, placed.shard_link, placed.tp_link) == (SLOW, FAST, FAST, FAST)
    placed, order = placed_machine(machine, tp=1, dp=16, dp_shard=2, pp=1)  # 8 replicas of 2 shards: dp crosses
    assert order == "dp_outer" and (placed.dp_link, placed.shard_link, placed.p2p) == (SLOW, FAST, FAST)
    assert placed_machine(Machine(), tp=2, dp=2, dp_shard=1, pp=2) == (Machine(), "dp_outer")  # no topology


def _flat_fsdp(devices: int, gpus_per_node: int) -> LayoutChoice:
    """FSDP2 with 4 shards forced, every device a DP rank (no pipeline stages), on ``devices`` devices."""
    space = SearchSpace(tp_degrees=(1,), dp_shard_degrees=(4,), dp_degrees=(devices,), checkpointing=("none",),
                        fsdp_reshard=("after_forward",), prefer_plain=False)
    machine = Machine(topology=Topology(gpus_per_node, intra_link=FAST, inter_link=SLOW), host=None)
    return plan_parallel(toy_units(), toy_costs(), devices, microbatches=devices, machine=machine, space=space)


def _sharded_forward_s(link: P2PModel) -> float:
    """One microbatch's forward on one rank of 4 shards (the no-pipeline plan's stages on one rank): compute or the
    all-gathers on ``link`` (``sharding.shard_costs``)."""
    per_rank = shard_costs(toy_units(), toy_costs(), ParallelDegrees(dp_shard=4), shard_link=link)
    return math.fsum(c.forward_s for c in per_rank)


def test_fsdp_group_across_nodes_is_charged_the_inter_node_link():
    shard_grads = (200 + 200 + 800 + 200) / 4  # the projector, LLM embed, layer and head train; a shard of each
    across = _flat_fsdp(4, gpus_per_node=2)  # the 4 shards on two nodes
    assert (across.dp, across.dp_shard, across.plan.num_ranks, across.rank_order) == (4, 4, 1, "dp_outer")
    assert across.grad_sync_s == pytest.approx(grad_sync_s(shard_grads, 4, SLOW, 4))  # 3 latencies + 3/4 x 4 shards
    assert math.fsum(across.stage_forward_s) == pytest.approx(_sharded_forward_s(SLOW))
    inside = _flat_fsdp(4, gpus_per_node=4)  # the same group in one node
    assert inside.grad_sync_s == pytest.approx(grad_sync_s(shard_grads, 4, FAST, 4))
    assert math.fsum(inside.stage_forward_s) == pytest.approx(_sharded_forward_s(FAST))
    assert across.grad_sync_s > 100 * inside.grad_sync_s and across.iteration_s > inside.iteration_s
    # the same as the explicit links without a topology
    explicit = plan_parallel(toy_units(), toy_costs(), 4, microbatches=4,
                             machine=Machine(p2p=FAST, dp_link=SLOW, shard_link=SLOW, tp_link=FAST, host=None),
                             space=SearchSpace(tp_degrees=(1,), dp_shard_degrees=(4,), dp_degrees=(4,),
                                               checkpointing=("none",), fsdp_reshard=("after_forward",),
                                               prefer_plain=False))
    assert across.iteration_s == pytest.approx(explicit.iteration_s)


def test_replicas_across_nodes_charge_the_sync_not_the_gathers():
    # 8 devices in nodes of 4: 2 replicas of 4 shards; each shard group is a node, the replicas cross
    choice = _flat_fsdp(8, gpus_per_node=4)
    assert (choice.dp, choice.dp_shard) == (8, 4)
    assert choice.grad_sync_s == pytest.approx(grad_sync_s((200 + 200 + 800 + 200) / 4, 8, SLOW, 4))
    assert math.fsum(choice.stage_forward_s) == pytest.approx(_sharded_forward_s(FAST))


def _llm(count: int) -> tuple[list[Unit], list[UnitCost]]:
    units = consistent_units([Unit(f"llm.layers.{i}", "llm", "layer", True, False) for i in range(count)])
    cost = UnitCost(forward_s=1.0, input_grad_s=1.0, weight_grad_s=1.0, param_bytes=8, activation_bytes=1,
                    output_bytes=1000)
    return units, [cost] * count


def test_stage_transfers_follow_the_pipeline_ranks_plan_uses():
    units, costs = _llm(2)  # two units: at most 2 pipeline ranks of the 4 devices of DP degree 1
    topology = Topology(2, intra_link=FAST, inter_link=SLOW)
    space = SearchSpace(dp_degrees=(1,), tp_degrees=(1,), dp_shard_degrees=(1,))
    choice = plan_parallel(units, costs, 4, microbatches=4, machine=Machine(topology=topology), space=space)
    # searched as 4 pipeline ranks across the 2 nodes (SLOW); the plan uses 2 ranks, one node: timed with FAST
    assert choice.plan.num_ranks == 2 and choice.p2p == FAST and choice.rank_order == "dp_outer"
    again = evaluate_plan(choice.plan, units, costs, dp=1, microbatches=4, devices=4, machine=Machine(p2p=FAST),
                          schedule=choice.schedule)
    assert choice.iteration_s == pytest.approx(again.iteration_s)
    # 4 layers: 4 ranks would send across the nodes of 2 (10 s a transfer): 2 ranks, one node; nodes of 4: 4 ranks
    units, costs = _llm(4)
    narrow = plan_parallel(units, costs, 4, microbatches=8, machine=Machine(topology=topology), space=space)
    assert narrow.plan.num_ranks == 2 and narrow.p2p == FAST
    wide = plan_parallel(units, costs, 4, microbatches=8, space=space,
                         machine=Machine(topology=Topology(4, intra_link=FAST, inter_link=SLOW)))
    assert wide.plan.num_ranks == 4 and wide.p2p == FAST
    # a mildly slower inter-node link: 4 ranks across the 2 nodes, each transfer charged on it
    mild = P2PModel(latency_s=1e-3, bandwidth_Bps=1e9)
    across = plan_parallel(units, costs, 4, microbatches=8, space=space,
                           machine=Machine(topology=Topology(2, intra_link=FAST, inter_link=mild)))
    again = evaluate_plan(across.plan, units, costs, dp=1, microbatches=8, devices=4, machine=Machine(p2p=mild),
                          schedule=across.schedule)
    assert across.plan.num_ranks == 4 and across.p2p == mild
    assert across.iteration_s == pytest.approx(again.iteration_s) and across.iteration_s > wide.iteration_s


def test_sharded_stages_across_nodes_number_the_pipeline_outermost():
    # 8 devices in nodes of 4, 4 stages sharded over 2 DP ranks: dp_outer would put each FSDP2 pair 4 ranks apart
    # (across the nodes), pp_outer keeps the pairs in a node and sends the stage transfers across
    units, costs = _llm(4)
    mild = P2PModel(latency_s=1e-3, bandwidth_Bps=1e9)
    space = SearchSpace(tp_degrees=(1,), dp_shard_degrees=(2,), dp_degrees=(2,), checkpointing=("none",),
                        fsdp_reshard=("after_forward",), prefer_plain=False)
    choice = plan_parallel(units, costs, 8, microbatches=8, space=space,
                           machine=Machine(topology=Topology(4, intra_link=FAST, inter_link=mild), host=None))
    assert (choice.dp, choice.dp_shard, choice.plan.num_ranks, choice.rank_order) == (2, 2, 4, "pp_outer")
    assert choice.p2p == mild
    assert choice.grad_sync_s == pytest.approx(grad_sync_s(8, 2, FAST))  # each stage's 8 B over the pair, in a node


def test_retime_moves_the_times_to_the_new_links():
    units, costs = _llm(4)
    mild = P2PModel(latency_s=1e-3, bandwidth_Bps=1e9)
    searched = plan_layout(units, costs, 4, microbatches=8, machine=Machine(p2p=mild),
                           space=SearchSpace(dp_degrees=(1,)))
    timed = retime(searched, units, costs, machine=Machine(p2p=FAST), microbatches=8, devices=4)
    again = evaluate_plan(searched.plan, units, costs, dp=1, microbatches=8, devices=4, machine=Machine(p2p=FAST),
                          schedule=searched.schedule)
    assert (timed.p2p, timed.iteration_s, timed.makespan_s) == (FAST, again.iteration_s, again.makespan_s)
    assert timed.iteration_s < searched.iteration_s and (timed.plan, timed.candidates) == (searched.plan,
                                                                                           searched.candidates)
    assert timed.planned_iteration_s - searched.planned_iteration_s == pytest.approx(timed.iteration_s
                                                                                     - searched.iteration_s)


def test_tp_group_across_nodes_is_charged_the_inter_node_link():
    # TP 4 in nodes of 2 (4 devices): every layer's all-reduces on the slow link
    space = SearchSpace(tp_degrees=(4,), dp_shard_degrees=(1,), checkpointing=("none",), prefer_plain=False)
    slow = plan_parallel(toy_units(), toy_costs(), 4, microbatches=2, space=space,
                         machine=Machine(topology=Topology(2, intra_link=FAST, inter_link=SLOW)))
    fast = plan_parallel(toy_units(), toy_costs(), 4, microbatches=2, space=space,
                         machine=Machine(topology=Topology(4, intra_link=FAST, inter_link=SLOW)))
    expected = shard_costs(toy_units(), toy_costs(), ParallelDegrees(tp=4), tp_link=SLOW)
    assert slow.tp == 4 and math.fsum(slow.stage_forward_s) == pytest.approx(math.fsum(c.forward_s for c in expected))
    assert slow.iteration_s > fast.iteration_s


def test_machine_and_choice_round_trip_with_topology_and_rank_order():
    machine = Machine(memory_cap=1e9, topology=nvlink_infiniband())
    assert Machine.from_dict(json.loads(json.dumps(machine.to_dict()))) == machine
    assert Machine.from_json(Machine(topology=Topology(4)).to_json()) == Machine(topology=Topology(4))
    assert machine.topology.intra_link == NVLINK4_LINK and machine.topology.inter_link == INFINIBAND_NDR_LINK
    assert NVLINK4_LINK.bandwidth_Bps == 450e9 and INFINIBAND_NDR_LINK.bandwidth_Bps == 400e9 / 8
    units, costs = _llm(4)
    choice = plan_parallel(units, costs, 4, microbatches=8, machine=Machine(topology=Topology(2, FAST, SLOW)),
                           space=SearchSpace(dp_degrees=(1,), tp_degrees=(1,), dp_shard_degrees=(1,)))
    pp_outer = type(choice)(**{**choice.__dict__, "rank_order": "pp_outer"})
    for value in (choice, pp_outer):
        assert LayoutChoice.from_dict(json.loads(json.dumps(value.to_dict()))) == value
    with pytest.raises(ValueError, match="rank_order"):
        LayoutChoice.from_dict({**choice.to_dict(), "rank_order": "tp_outer"})


def test_auto_plan_keeps_filling_the_world_with_a_topology():
    # parallel.plan = "auto" searches only plans using every process: no search on fewer devices, links placed
    units, costs = _llm(4)
    mild = P2PModel(latency_s=1e-3, bandwidth_Bps=1e9)
    topology = Topology(2, intra_link=FAST, inter_link=mild)
    choice = plan_auto_layout(units, costs, 4, 8, machine=Machine(dtype="float32", topology=topology),
                              space=SearchSpace(tp_degrees=(1,), dp_shard_degrees=(1,)))
    assert choice.dp * choice.plan.num_ranks == 4
    own, order = placed_machine(Machine(topology=topology), tp=1, dp=choice.dp, dp_shard=1, pp=choice.plan.num_ranks)
    assert (choice.p2p, choice.rank_order) == (own.p2p, order)
    again = evaluate_plan(choice.plan, units, costs, dp=choice.dp, microbatches=8, devices=4, schedule=choice.schedule,
                          machine=Machine(dtype="float32", p2p=own.p2p, dp_link=own.dp_link))
    assert choice.iteration_s == pytest.approx(again.iteration_s)
