"""Straggler reaction policy (planner.straggler): hysteresis in and out, the point each replica runs."""

import pytest

from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint
from plait.planner.resilience.straggler import react_to_stragglers, replica_point
from plait.planner.resilience.types import StragglerPolicy, StragglerState

PLAN = EnergyPlan("h100", 1980, (
    FrontierPoint(1.0, 500.0, (ActionFrequency(0, "F s0 m0", 1800),)),
    FrontierPoint(1.2, 420.0, (ActionFrequency(0, "F s0 m0", 1400),)),
    FrontierPoint(1.5, 380.0, (ActionFrequency(0, "F s0 m0", 1000),)),
))


def _run(policy, times_per_step):
    state, out = StragglerState(), []
    for times in times_per_step:
        state = react_to_stragglers(policy, state, times)
        out.append((state.straggler, round(state.slowdown, 6)))
    return out


def test_switches_after_patience_and_back_after_patience():
    policy = StragglerPolicy(slow_ratio=1.15, recover_ratio=1.05, patience=2)
    steps = [[1.0, 1.0], [1.0, 1.25], [1.0, 1.25], [1.0, 1.3], [1.0, 1.1], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    assert _run(policy, steps) == [(-1, 1.0), (-1, 1.0), (1, 1.25), (1, 1.3), (1, 1.3), (1, 1.3), (-1, 1.0),
                                   (-1, 1.0)]


def test_a_single_slow_step_does_not_switch():
    policy = StragglerPolicy(patience=3)
    assert _run(policy, [[1.0, 1.5], [1.0, 1.5], [1.0, 1.0], [1.0, 1.5], [1.0, 1.5]]) == [(-1, 1.0)] * 5


def test_between_the_ratios_keeps_the_state():
    policy = StragglerPolicy(slow_ratio=1.2, recover_ratio=1.05, patience=1)
    assert _run(policy, [[1.3, 1.0, 1.0], [1.1, 1.0, 1.0], [1.04, 1.0, 1.0]]) == [(0, 1.3), (0, 1.3), (-1, 1.0)]


def test_replica_point_slows_the_others_only():
    state = StragglerState(straggler=1, slowdown=1.3)
    assert replica_point(PLAN, state, 1) == PLAN.points[0]
    assert replica_point(PLAN, state, 0) == PLAN.points[1]  # T* x 1.3 = 1.3 s: the 1.2 s point fits
    assert replica_point(PLAN, StragglerState(1, 1.6), 0) == PLAN.points[2]
    assert replica_point(PLAN, StragglerState(), 0) == PLAN.points[0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="recover_ratio < slow_ratio"):
        StragglerPolicy(slow_ratio=1.05, recover_ratio=1.1)
    with pytest.raises(ValueError, match="one positive time per DP replica"):
        react_to_stragglers(StragglerPolicy(), StragglerState(), [1.0, 0.0])
    with pytest.raises(ValueError, match="no frontier point"):
        replica_point(EnergyPlan("h100", 1980), StragglerState(), 0)
