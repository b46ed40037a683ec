"""Tensor-parallel encoder stages (``[parallel.pp] encoder_tp``) in the cost model, the schedules and the simulator:
each TP rank runs every row with its layers' passes and parameters divided by ``t`` plus their all-reduces
(``cost.sharding.tensor_parallel_unit_costs``), sends the whole features, and pays its gradient all-reduce over the
DP replicas only; the TP ranks of a stage run the same actions in the same order under every schedule; the energy
path (``stage_action_options``) charges a TP stage by the same rule."""

from __future__ import annotations

import pytest

from plait.planner.cost.sharding import tensor_parallel_unit_costs, tp_allreduce_s
from plait.planner.cost.types import ProfileKey
from plait.planner.energy.frontier import schedule_energy_dag
from plait.planner.energy.power_profile import stage_action_options
from plait.planner.energy.types import EnergyProfile, UnitEnergy
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedule_ir import check_schedule
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.layout import evaluate_plan
from plait.planner.search.model import allreduce_s
from plait.planner.search.types import Machine
from plait.planner.types import UnitCost

LINK = P2PModel(latency_s=1e-4, bandwidth_Bps=1e8)
TP_LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=1e9)
UNITS = synthetic_units({"vision": [True] * 4, "audio": [False] * 2}, [True] * 3)  # vision: embed, 2 layers, projector
COSTS = [UnitCost(4.0 if u.module == "vision" else 1.0, 2.0, 3.0, param_bytes=8000, activation_bytes=8 * 10**5,
                  output_bytes=10**5) for u in UNITS]


def _plan(tp: int):
    return plan_pipeline(UNITS, tensor_parallel={"vision": tp}, ranks=list(range(tp + 2)))


def test_a_tp_stage_layer_is_divided_and_pays_its_all_reduces():
    plan = _plan(2)
    by_name = dict(zip((u.name for u in UNITS), COSTS))
    split = tensor_parallel_unit_costs(plan, UNITS, by_name, TP_LINK)
    comm = 2 * tp_allreduce_s(10**5, 2, TP_LINK)  # two all-reduces of the layer's output bytes per pass
    assert comm == pytest.approx(2 * (2 * 1e-5 + 10**5 / 1e9))
    layer = split["vision.1"]
    assert layer.forward_s == pytest.approx(2.0 + comm) and layer.input_grad_s == pytest.approx(1.0 + comm)
    assert layer.weight_grad_s == 1.5 and layer.param_bytes == 4000
    # 4 outputs of the full hidden size stay whole, the rest of the activations is divided
    assert layer.activation_bytes == 4 * 10**5 + (8 - 4) * 10**5 // 2
    assert split["vision.0"] == by_name["vision.0"] and split["vision.3"] == by_name["vision.3"]  # embed, projector
    assert all(split[n] == by_name[n] for n in by_name if not n.startswith("vision"))
    assert tensor_parallel_unit_costs(_plan(1), UNITS, by_name, TP_LINK) == by_name


def test_evaluate_plan_times_each_tp_rank_with_every_row():
    machine = Machine(memory_cap=None, p2p=LINK, dp_link=LINK, tp_link=TP_LINK)
    one = evaluate_plan(_plan(1), UNITS, COSTS, dp=2, microbatches=8, machine=machine)
    two = evaluate_plan(_plan(2), UNITS, COSTS, dp=2, microbatches=8, machine=machine)
    comm = 2 * tp_allreduce_s(10**5, 2, TP_LINK)
    # embed 4 + 2 layers (4 / 2 + comm) + projector 4, on both TP ranks
    assert two.stage_forward_s[:2] == pytest.approx((12.0 + 2 * comm,) * 2)
    assert one.stage_forward_s[0] == 16.0
    assert two.stage_boundary_bytes[:2] == (10**5, 10**5)  # whole features (their gradient comes back whole)
    assert two.stage_static_bytes[0] < one.stage_static_bytes[0]
    # the TP stage's gradient (its shards) is all-reduced over the 2 DP replicas, not over TP x DP
    # per TP rank: embed 8000 + 2 layer halves 4000 + projector 8000; the LLM rank 3 x 8000; audio is frozen
    assert two.grad_sync_s == pytest.approx(allreduce_s(24000, 2, LINK), rel=1e-12)
    assert one.grad_sync_s == pytest.approx(allreduce_s(32000, 2, LINK), rel=1e-12)
    assert two.encoder_dp == ()
    # vision was the bottleneck: 4 microbatches x (16 + 14 (2 + 3 x 4)) on one rank, x (12 + 10 + comm) split
    assert two.makespan_s < one.makespan_s


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zb_h2"])
def test_tp_ranks_of_a_stage_run_the_same_actions_in_the_same_order(name):
    plan = plan_pipeline(UNITS, stages_per_module={"vision": 2}, tensor_parallel={"vision": 2},
                         ranks=[0, 1, 0, 1, 2, 3]).replace(num_microbatches=4)
    schedule = build_schedule(plan, name)
    check_schedule(schedule)  # deadlock-free, every dependency met
    # TP rank k of both vision stages on rank k: the two ranks' orders are the same up to the copy's stage index
    orders = [[(a.kind, plan.stages[a.stage].first_replica, a.microbatch) for a in schedule.actions[r]] for r in (0, 1)]
    assert orders[0] == orders[1] and len(orders[0]) >= 8


