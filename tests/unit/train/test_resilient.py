"""Pure pieces of the resilient loop: the global batch's microbatches and the launch plan's JSON."""

from __future__ import annotations

import pytest

from plait.planner.resilience.templates import plan_instantiation
from plait.train.resilient import LaunchPlan, pipeline_microbatches
from tests.helpers.templates import templates


def test_pipeline_microbatches_cut_the_global_batch_in_arrival_order_through_the_planner():
    # pipelines of 2 and 1 microbatches of 2 samples: a full batch is cut into consecutive pairs
    assert pipeline_microbatches([5, 1, 4, 2, 3, 0], 2, (2, 1)) == [[[5, 1], [4, 2]], [[3, 0]]]
    # a short batch (an epoch's last) is spread over every microbatch, sizes differing by at most one
    assert pipeline_microbatches([5, 1, 4, 2, 3], 2, (2, 1)) == [[[5, 1], [4, 2]], [[3]]]
    assert pipeline_microbatches([5, 1, 4], 2, (2, 1)) == [[[5], [1]], [[4]]]
    # fewer samples than microbatches: the last ones empty, a pipeline of 0 microbatches gets none
    assert pipeline_microbatches([7, 8], 1, (3, 0, 1)) == [[[7], [8], []], [], [[]]]
    with pytest.raises(ValueError, match="5 samples do not fit 2 microbatches of 2"):
        pipeline_microbatches([1, 2, 3, 4, 5], 2, (1, 1))
    with pytest.raises(ValueError, match="microbatch_size >= 1"):
        pipeline_microbatches([1], 0, (2,))


def test_launch_plan_round_trips_through_json():
    ts = templates(8, 1)
    plan = LaunchPlan(ts, plan_instantiation(ts), 7.5, ((4, 1), (0, 3)), ((4, 5),))
    back = LaunchPlan.from_json(plan.to_json())
    assert back == plan
    assert back.instantiation.describe() == plan.instantiation.describe()
