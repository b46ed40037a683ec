"""The feature-routing planner (plait.planner.microbatch.routing): views, rows, sources and users from a MicrobatchPlan, on
real values."""

from __future__ import annotations

import pytest

from plait.planner.microbatch import MicrobatchPlan
from plait.planner.microbatch.routing import FeatureRouting, plan_feature_routing

# one replica, 3 microbatches: sample 1's LLM work deferred from encoder microbatch 0 to 2; microbatch 1 holds
# sample 2 only; a second replica holds sample 3
PLAN = MicrobatchPlan("hierarchical", 2, 3, 0, (((0, 1), (2,), ()), ((3,), (), ())),
                      (((0, 2), (1,), ()), ((0,), (), ())))
FEATURES = {0: {"vision": 2}, 1: {"vision": 3, "audio": 1}, 2: {"audio": 2}, 3: {}}


def test_plan_feature_routing_gives_views_rows_sources_and_users():
    routing = plan_feature_routing(PLAN, 0, FEATURES)
    assert routing.encoder_samples == ((0, 1), (2,), ())
    assert routing.llm_samples == ((0,), (2,), (1,))
    assert routing.defers
    assert routing.rows == {0: {"vision": (0, 2)}, 1: {"vision": (2, 5), "audio": (0, 1)}, 2: {"audio": (0, 2)}}
    assert routing.sources == ((0,), (1,), (0,)) and routing.users == ((0, 2), (1,), ())
    assert routing.spans(2, "vision") == ((0, 2, 5),) and routing.spans(0, "audio") == ()
    assert routing.encoder_rows(0, "vision") == 5 and routing.encoder_rows(1, "vision") == 0
    assert FeatureRouting.from_json(routing.to_json()) == routing
    other = plan_feature_routing(PLAN, 1, FEATURES)  # microbatches empty in both views are dropped
    assert other.encoder_samples == ((3,),) and other.llm_samples == ((3,),) and not other.defers
    with pytest.raises(ValueError, match="no features entry"):
        plan_feature_routing(PLAN, 0, {0: {}})
    with pytest.raises(ValueError, match="rank 2 outside"):
        plan_feature_routing(PLAN, 2, FEATURES)


def test_routing_rejects_inconsistent_views():
    feats = {0: {}, 1: {}}
    with pytest.raises(ValueError, match="sample 1 has encoder microbatch 1 but LLM microbatch 0"):
        FeatureRouting(((0,), (1,)), ((0, 1), ()), feats)
    with pytest.raises(ValueError, match="in one view only"):
        FeatureRouting(((0,), (1,)), ((0,), ()), feats)
    with pytest.raises(ValueError, match="microbatches 0 and 1"):
        FeatureRouting(((0,), (0, 1)), ((0,), (1,)), feats)
    with pytest.raises(ValueError, match="no features entry"):
        FeatureRouting(((0, 2),), ((0, 2),), feats)