def _energy_profile(blocking_w: float, llm_scale: float = 1.0) -> EnergyProfile:
    """UNITS at two SM clocks: seconds as COSTS at the top clock (the LLM's times ``llm_scale``), 1.25x at the lower
    one; joules 100 / 60 / 80 per forward / dX / dW at the top clock, 90 / 54 / 72 at the lower one."""
    rows = []
    for unit, cost in zip(UNITS, COSTS):
        scale = llm_scale if unit.module == "llm" else 1.0
        seconds = (scale * cost.forward_s, scale * cost.input_grad_s, scale * cost.weight_grad_s)
        rows.append(UnitEnergy(unit.name, *(v for s, j in zip(seconds, (100.0, 60.0, 80.0))
                                              for v in ((s, 1.25 * s), (j, 0.9 * j)))))
    key = ProfileKey({"m": 1}, [[1]], "bfloat16", "h100", "0", "0")
    return EnergyProfile(key, "h100", blocking_w, (1980, 1500), tuple(rows))


def test_energy_options_charge_a_tp_stage_as_evaluate_plan():
    """``plait energy`` / ``plan --energy`` charge each TP rank of an encoder_tp stage its layers' time and energy
    divided by t and the all-reduces' seconds (at every clock, at the blocking power): at the top clock the action
    times are evaluate_plan's."""
    plan = _plan(2).replace(num_microbatches=4)
    profile = _energy_profile(blocking_w=110.0)
    out_bytes = {u.name: 10**5 for u in UNITS}
    options = stage_action_options(plan, UNITS, profile, output_bytes=out_bytes, tp_link=TP_LINK)
    timed = evaluate_plan(plan, UNITS, COSTS, dp=1, microbatches=4,
                          machine=Machine(memory_cap=None, p2p=LINK, tp_link=TP_LINK))
    for stage in range(plan.num_stages):  # the top clock: evaluate_plan's per-rank stage times
        assert options[(stage, "F")][0][1] == pytest.approx(timed.stage_forward_s[stage], rel=1e-12)
        assert options[(stage, "B")][0][1] == pytest.approx(timed.stage_backward_s[stage], rel=1e-12)
    comm = 2 * tp_allreduce_s(10**5, 2, TP_LINK)
    # vision: embed (whole) + 2 layers (halved, all-reduces added) + projector (whole), on both TP ranks
    for stage in (0, 1):
        assert options[(stage, "F")] == [
            (1980, pytest.approx(4 + 2 * (4 / 2 + comm) + 4), pytest.approx(100 + 2 * (100 / 2 + 110 * comm) + 100)),
            (1500, pytest.approx(5 + 2 * (5 / 2 + comm) + 5), pytest.approx(90 + 2 * (90 / 2 + 110 * comm) + 90))]
    # backward: the embed needs no input gradient (dW 3 s, 80 J); layers and projector dX + dW, the layers' halved
    # with the dX all-reduces added
    assert options[(0, "B")][0] == (1980, pytest.approx(3 + 2 * ((2 + 3) / 2 + comm) + 5),
                                    pytest.approx(80 + 2 * ((60 + 80) / 2 + 110 * comm) + 140))
    # without the TP group the same stage is the whole units'
    whole = stage_action_options(_plan(1), UNITS, profile)
    assert whole[(0, "F")][0] == (1980, pytest.approx(16.0), pytest.approx(400.0))
    assert options[(2, "F")] == whole[(1, "F")]  # audio's stage: unchanged
    with pytest.raises(ValueError, match="output_bytes"):
        stage_action_options(plan, UNITS, profile)


def test_energy_dag_cannot_slow_a_tp_copy_for_free():
    """The energy DAG cannot slow a TP copy for free: every copy's forward precedes the first LLM stage's (the plan's
    edge from each copy, as its all-reduces hold the leader until the slowest copy arrives), so with the LLM the
    bottleneck slowing the copy's first forward delays the iteration as slowing the leader's does; at the top clock
    the DAG's iteration time is the simulator's."""
    plan = _plan(2).replace(num_microbatches=4)
    schedule = build_schedule(plan, "1f1b")
    options = stage_action_options(plan, UNITS, _energy_profile(110.0, llm_scale=10.0),
                                   output_bytes={u.name: 10**5 for u in UNITS}, tp_link=TP_LINK)
    dag = schedule_energy_dag(schedule, options, p2p=LINK, boundary_bytes={s: 10**5 for s in range(plan.num_stages)},
                              blocking_w=110.0)
    top = dag.top_clock
    fastest, _ = dag.evaluate(top)
    assert fastest == pytest.approx(simulate(schedule, {k: v[0][1] for k, v in options.items()}, p2p=LINK,
                                             boundary_bytes={s: 10**5 for s in range(plan.num_stages)}).makespan_s)

    def slowed(stage: int) -> float:  # that stage's first forward at the lower clock (1.25x its time)
        return dag.evaluate([1 if (a.stage, a.kind, a.microbatch) == (stage, "F", 0) else c
                             for (_, a), c in zip(dag.actions, top)])[0]

    extra = 0.25 * (4 + 2 * 2 + 4)  # the forward's compute at the lower clock; the all-reduces take as long
    assert slowed(0) == pytest.approx(fastest + extra) and slowed(1) == pytest.approx(slowed(0), rel=1e-12)
