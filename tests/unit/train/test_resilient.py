"""Pure pieces of the resilient loop: the global batch's microbatches and the launch plan's JSON."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.planner.microbatch.types import ModuleCostCoeffs
from plait.planner.resilience.templates import plan_instantiation
from plait.train.batches import plan_global_batch
from plait.train.launch_plan import LaunchPlan
from plait.train.resilient import pipeline_microbatches
from tests.helpers.templates import templates


def _plan(cfg, lengths: list[int], microbatches: int, step: int = 0):
    """The job's plan of a global batch of text samples of ``lengths`` tokens, one replica."""
    metas = [{"text_tokens": n, "items": ()} for n in lengths]
    return plan_global_batch(cfg, metas, {"llm": ModuleCostCoeffs(linear=1.0)}, 1, microbatches, step,
                             allow_deferral=False)[0]


def test_pipeline_microbatches_split_the_jobs_plan_over_the_pipelines():
    arrival = SimpleNamespace(train=SimpleNamespace(microbatch_policy="arrival", seed=0))
    # pipelines of 2 and 1 microbatches: a full batch is cut into consecutive pairs
    assert pipeline_microbatches([5, 1, 4, 2, 3, 0], _plan(arrival, [8] * 6, 3), (2, 1)) == [[[5, 1], [4, 2]],
                                                                                              [[3, 0]]]
    # a short batch (an epoch's last) is spread over every microbatch, sizes differing by at most one
    assert pipeline_microbatches([5, 1, 4, 2, 3], _plan(arrival, [8] * 5, 3), (2, 1)) == [[[5, 1], [4, 2]], [[3]]]
    # fewer samples than microbatches: the last ones empty, a pipeline of 0 microbatches gets none
    assert pipeline_microbatches([7, 8], _plan(arrival, [8] * 2, 4), (3, 0, 1)) == [[[7], [8], []], [], [[]]]
    with pytest.raises(ValueError, match="1 replicas x 3 microbatches for pipelines of \\[1, 1\\]"):
        pipeline_microbatches([1, 2, 3], _plan(arrival, [8] * 3, 3), (1, 1))


def test_the_pipelines_microbatches_follow_the_jobs_policy():
    """The job's ``train.microbatch_policy`` balances the pipelines' microbatches as it balances replicas."""
    lpt = SimpleNamespace(train=SimpleNamespace(microbatch_policy="lpt", seed=0))
    lengths = [90, 80, 70, 30, 20, 10]
    split = pipeline_microbatches(list(range(6)), _plan(lpt, lengths, 3), (2, 1))
    assert sorted(sum(lengths[i] for i in mb) for pipeline in split for mb in pipeline) == [100, 100, 100]
    assert sorted(len(mb) for pipeline in split for mb in pipeline) == [2, 2, 2]
    arrival = SimpleNamespace(train=SimpleNamespace(microbatch_policy="arrival", seed=0))
    plain = pipeline_microbatches(list(range(6)), _plan(arrival, lengths, 3), (2, 1))
    assert [sum(lengths[i] for i in mb) for pipeline in plain for mb in pipeline] == [170, 100, 30]


def test_launch_plan_round_trips_through_json():
    ts = templates(8, 1)
    plan = LaunchPlan(ts, plan_instantiation(ts), 7.5, ((4, 1), (0, 3)), ((4, 5),))
    back = LaunchPlan.from_json(plan.to_json())
    assert back == plan
    assert back.instantiation.describe() == plan.instantiation.describe()
