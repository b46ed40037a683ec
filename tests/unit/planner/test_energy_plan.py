"""The frequency plan file (planner.energy_plan): JSON round trip, point choice for a time, defaults."""

import pytest

from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint, action_label, parse_action_label


def _plan() -> EnergyPlan:
    fast = FrontierPoint(1.0, 500.0, (ActionFrequency(0, "F s0 m0", 1980),))
    mid = FrontierPoint(1.2, 400.0, (ActionFrequency(0, "F s0 m0", 1400), ActionFrequency(1, "B s1 m0", 1200)))
    slow = FrontierPoint(1.5, 380.0, (ActionFrequency(1, "B s1 m0", 900),))
    return EnergyPlan("h100", 1980, (fast, mid, slow))


def test_json_round_trip():
    plan = _plan()
    assert EnergyPlan.from_json(plan.to_json()) == plan
    assert EnergyPlan.from_json(plan.to_json(indent=2)).points[1].frequencies[1] == ActionFrequency(1, "B s1 m0", 1200)


def test_point_for_picks_least_energy_within_time():
    plan = _plan()
    assert plan.point_for(1.0).energy_j == 500.0
    assert plan.point_for(1.3).energy_j == 400.0
    assert plan.point_for(2.0).energy_j == 380.0
    assert plan.point_for(0.5).iteration_time_s == 1.0  # none within: the fastest


def test_frequency_of_defaults_to_max():
    plan = _plan()
    mid = plan.points[1]
    assert plan.frequency_of(mid, 0, "F s0 m0") == 1400
    assert plan.frequency_of(mid, 1, "B s1 m0") == 1200
    assert plan.frequency_of(mid, 1, "F s1 m0") == 1980


def test_labels():
    assert action_label("F", 1, 3) == "F s1 m3"
    assert parse_action_label("W s12 m0") == ("W", 12, 0)
    with pytest.raises(ValueError, match="not '<F|B|W>"):
        parse_action_label("F1.3")


def test_invalid():
    with pytest.raises(ValueError, match="sorted by iteration time"):
        EnergyPlan("h100", 1980, (FrontierPoint(2.0, 1.0), FrontierPoint(1.0, 2.0)))
    with pytest.raises(ValueError, match="twice"):
        FrontierPoint(1.0, 1.0, (ActionFrequency(0, "F s0 m0", 1), ActionFrequency(0, "F s0 m0", 2)))
    with pytest.raises(ValueError, match="frequency_mhz must be > 0"):
        ActionFrequency(0, "F s0 m0", 0)
    with pytest.raises(ValueError, match="no frontier point"):
        EnergyPlan("h100", 1980).point_for(1.0)
