"""Pure pieces of the resilient loop: the global batch's microbatches and the launch plan's JSON."""

from __future__ import annotations

import pytest

from plait.planner.resilience.templates import plan_instantiation
from plait.train.resilient import LaunchPlan, microbatch_ranges
from tests.helpers.templates import templates


def test_microbatch_ranges_keep_order_and_leave_short_batches_empty_at_the_end():
    assert microbatch_ranges([5, 1, 4, 2, 3], 2, 3) == [[5, 1], [4, 2], [3]]
    assert microbatch_ranges([7, 8], 1, 4) == [[7], [8], [], []]
    with pytest.raises(ValueError, match="5 samples do not fit 2 microbatches of 2"):
        microbatch_ranges([1, 2, 3, 4, 5], 2, 2)
    with pytest.raises(ValueError, match="microbatch_size >= 1"):
        microbatch_ranges([1], 0, 2)


def test_launch_plan_round_trips_through_json():
    ts = templates(8, 1)
    plan = LaunchPlan(ts, plan_instantiation(ts), 7.5, ((4, 1), (0, 3)), ((4, 5),))
    back = LaunchPlan.from_json(plan.to_json())
    assert back == plan
    assert back.instantiation.describe() == plan.instantiation.describe()
