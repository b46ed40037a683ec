"""Expert parallelism in the planner (planner.cost.experts, sharding, search): hand-computed all-to-all bytes and
times, the load imbalance from a measured router distribution, per-rank memory with experts sharded, the search
choosing EP when the experts do not fit otherwise and keeping the EP group inside a node, and the MoE layers'
token-dependent work as the microbatch balancer and the simulator see it."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.cost.analytic import unit_costs
from plait.planner.cost.arch import DecoderArch, units_from_configs
from plait.planner.cost.experts import (ExpertDispatch, ExpertLayer, alltoall_s, expert_layers,
                                        expert_parallel_costs, imbalance, searched_ep_degrees)
from plait.planner.cost.measured_profile import Profile, UnitMeasurement
from plait.planner.cost.sharding import rank_memory, shard_costs
from plait.planner.cost.topology import RANK_ORDERS, Topology, ep_crosses, plan_rank_order
from plait.planner.cost.types import DeviceSpec, MicrobatchShape, ParallelDegrees, ProfileKey
from plait.planner.microbatch import ModuleCostCoeffs, sample_costs_from_metadata
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.layout import evaluate_plan
from plait.planner.search.model import grad_sync_s
from plait.planner.search.parallel import degree_options, plan_parallel
from plait.planner.search.placement import ep_link, placed_machine
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace
from plait.planner.types import Unit, UnitCost

LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=1e9)
FAST = P2PModel(latency_s=1e-6, bandwidth_Bps=1e12)
SLOW = P2PModel(latency_s=1e-3, bandwidth_Bps=1e6)
MOE = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
           vocab_size=128)


def moe_units() -> list[Unit]:
    return consistent_units([Unit("llm.embed", "llm", "embed", True, False),
                             Unit("llm.layers.0", "llm", "layer", True, False),
                             Unit("llm.layers.1", "llm", "layer", True, False),
                             Unit("llm.head", "llm", "head", True, False)])


def moe_costs() -> list[UnitCost]:
    """Layers of 1000 parameter bytes, 800 of them routed experts; 1 s per pass."""
    small = UnitCost(0.1, 0.1, 0.1, param_bytes=100, activation_bytes=10, output_bytes=10)
    layer = UnitCost(1.0, 1.0, 1.0, param_bytes=1000, activation_bytes=10, output_bytes=10, expert_param_bytes=800)
    return [small, layer, layer, small]


def moe_layers(dispatch_bytes: float = 1e4, load: tuple[float, ...] = ()) -> tuple[ExpertLayer, ...]:
    return tuple(ExpertLayer(f"llm.layers.{i}", 8, dispatch_bytes, compute_s=0.5, load=load) for i in range(2))


def test_alltoall_bytes_and_time_by_hand():
    units = units_from_configs({"llm": MOE})
    layers = expert_layers(units, {"llm": MOE}, MicrobatchShape(256), DeviceSpec.h100())
    assert [layer.unit for layer in layers] == ["llm.layers.0", "llm.layers.1"]
    # tokens x k x hidden x bf16 bytes = 256 x 2 x 64 x 2
    assert layers[0].dispatch_bytes == 65536.0 and layers[0].experts == 8
    h100 = DeviceSpec.h100()
    assert layers[0].compute_s == pytest.approx(2 * 256 * 2 * 3 * 64 * 32 / (989e12 * 0.5), rel=1e-12)
    assert layers[0].weights_s == pytest.approx(8 * 3 * 64 * 32 * 2 / h100.hbm_bandwidth, rel=1e-12)
    assert layers[0].tokens_s == pytest.approx(256 * 2 * (2 * 64 + 6 * 32) * 2 / h100.hbm_bandwidth, rel=1e-12)
    # a rank reads 2 of the 8 experts' weights: the routed pass is max(compute, weights / 4 + tokens)
    saved = max(layers[0].compute_s, layers[0].weights_s / 4 + layers[0].tokens_s) - max(
        layers[0].compute_s, layers[0].weights_s + layers[0].tokens_s)
    assert saved < 0
    # ep 4: 3 latencies + 3/4 of the bytes: 3e-5 + 49152 / 1e9 s
    one = alltoall_s(65536.0, 4, LINK)
    assert one == pytest.approx(3e-5 + 49152 / 1e9, rel=1e-12)
    assert alltoall_s(65536.0, 1, LINK) == 0.0 == alltoall_s(65536.0, 4, None)
    costs = unit_costs(units, {"llm": MOE}, MicrobatchShape(256), DeviceSpec.h100())
    moved = expert_parallel_costs(units, costs, 4, ExpertDispatch(layers, LINK))
    for unit, before, after in zip(units, costs, moved):
        if unit.kind == "layer":  # two all-to-alls in the forward, two in the backward (on dX: it needs one)
            assert after.forward_s - before.forward_s == pytest.approx(2 * one + saved, rel=1e-9)
            assert after.input_grad_s - before.input_grad_s == pytest.approx(2 * one + saved, rel=1e-9)
            assert after.weight_grad_s - before.weight_grad_s == pytest.approx(saved, rel=1e-9)
        else:
            assert after == before
    assert expert_parallel_costs(units, costs, 1, ExpertDispatch(layers, LINK)) == costs


def test_imbalance_from_the_measured_router_distribution():
    load = (4.0, 1, 1, 1, 1, 1, 1, 1)  # expert 0 gets 4 / 11 of the tokens
    assert imbalance(load, 1) == 1.0 and imbalance((), 8) == 1.0  # one rank runs every expert; uniform default
    assert imbalance(load, 4) == pytest.approx(4 * 5 / 11)  # ranks hold (0, 1), (2, 3), ...: loads 5, 2, 2, 2
    assert imbalance(load, 8) == pytest.approx(32 / 11)  # ep = E: max expert load / mean
    with pytest.raises(ValueError, match="does not divide"):
        imbalance(load, 3)
    units, costs = moe_units(), moe_costs()
    f = 20 / 11
    skewed = expert_parallel_costs(units, costs, 4, ExpertDispatch(moe_layers(1e4, load), LINK))
    a2a = alltoall_s(f * 1e4, 4, LINK)  # the busiest rank receives f times the mean bytes
    assert skewed[1].forward_s == pytest.approx(1.0 + (f - 1) * 0.5 + 2 * a2a, rel=1e-12)
    assert skewed[1].input_grad_s == pytest.approx(1.0 + (f - 1) * 0.5 + 2 * a2a, rel=1e-12)
    assert skewed[1].weight_grad_s == pytest.approx(1.0 + (f - 1) * 0.5, rel=1e-12)
    with pytest.raises(ValueError, match="load has 2 shares"):
        ExpertLayer("llm.layers.0", 8, 1.0, load=(1.0, 1.0))


def test_router_load_flows_from_the_profile():
    units = units_from_configs({"llm": MOE})
    key = ProfileKey(model={}, shapes={}, dtype="bfloat16", device="cpu", plait_version="x", torch_version="y")
    measured = tuple(UnitMeasurement(u.name, 1e-3, 1e-3, 1e-3, 2e-3) for u in units)
    load = [3.0, 1, 1, 1, 0, 1, 0, 1]
    profile = Profile(key, tuple(units), measured, {}, router_load={"llm.layers.1": load})
    again = Profile.from_dict(profile.to_dict())
    assert again.router_load == {"llm.layers.1": tuple(load)}
    layers = expert_layers(units, {"llm": MOE}, MicrobatchShape(64), DeviceSpec.h100(),
                           router_load=again.router_load)
    assert layers[0].imbalance(4) == 1.0  # not measured: uniform
    assert layers[1].imbalance(4) == pytest.approx(4 * 4 / 8)
    with pytest.raises(ValueError, match="no such unit"):
        Profile(key, tuple(units), measured, {}, router_load={"llm.layers.9": load})


def test_memory_per_rank_with_experts_sharded():
    units, costs = moe_units(), moe_costs()
    plain = rank_memory(units, costs, ParallelDegrees())
    ep4 = rank_memory(units, costs, ParallelDegrees(ep=4))
    # each layer keeps 200 dense + 800 / 4 expert bytes: 600 bytes less per layer, gradients alike (bf16),
    # optimizer state 12 bytes per (2-byte) parameter: 6 x 600
    assert plain.parameters - ep4.parameters == 2 * 600
    assert plain.gradients - ep4.gradients == 2 * 600
    assert plain.optimizer - ep4.optimizer == 2 * 6 * 600
    assert ep4.parameters == 100 + 2 * (200 + 200) + 100
    # FSDP2 over 8 with ep 4: experts split over 4, then sharded over the 2 ranks holding the same experts
    both = rank_memory(units, costs, ParallelDegrees(dp_shard=8, ep=4))
    assert both.parameters == pytest.approx(2 * (13 + 25 + 100))  # ceil(100/8), ceil(200/8), 800/4/2
    # ep 8 over FSDP2's 2: experts / 8, the rest / 2
    wide = rank_memory(units, costs, ParallelDegrees(dp_shard=2, ep=8))
    assert wide.parameters == 2 * 50 + 2 * (100 + 100)
    # a frozen MoE layer's experts are split too (no FSDP2 for it)
    frozen = [dataclasses.replace(u, trainable=False) for u in units]
    assert rank_memory(frozen, costs, ParallelDegrees(dp_shard=4, ep=4)).parameters == 100 + 2 * 400 + 100
    with pytest.raises(ValueError, match="divide dp_shard"):
        ParallelDegrees(dp_shard=4, ep=6)


def test_fsdp_gathers_only_the_dense_part_under_ep():
    units, costs = moe_units(), moe_costs()
    slow = P2PModel(0.0, 1.0)  # 1 byte/s: the all-gathers dominate
    sharded = shard_costs(units, costs, ParallelDegrees(dp_shard=4), shard_link=slow)
    with_ep = shard_costs(units, costs, ParallelDegrees(dp_shard=4, ep=4), shard_link=slow)
    assert sharded[1].forward_s == pytest.approx(3 / 4 * 1000)  # every parameter gathered over 4
    assert with_ep[1].forward_s == pytest.approx(3 / 4 * 200)  # experts local: only the 200 dense bytes
    assert with_ep[1].param_bytes == 50 + 200


def test_search_picks_ep_when_the_experts_do_not_fit_otherwise():
    units, costs = moe_units(), moe_costs()
    space = SearchSpace(tp_degrees=(1,), dp_shard_degrees=(1,), checkpointing=("none",))
    # ep 1: a layer alone holds 1000 + 1000 + 6000 bytes; the cap leaves no room for it
    machine = Machine(memory_cap=6000, dp_link=LINK, ep_link=LINK)
    with pytest.raises(NoPlanFits):
        plan_parallel(units, costs, 4, microbatches=4, machine=machine, space=space)
    choice = plan_parallel(units, costs, 4, microbatches=4, machine=machine, space=space, experts=moe_layers())
    assert choice.ep > 1 and choice.fits_memory and choice.dp % choice.ep == 0
    assert max(choice.stage_memory_bytes) <= 6000
    assert LayoutChoice.from_dict(choice.to_dict()) == choice
    # the explicit degree: ep 4 on every device, pp 1: 100 + 2 (200 + 200) + 100 parameter bytes, x 8 with state
    four = plan_parallel(units, costs, 4, microbatches=4, machine=dataclasses.replace(machine, memory_cap=None),
                         space=dataclasses.replace(space, ep_degrees=(4,)), experts=moe_layers())
    assert four.ep == 4 and four.dp == 4 and four.stage_static_bytes == (8 * 1000.0,)
    with pytest.raises(ValueError, match="needs the MoE layers"):
        plan_parallel(units, costs, 4, microbatches=4, space=dataclasses.replace(space, ep_degrees=(2,)))


def test_ep_group_kept_inside_a_node():
    # 16 GPUs in nodes of 8: an EP group of 8 consecutive data-parallel ranks stays in a node, one of 16 crosses
    sizes = {"dp": 16, "dp_shard": 1, "pp": 1, "cp": 1, "tp": 1}
    assert not ep_crosses(RANK_ORDERS["dp_outer"], sizes, 8, 8)
    assert ep_crosses(RANK_ORDERS["dp_outer"], sizes, 16, 8)
    staged = {"dp": 8, "dp_shard": 1, "pp": 2, "cp": 1, "tp": 1}
    assert ep_crosses(RANK_ORDERS["dp_outer"], staged, 8, 8)  # stride pp = 2: 16 ranks
    assert not ep_crosses(RANK_ORDERS["pp_outer"], staged, 8, 8)  # pp outermost: stride 1
    machine = Machine(topology=Topology(8, FAST, SLOW))
    assert ep_link(machine, tp=1, dp_shard=1, ep=8, devices=16) == FAST
    assert ep_link(machine, tp=1, dp_shard=1, ep=16, devices=16) == SLOW
    units = moe_units()
    costs = [dataclasses.replace(c, expert_param_bytes=0) if c.expert_param_bytes else c for c in moe_costs()]
    costs = [dataclasses.replace(c, param_bytes=1600, expert_param_bytes=1600) if u.kind == "layer" else c
             for u, c in zip(units, costs)]
    layers = (ExpertLayer("llm.layers.0", 16, 1e5), ExpertLayer("llm.layers.1", 16, 1e5))
    space = SearchSpace(tp_degrees=(1,), dp_shard_degrees=(1,), checkpointing=("none",), ep_degrees=(8, 16))
    choice = plan_parallel(units, costs, 16, microbatches=16, machine=machine, space=space, experts=layers)
    assert choice.ep == 8
    across = plan_parallel(units, costs, 16, microbatches=16, machine=machine,
                           space=dataclasses.replace(space, ep_degrees=(16,)), experts=layers)
    assert across.ep == 16 and across.dp == choice.dp == 16
    # one microbatch per replica, 2 MoE layers x 4 all-to-alls, on InfiniBand instead of NVLink; the gradients of
    # 100 + 2 x 1600 / ep + 100 parameter bytes all-reduced over the 16 ranks (across nodes) either way
    a2a = 8 * (alltoall_s(1e5, 16, SLOW) - alltoall_s(1e5, 8, FAST))
    sync = grad_sync_s(600, 16, SLOW) - grad_sync_s(400, 16, SLOW)
    assert across.iteration_s - choice.iteration_s == pytest.approx(a2a - sync, rel=1e-9)


def test_ep_options_and_degrees():
    assert searched_ep_degrees(None, moe_layers(), 16) == (1, 2, 4, 8)  # powers of two dividing 8 experts
    assert searched_ep_degrees(None, (), 16) == (1,)
    options = degree_options(8, tp_degrees=(1, 2), dp_shard_degrees=(1, 4), checkpointing=("none",),
                             fsdp_reshard=("after_forward",), ep_degrees=(1, 2, 8))
    assert sorted((o.tp, o.dp_shard, o.ep) for o in options) == [
        (1, 1, 1), (1, 1, 2), (1, 1, 8), (1, 4, 1), (1, 4, 2), (1, 4, 8), (2, 1, 1), (2, 4, 1)]


def test_moe_token_work_reaches_the_balancer_and_the_simulator():
    arch = DecoderArch.from_config(MOE)
    h, q, kv = 64, 64, 32
    per_token = 2 * (h * (q + 2 * kv) + q * h + h * 8 + 2 * 3 * h * 32)  # attention, router, k = 2 routed experts
    assert arch.layer_flops()[0] == per_token
    # the microbatch balancer's LLM coefficient (train.cost_coeffs: layers x layer_flops + 2 H V per token)
    llm = ModuleCostCoeffs(linear=2 * per_token + 2 * h * 128, quadratic=2 * 4 * q / 2, trainable=True)
    (sample,) = sample_costs_from_metadata([{"text_tokens": 100, "items": []}], {"llm": llm})
    assert sample.work == (3 * ((2 * per_token + 2 * h * 128) * 100 + 4 * q * 100 * 100),)
    # the simulator: a measured imbalance of 20/11 at ep 4 lengthens each MoE layer's passes by (f - 1) x routed
    units, costs = moe_units(), moe_costs()
    machine = Machine(p2p=P2PModel())
    even = plan_parallel(units, costs, 4, microbatches=4, machine=machine, experts=moe_layers(0.0),
                         space=SearchSpace(tp_degrees=(1,), dp_shard_degrees=(1,), checkpointing=("none",),
                                           ep_degrees=(4,), dp_degrees=(4,)))
    skew = shard_costs(units, costs, ParallelDegrees(ep=4),
                       experts=ExpertDispatch(moe_layers(0.0, (4.0, 1, 1, 1, 1, 1, 1, 1)), None))
    timed = evaluate_plan(even.plan, units, skew, dp=4, microbatches=4, devices=4, machine=machine)
    assert timed.makespan_s - even.makespan_s == pytest.approx(2 * 3 * (20 / 11 - 1) * 0.5, rel=1e-9)


def test_the_plan_writes_ep_under_parallel():
    from plait.planner.report import degrees_line, pp_toml

    table = pp_toml({"degree": 1}, 1, dict(dp=1, dp_shard=4, tp=1, ep=4))
    assert table.endswith('[parallel]\nplan = "manual"\ndp = 1\ndp_shard = 4\ntp = 1\ncp = 1\nep = 4\n')
    assert "ep =" not in pp_toml({"degree": 1}, 4, dict(dp=4, dp_shard=1, tp=1, ep=1))
    units, costs = moe_units(), moe_costs()
    four = plan_parallel(units, costs, 4, microbatches=4, experts=moe_layers(),
                         space=SearchSpace(tp_degrees=(1,), dp_shard_degrees=(1,), checkpointing=("none",),
                                           ep_degrees=(4,)))
    assert "expert parallel 4 (each MoE layer's experts split over 4 of the 4 data-parallel ranks)" in degrees_line(four)
    space = SearchSpace(ep_degrees=(1, 4))
    machine = Machine(ep_link=LINK)
    assert SearchSpace.from_dict(space.to_dict()) == space and Machine.from_dict(machine.to_dict()) == machine
    assert ExpertDispatch.from_dict(ExpertDispatch(moe_layers(), LINK).to_dict()) == ExpertDispatch(moe_layers(), LINK)


def test_rank_order_keeps_the_ep_group_in_a_node():
    # 32 GPUs in nodes of 8, pp 2 x dp 16: dp crosses nodes in either order; dp_outer would also put each EP group
    # of 8 across two nodes (stride pp = 2), pp_outer keeps it in one (stride 1)
    sizes = {"dp": 16, "dp_shard": 1, "pp": 2, "cp": 1, "tp": 1}
    assert plan_rank_order(sizes, 8) == "dp_outer"
    assert plan_rank_order(sizes, 8, ep=8) == "pp_outer"
    placed, order = placed_machine(Machine(topology=Topology(8, FAST, SLOW)), tp=1, dp=16, dp_shard=1, pp=2, ep=8)
    assert order == "pp_outer" and placed.ep_link == FAST and placed.dp_link == SLOW


def test_unit_cost_refuses_more_expert_bytes_than_parameter_bytes():
    """A unit's routed-expert bytes are part of its parameter bytes: more is refused when the cost is built."""
    assert UnitCost(1.0, 1.0, 1.0, param_bytes=100, expert_param_bytes=100).expert_param_bytes == 100
    with pytest.raises(ValueError, match=r"expert_param_bytes \(101\) exceeds param_bytes \(100\)"):
        UnitCost(1.0, 1.0, 1.0, param_bytes=100, expert_param_bytes=101)
