"""Encoders in the LLM's bubbles in the layout search: the encoders one stage on the last LLM rank
(``plan.stage_ranks(..., in_bubble=True)``), timed on the list-scheduled 1F1B orders; the search weighs it beside
encoders on ranks of their own and attached to the first LLM rank, its planned time equals the simulator's, and the
job tables written for it rebuild the same plan."""

from __future__ import annotations

import pytest

from plait.config.loader import pipeline_plan_kwargs
from plait.config.schema import PipelineConfig
from plait.planner.pipeline.plan import plan_pipeline, stage_ranks, synthetic_units
from plait.planner.search.auto_layout import layout_pp_fields
from plait.planner.cost.types import OptimizerSpec
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.bounds import in_bubble_stream
from plait.planner.search.candidates import counts_tuple, interleaved_candidate
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.model import Partitions, SearchModel
from plait.planner.search.types import SearchSpace
from plait.planner.types import UnitCost

# a frozen 4-unit vision encoder (forward only) and an 8-unit trainable LLM
UNITS = synthetic_units({"vision": [False] * 4}, [True] * 8)
COSTS = {u.name: UnitCost(0.002, 0.0, 0.0, param_bytes=10**6, activation_bytes=10**6) if u.module == "vision"
         else UnitCost(0.004, 0.004, 0.004, param_bytes=10**6, activation_bytes=10**6) for u in UNITS}


def _plan(**space):
    return plan_layout(UNITS, COSTS, 4, microbatches=8, space=SearchSpace(dp_degrees=(1,), **space))


def test_the_search_puts_the_encoders_in_the_last_llm_ranks_bubbles_when_that_is_faster():
    own, bubble = _plan(), _plan(in_bubble=True)
    assert [s.rank for s in own.plan.stages] == [0, 1, 2, 3]  # vision on a rank of its own, the LLM on 3
    # the encoder on LLM rank 3 (of 4): its forwards run while that rank waits for the first microbatch
    assert [s.rank for s in bubble.plan.stages] == [3, 0, 1, 2, 3] == list(stage_ranks(1, 4, in_bubble=True))
    assert bubble.schedule == "1f1b" and bubble.iteration_s < own.iteration_s
    # the search's planned time is the simulator's on the schedule it runs (one timing engine)
    replay = evaluate_plan(bubble.plan, UNITS, COSTS, dp=1, microbatches=8, schedule="1f1b")
    assert bubble.planned_iteration_s == pytest.approx(replay.iteration_s, rel=1e-9)
    assert bubble.iteration_s == pytest.approx(replay.iteration_s, rel=1e-9)


def test_the_search_weighs_in_bubble_beside_attached_encoders_and_keeps_the_faster():
    attached, bubble = _plan(attach_encoders=True), _plan(in_bubble=True)
    both = _plan(attach_encoders=True, in_bubble=True)
    assert both.iteration_s == pytest.approx(min(attached.iteration_s, bubble.iteration_s), rel=1e-12)


def test_in_bubble_bounds_stay_below_the_timed_candidates():
    model = SearchModel(UNITS, COSTS, True, "bfloat16", OptimizerSpec())
    parts = Partitions(model, None)
    stream = in_bubble_stream(parts, 1, 4, 8, P2PModel())
    assert stream is not None and stream.in_bubble and sorted(int(p) for _, p in stream.counts) == [2, 3, 4]
    for bound, row in zip(stream.bounds, stream.counts):
        counts = counts_tuple(model, stream.layout, row)
        found = interleaved_candidate(parts, stream, counts, P2PModel(), None)
        assert found is not None and bound <= found.time * (1 + 1e-9), (counts, bound, found.time)


def test_the_job_tables_of_an_in_bubble_plan_rebuild_it():
    choice = _plan(in_bubble=True, schedules=("1f1b", "zb_h1", "zb_h2"))
    fields = layout_pp_fields(choice, UNITS)
    assert fields["encoders_in_bubble"] is True and fields["attach_encoders"] is False
    assert fields["layout"] == "encoders_colocated" and fields["schedule"] in ("1f1b", "zb_h1", "zb_h2")
    pp = PipelineConfig(**fields)
    kwargs = pipeline_plan_kwargs(pp, ["vision"])
    rebuilt = plan_pipeline(UNITS, pp.layout, **kwargs)
    assert [s.rank for s in rebuilt.stages] == [s.rank for s in choice.plan.stages]
    assert [s.units for s in rebuilt.stages] == [s.units for s in choice.plan.stages]
