"""Replicated encoder stages (an encoder branch's own data-parallel degree): plan validation, edges, rank
placement, schedules, divided costs and the row split of a microbatch over the replicas."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.pipeline.plan import check_plan_units, plan_pipeline, stage_ranks, synthetic_units
from plait.planner.pipeline.replicas import plan_replica_rows
from plait.planner.pipeline.schedule_ir import check_schedule
from plait.planner.pipeline.schedules import one_f_one_b, zb_h1
from plait.planner.pipeline.simulator import boundary_bytes_from_units, simulate, stage_costs_from_units
from plait.planner.pipeline.types import PipelinePlan, Stage
from plait.planner.types import UnitCost


def _units(vision_trains: bool = True):
    return synthetic_units({"vision": [vision_trains] * 3, "audio": [False, True]}, [True] * 4)


def _plan(**kwargs):
    options = dict(stages_per_module={"vision": 2, "llm": 2}, replicas={"vision": 2})
    options.update(kwargs)
    return plan_pipeline(_units(), **options)


def test_replicated_branch_stages_edges_and_ranks():
    plan = _plan()
    got = [(s.modules[0], s.units, s.rank, s.replica, s.replicas) for s in plan.stages]
    assert got == [
        ("vision", ("vision.0", "vision.1"), 0, 0, 2), ("vision", ("vision.0", "vision.1"), 1, 1, 2),
        ("vision", ("vision.2",), 2, 0, 2), ("vision", ("vision.2",), 3, 1, 2),
        ("audio", ("audio.0", "audio.1"), 4, 0, 1),
        ("llm", ("llm.0", "llm.1"), 5, 0, 1), ("llm", ("llm.2", "llm.3"), 6, 0, 1),
    ]
    # replica k feeds replica k of the branch's next stage; the last replicas all feed the first LLM stage
    assert plan.edges == ((0, 2), (1, 3), (2, 5), (3, 5), (4, 5), (5, 6))
    assert plan.predecessors(5) == (2, 3, 4)
    assert plan.replica_group(3) == (2, 3) and plan.replica_group(4) == (4,) and plan.replicated
    assert plan.stage_of_unit("vision.2") == 2 and plan.depth(1) == plan.depth(0) == 4
    check_plan_units(plan, _units())
    assert PipelinePlan.from_dict(plan.to_dict()) == plan


def test_replicas_default_to_one_and_old_json_reads():
    plan = plan_pipeline(_units())
    assert all(s.replicas == 1 and s.replica == 0 for s in plan.stages) and not plan.replicated
    data = plan.to_dict()
    for stage in data["stages"]:
        stage.pop("replica"), stage.pop("replicas")
    assert PipelinePlan.from_dict(data) == plan


def test_stage_ranks_place_replicas():
    # own ranks: 2 vision replicas + 1 audio stage on ranks 0-2, the LLM after them
    assert stage_ranks(3, 2) == (0, 1, 2, 3, 4)
    # in the bubbles of a 2-stage LLM: the two replicas land on different LLM ranks
    ranks = stage_ranks(2, 2, in_bubble=True)
    assert ranks == (1, 0, 0, 1)
    units = synthetic_units({"vision": [True] * 2}, [True] * 4)
    plan = plan_pipeline(units, stages_per_module={"llm": 2}, replicas={"vision": 2}, ranks=ranks)
    assert [s.rank for s in plan.stages] == [1, 0, 0, 1] and plan.num_ranks == 2
    # every encoder stage on rank 0 puts both replicas on one rank: refused
    with pytest.raises(ValueError, match=r"replicas of a stage need distinct ranks, got \[0, 0\]"):
        plan_pipeline(units, stages_per_module={"llm": 2}, replicas={"vision": 2},
                      ranks=stage_ranks(2, 2, attach_encoders=True))


@pytest.mark.parametrize("replicas, match", [
    ({"llm": 2}, r"replicas\['llm'\]: only encoder modules may be replicated"),
    ({"depth": 2}, r"replicas\['depth'\]: only encoder modules"),
    ({"vision": 0}, r"replicas\['vision'\] must be an integer >= 1, got 0"),
    ({"vision": 1.5}, r"replicas\['vision'\] must be an integer >= 1"),
])
def test_plan_pipeline_refuses_bad_replicas(replicas, match):
    with pytest.raises(ValueError, match=match):
        plan_pipeline(_units(), replicas=replicas)


def test_replicas_need_encoder_parallel():
    units = synthetic_units({"vision": [True] * 2, "audio": [True] * 2}, [True] * 2)
    with pytest.raises(ValueError, match=r"replicas\['vision'\] = 2 needs the encoder_parallel layout"):
        plan_pipeline(units, "encoders_colocated", replicas={"vision": 2})
    stage = Stage(0, ("vision", "audio"), ("vision.0", "audio.0"), 0, True, False, (1, 1), replica=0, replicas=2)
    twin = dataclasses.replace(stage, index=1, rank=1, replica=1)
    llm = Stage(2, ("llm",), ("llm.0", "llm.1"), 2, True, True)
    with pytest.raises(ValueError, match="replicas > 1 needs the encoder_parallel layout"):
        PipelinePlan("encoders_colocated", (stage, twin, llm))


def test_stage_refuses_replicated_llm_and_bad_replica_index():
    with pytest.raises(ValueError, match="replicas=2, but only encoder stages may be replicated"):
        Stage(0, ("llm",), ("llm.0",), 0, True, False, replica=0, replicas=2)
    with pytest.raises(ValueError, match="replica in 0..replicas-1, got replica=2, replicas=2"):
        Stage(0, ("vision",), ("vision.0",), 0, True, False, replica=2, replicas=2)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        Stage(0, ("vision",), ("vision.0",), 0, True, False, replica=0, replicas=0)


def _stages(plan):
    return list(plan.stages)


def test_plan_validation_of_replica_groups():
    plan = _plan()
    stages = _stages(plan)
    # a unit in two stages that are not replicas of one stage
    bad = [dataclasses.replace(s, replica=0, replicas=1) if s.index == 1 else s for s in stages]
    with pytest.raises(ValueError, match="stage 0 .*stage 1 must be replica 1 of it"):
        PipelinePlan("encoder_parallel", tuple(bad))
    # replicas on one rank
    bad = [dataclasses.replace(s, rank=0) if s.index == 1 else s for s in stages]
    bad = [dataclasses.replace(s, rank=s.rank - 1) if s.index > 1 else s for s in bad]
    with pytest.raises(ValueError, match=r"distinct ranks, got \[0, 0\]"):
        PipelinePlan("encoder_parallel", tuple(bad))
    # a replica with other units
    bad = [dataclasses.replace(s, units=("vision.0", "vision.9")) if s.index == 1 else s for s in stages]
    with pytest.raises(ValueError, match="must be replica 1 of it, with the same units"):
        PipelinePlan("encoder_parallel", tuple(bad))
    # the branch's stages disagree on replicas
    units = synthetic_units({"vision": [True] * 2}, [True] * 2)
    one = plan_pipeline(units, stages_per_module={"vision": 2})
    a, b, llm = one.stages
    mixed = (a, dataclasses.replace(a, index=1, rank=1, replica=0, replicas=1),
             dataclasses.replace(b, index=2, rank=2), dataclasses.replace(llm, index=3, rank=3))
    with pytest.raises(ValueError):
        PipelinePlan("encoder_parallel", mixed)
    lone = (dataclasses.replace(a, replicas=2), dataclasses.replace(b, index=1, rank=1, replicas=1),
            dataclasses.replace(llm, index=2, rank=2))
    with pytest.raises(ValueError, match="its 2 replicas must be consecutive stages|must be replica 1"):
        PipelinePlan("encoder_parallel", lone)


def test_plan_units_check_counts_replicas_once():
    plan = _plan()
    check_plan_units(plan, _units())
    frozen = _units(vision_trains=False)
    with pytest.raises(ValueError, match="flags trainable=True"):
        check_plan_units(plan, frozen)


@pytest.mark.parametrize("schedule", [one_f_one_b, zb_h1])
def test_schedules_run_replica_plans(schedule):
    for ranks in (None, stage_ranks(2, 2, in_bubble=True)):
        units = synthetic_units({"vision": [True] * 2}, [True] * 4)
        plan = plan_pipeline(units, stages_per_module={"llm": 2}, replicas={"vision": 2}, ranks=ranks,
                             num_microbatches=4)
        sched = schedule(plan)
        check_schedule(sched)
        # every replica runs every microbatch's forward (an empty share still sends an empty payload)
        forwards = {(a.stage, a.microbatch) for _, a in sched.all_actions() if a.kind == "F"}
        assert {(s, m) for s in (0, 1) for m in range(4)} <= forwards


def _costs():
    units = synthetic_units({"vision": [True] * 2}, [True] * 2)
    costs = {u.name: UnitCost(forward_s=4.0, input_grad_s=2.0, weight_grad_s=6.0, activation_bytes=800,
                              output_bytes=1000) for u in units}
    return units, costs


def test_replica_costs_and_boundary_bytes_divided():
    units, costs = _costs()
    plain = plan_pipeline(units)
    twice = plan_pipeline(units, replicas={"vision": 2})
    base = stage_costs_from_units(plain, units, costs)
    split = stage_costs_from_units(twice, units, costs)
    for kind in ("F", "B", "W"):
        assert split[(0, kind)] == split[(1, kind)] == pytest.approx(base[(0, kind)] / 2)
        assert split[(2, kind)] == base[(1, kind)]  # the LLM stage keeps its cost
    assert boundary_bytes_from_units(plain, costs) == {0: 1000, 1: 1000}
    assert boundary_bytes_from_units(twice, costs) == {0: 500, 1: 500, 2: 1000}
    # two replicas of a slow encoder halve its bottleneck: the simulated step is shorter
    slow = {n: dataclasses.replace(c, forward_s=c.forward_s * (5 if n.startswith("vision") else 1))
            for n, c in costs.items()}
    times = [simulate(one_f_one_b(p, 8), stage_costs_from_units(p, units, slow)).makespan_s for p in (plain, twice)]
    assert times[1] < times[0]


def test_replica_activation_memory_divided():
    from plait.planner.search.layout import _stage_memory
    from plait.planner.cost.types import OptimizerSpec
    units, costs = _costs()
    plain = _stage_memory(plan_pipeline(units), units, costs, "fp32", OptimizerSpec())
    twice = _stage_memory(plan_pipeline(units, replicas={"vision": 2}), units, costs, "fp32", OptimizerSpec())
    assert twice[0].activation_bytes == twice[1].activation_bytes == plain[0].activation_bytes // 2
    assert twice[0].static_bytes == plain[0].static_bytes and twice[2] == plain[1]


@pytest.mark.parametrize("costs, replicas, want", [
    ([1, 1, 1, 1], 2, ((0, 2), (2, 4))),
    ([5, 1, 1, 1], 2, ((0, 1), (1, 4))),
    ([1, 1, 1, 1, 4], 2, ((0, 4), (4, 5))),
    ([1, 2, 3], 1, ((0, 3),)),
    ([2, 2], 2, ((0, 1), (1, 2))),
    ([1], 3, ((0, 1), (1, 1), (1, 1))),
    ([], 2, ((0, 0), (0, 0))),
])
def test_replica_row_slices(costs, replicas, want):
    got = plan_replica_rows(costs, replicas)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(costs) and all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_replica_row_slices_refuse_bad_input():
    with pytest.raises(ValueError, match="replicas must be an integer >= 1, got 0"):
        plan_replica_rows([1.0], 0)
    with pytest.raises(ValueError, match="row costs must be finite and >= 0, got -1.0"):
        plan_replica_rows([1.0, -1.0], 2)
