"""The exact energy frontier (HiGHS) prints nothing: HiGHS' banner ("Running HiGHS ...") used to reach stdout before
``output_flag`` took effect, because ``highspy.Highs()`` calls the solver while it is constructed."""

from __future__ import annotations

import highspy

from plait.planner.energy.exact import exact_choices, quiet_highs
from plait.planner.energy.frontier import schedule_energy_dag
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedules import one_f_one_b


def test_quiet_highs_prints_no_banner(capfd):
    h = quiet_highs(highspy)
    h.addVars(2, [0.0, 0.0], [1.0, 1.0])
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    assert capfd.readouterr().out == ""


def test_exact_frontier_prints_nothing(capfd):
    plan = plan_pipeline(synthetic_units({}, [True, True]), stages_per_module={"llm": 2})
    options = {(s, k): [(1980, 1.0 + s, 300.0), (1500, 1.5 + s, 200.0)] for s in range(2) for k in "FB"}
    dag = schedule_energy_dag(one_f_one_b(plan, 2), options, blocking_w=50.0)
    assert len(exact_choices(dag)) >= 2
    assert capfd.readouterr().out == ""
