"""The runtime's fixed costs in plans: ``overheads.ActionOverheads`` (per action and module chunk) and the
``P2PModel`` message overheads, charged alike by the search's stage costs and by ``evaluate_plan``; hand-worked."""

from __future__ import annotations

import dataclasses
import pytest

from plait.planner.cost.types import ActionOverheads, DeviceSpec
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.pipeline.types import P2PModel
from plait.planner.types import Unit, UnitCost
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.search.auto_layout import AUTO_MACHINE

MS = 1e-3


def _llm(n: int) -> list[Unit]:
    kinds = ["embed"] + ["layer"] * (n - 2) + ["head"]
    return [Unit(f"llm.{i}", "llm", kinds[i], trainable=True, needs_input_grad=i > 0) for i in range(n)]


def _costs(n: int, f: float = 1 * MS, dx: float = 1 * MS, dw: float = 1 * MS) -> list[UnitCost]:
    return [UnitCost(f, dx if i > 0 else 0.0, dw, param_bytes=0, activation_bytes=0, output_bytes=0) for i in range(n)]


def test_stage_seconds_per_action_and_chunk():
    over = ActionOverheads(per_action_s=0.5 * MS, chunk_forward_s=2 * MS, chunk_backward_s=3 * MS,
                           modules={"llm": (1 * MS, 4 * MS)})
    # F of a colocated stage (vision + audio chunks): 0.5 + 2 + 2 ms
    assert over.stage_s("F", [("vision", True), ("audio", True)]) == pytest.approx(4.5 * MS)
    # B: only the chunk that runs a backward pays its chunk overhead; 0.5 + 3 ms
    assert over.stage_s("B", [("vision", False), ("audio", True)]) == pytest.approx(3.5 * MS)
    assert over.stage_s("B", [("vision", False)]) == 0.0  # no backward action at all
    assert over.stage_s("B", [("llm", True)]) == pytest.approx(4.5 * MS)  # the module's own measured overhead
    assert over.stage_s("F", [("llm", True)], pipelined=False) == pytest.approx(1 * MS)  # no executor on one rank
    assert ActionOverheads.from_dict(over.to_dict()) == over
    with pytest.raises(ValueError, match="must be >= 0"):
        ActionOverheads(chunk_forward_s=-1.0)
    # W (weight gradients of a split backward): the chunks that train pay the backward chunk overhead
    assert over.stage_s("W", [("vision", False), ("llm", True)]) == pytest.approx(4.5 * MS)
    with pytest.raises(ValueError, match="action kind must be 'F', 'B' or 'W', got 'X'"):
        over.chunk_s("llm", "X")


def test_cpu_preset_carries_measured_overheads_and_gpu_presets_none():
    cpu = DeviceSpec.cpu()
    assert cpu.chunk_overhead_s == 5e-3 and cpu.message_overhead_s == 1e-4
    assert ActionOverheads.of_device(cpu) == ActionOverheads(0.0, 5e-3, 5e-3)
    for gpu in (DeviceSpec.h100(), DeviceSpec.h200(), DeviceSpec.a100()):
        assert ActionOverheads.of_device(gpu).zero and gpu.message_overhead_s == 0.0
    with pytest.raises(ValueError, match="chunk_overhead_s"):
        DeviceSpec("x", 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, -1.0)


def test_evaluate_plan_charges_overheads_hand_worked():
    # 2 units on 2 ranks, 1 microbatch: F0 -> F1 -> B1 -> B0 one after another
    units, costs = _llm(2), _costs(2)
    plan = plan_pipeline(units, "encoder_parallel", splits={"llm": ["llm.1"]})
    over = ActionOverheads(per_action_s=0.5 * MS, chunk_forward_s=2 * MS, chunk_backward_s=3 * MS)
    p2p = P2PModel(latency_s=0.0, send_overhead_s=0.1 * MS, recv_overhead_s=0.2 * MS)
    choice = evaluate_plan(plan, units, costs, dp=1, microbatches=1, machine=Machine(p2p=p2p, overheads=over,
                                                                                     dtype="float32"))
    f0 = 1 + 0.5 + 2 + 0.1  # forward, executor, chunk, send
    f1 = 1 + 0.5 + 2 + 0.2  # forward, executor, chunk, receive
    b1 = 2 + 0.5 + 3 + 0.1  # dX + dW, executor, chunk, send the gradient
    b0 = 1 + 0.5 + 3 + 0.2  # dW only (unit 0 needs no input gradient), executor, chunk, receive
    assert choice.iteration_s == pytest.approx((f0 + f1 + b1 + b0) * MS)
    assert choice.stage_forward_s == pytest.approx(((1 + 0.5 + 2) * MS, (1 + 0.5 + 2) * MS))
    # one rank: no executor, no messages; each module's chunk once per action
    single = plan_pipeline(units, "encoder_parallel", ranks=[0])
    alone = evaluate_plan(single, units, costs, dp=1, microbatches=3, machine=Machine(p2p=p2p, overheads=over,
                                                                                      dtype="float32"))
    assert alone.iteration_s == pytest.approx(3 * (2 + 3 + 2 + 3) * MS)


