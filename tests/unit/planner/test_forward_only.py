"""schedules.forward_only: the evaluation schedule runs every stage's forward of every microbatch, no backward,
in an order without deadlock, also when a rank holds several stages (attached encoders, interleaved LLM stages)."""

from __future__ import annotations

import pytest

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedule_ir import Action, run_blocking
from plait.planner.pipeline.schedules import forward_only


def _plan(ranks):
    units = synthetic_units({"vision": [False, True, True], "audio": [True, True]}, [True] * 6)
    return plan_pipeline(units, "encoder_parallel", stages_per_module={"vision": 1, "audio": 1, "llm": 4},
                         ranks=ranks)


@pytest.mark.parametrize("ranks", [None, [0, 0, 0, 1, 0, 1], [2, 3, 0, 1, 0, 1]])
def test_forward_only_has_every_forward_and_cannot_deadlock(ranks):
    plan = _plan(ranks)
    schedule = forward_only(plan, 3)
    got = sorted((a.stage, a.microbatch) for _, a in schedule.all_actions())
    assert got == sorted((s.index, m) for s in plan.stages for m in range(3))
    assert {a.kind for _, a in schedule.all_actions()} == {"F"}
    heads = run_blocking(schedule)
    assert heads == [len(a) for a in schedule.actions]


def test_forward_only_runs_a_ranks_stages_by_microbatch_from_the_input_side():
    plan = _plan([0, 0, 0, 1, 0, 1])  # vision, audio, LLM 0 and 2 on rank 0; LLM 1 and 3 on rank 1
    schedule = forward_only(plan, 2)
    assert schedule.actions[0] == tuple(Action("F", s, m) for m in range(2) for s in (0, 1, 2, 4))
    assert schedule.actions[1] == tuple(Action("F", s, m) for m in range(2) for s in (3, 5))
    with pytest.raises(ValueError, match="num_microbatches"):
        forward_only(plan, 0)