def test_optimizer_step_after_the_flush_hand_worked():
    # 2 units of 1000 trainable bytes each; 10 ns per byte: one rank holding both steps 20 us, two ranks 10 us each
    units, costs = _llm(2), [UnitCost(1 * MS, 0.0, 1 * MS, param_bytes=1000)] * 2
    over = ActionOverheads(optimizer_s_per_byte=1e-8)
    assert over.update_s(2000) == pytest.approx(2e-5) and not over.zero
    single = evaluate_plan(plan_pipeline(units, "encoder_parallel", ranks=[0]), units, costs, dp=2, microbatches=2,
                           machine=Machine(overheads=over, dtype="float32"))
    assert single.update_s == pytest.approx(2e-5)
    assert single.iteration_s == pytest.approx(single.makespan_s + 2e-5)
    split = evaluate_plan(plan_pipeline(units, "encoder_parallel", splits={"llm": ["llm.1"]}), units, costs, dp=1,
                          microbatches=2, machine=Machine(overheads=over, dtype="float32"))
    assert split.update_s == pytest.approx(1e-5) and split.iteration_s == pytest.approx(split.makespan_s + 1e-5)
    link = P2PModel(latency_s=0.0, bandwidth_Bps=1e6)  # all-reduce of 2000 bytes over 2 replicas: 2000 / 1e6 s
    dp = plan_layout(units, costs, 2, microbatches=2, machine=Machine(dp_link=link, overheads=over, dtype="float32"),
                     space=SearchSpace(dp_degrees=[2]))
    assert dp.grad_sync_s == pytest.approx(2e-3) and dp.update_s == pytest.approx(2e-5)
    assert dp.planned_iteration_s == pytest.approx(dp.iteration_s)


def test_search_times_candidates_as_evaluate_plan_does_with_overheads():
    units, costs = _llm(6), _costs(6)
    over = ActionOverheads(per_action_s=0.3 * MS, chunk_forward_s=1 * MS, chunk_backward_s=1.5 * MS)
    p2p = P2PModel(latency_s=0.05 * MS, send_overhead_s=0.1 * MS, recv_overhead_s=0.1 * MS)
    for v in ((1,), (2,)):
        choice = plan_layout(units, costs, 2, microbatches=4, machine=Machine(p2p=p2p, overheads=over, dtype="float32"),
                             space=SearchSpace(dp_degrees=[1], virtual_stages=v))
        assert choice.planned_iteration_s == pytest.approx(choice.iteration_s)


def test_chunk_overheads_stop_the_interleaved_plan_that_runs_slower():
    # the case: 2 ranks, the interleaved plan (2 LLM chunks per rank) has the smaller bubble, so it wins
    # without overheads; with a chunk overhead as measured on a 2-core CPU (each chunk pays it per action), the
    # plain 2-stage 1F1B plan is faster and is chosen
    units, costs = _llm(8), _costs(8)
    machine = Machine(dtype="float32")
    space = SearchSpace(dp_degrees=[1], virtual_stages=(1, 2))
    common = dict(microbatches=4)
    free = plan_layout(units, costs, 2, machine=machine, space=space, **common)
    assert free.schedule == "interleaved_1f1b" and free.plan.virtual_stages == 2
    over = ActionOverheads(chunk_forward_s=2.5 * MS, chunk_backward_s=2.5 * MS)
    costly = plan_layout(units, costs, 2, machine=dataclasses.replace(machine, overheads=over), space=space, **common)
    assert costly.schedule == "1f1b" and costly.plan.num_stages == 2
    interleaved = evaluate_plan(free.plan, units, costs, dp=1, microbatches=4, schedule="interleaved_1f1b",
                                machine=Machine(overheads=over, dtype="float32"))
    assert costly.iteration_s < interleaved.iteration_s


def test_the_optimizer_step_makes_a_pipeline_worth_it_for_many_parameters():
    # the bench's 2-stage-worthy job in small: many trainable bytes, little work per microbatch; plain DP steps
    # the optimizer over all of them on every rank, a 2-stage pipeline over half of them per rank
    units = _llm(6)
    costs = [UnitCost(1 * MS, 1 * MS if i else 0.0, 1 * MS, param_bytes=10**8) for i in range(6)]
    machine = Machine(dtype="float32", memory_cap=None)
    common = dict(microbatches=4)
    free = plan_layout(units, costs, 2, machine=machine, **common)
    assert free.dp == 2 and free.plan.num_ranks == 1
    over = ActionOverheads(optimizer_s_per_byte=5e-9)  # 3 s for 6e8 bytes, 1.5 s per rank when split in two
    costly = plan_layout(units, costs, 2, machine=dataclasses.replace(machine, overheads=over), **common)
    assert costly.dp == 1 and costly.plan.num_ranks == 2 and costly.update_s == pytest.approx(1.5)
    assert costly.iteration_s < evaluate_plan(free.plan, units, costs, dp=2, microbatches=4,
                                              machine=Machine(overheads=over, dtype="float32")).iteration_s


def test_the_automatic_plan_charges_the_same_overheads():
    from plait.planner.search.auto_layout import AUTO_SPACE, plan_auto_layout

    units = _llm(6)
    costs = [UnitCost(1 * MS, 1 * MS if i else 0.0, 1 * MS, param_bytes=10**8) for i in range(6)]
    over = ActionOverheads(optimizer_s_per_byte=5e-9)
    plain = dataclasses.replace(AUTO_SPACE, tp_degrees=(1,), dp_shard_degrees=(1,))  # FSDP2 shards the step: faster
    free = plan_auto_layout(units, costs, 2, 4, space=plain)
    costly = plan_auto_layout(units, costs, 2, 4, machine=dataclasses.replace(AUTO_MACHINE, overheads=over),
                              space=plain)
    sharded = plan_auto_layout(units, costs, 2, 4, machine=dataclasses.replace(AUTO_MACHINE, overheads=over))
    assert sharded.dp_shard > 1 and sharded.iteration_s < costly.iteration_s
    assert (free.dp, free.plan.num_ranks) == (2, 1) and free.update_s == 0.0
    assert (costly.dp, costly.plan.num_ranks) == (1, 2) and costly.update_s == pytest.approx(1.5)
