"""Typed plan requests: ``Machine`` and ``SearchSpace`` round-trip through JSON, and a search with no fitting plan
raises ``NoPlanFits`` (a ``ValueError``) carrying the least need the planner computed (``fit.least_need``)."""

from __future__ import annotations

import json

import pytest

from plait.planner.search.fit import least_need
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.types import ActionOverheads, HostSpec
from plait.planner.search.types import Machine, NoPlanFits, SearchSpace
from plait.planner.search.parallel import degree_options, plan_parallel
from plait.planner.pipeline.types import P2PModel
from tests.helpers.sharding import vit_llm


def test_requests_round_trip_through_json():
    machine = Machine(memory_cap=1e9, p2p=P2PModel(1e-5, 1e10), dp_link=None, dtype="float32",
                      overheads=ActionOverheads(per_action_s=1e-4), host=None, dp_shard=2)
    space = SearchSpace(layouts=["encoder_parallel"], dp_degrees=[1, 2], virtual_stages=[1, 2], attach_encoders=True,
                        checkpoint_overrides={"vision": "full"}, tp_degrees=[1], offload="cpu")
    assert space.layouts == ("encoder_parallel",) and space.dp_degrees == (1, 2)  # sequences kept as tuples
    for value in (machine, space, Machine(), SearchSpace()):
        assert type(value).from_dict(json.loads(json.dumps(value.to_dict()))) == value


def test_no_plan_fits_carries_the_least_need():
    units, costs = vit_llm()
    whole = plan_parallel(units, costs, 1, microbatches=4).stage_memory_bytes[0]
    with pytest.raises(NoPlanFits) as info:
        plan_parallel(units, costs, 2, microbatches=4, machine=Machine(memory_cap=1e-3 * whole))
    least = info.value.least
    assert isinstance(info.value, ValueError) and str(info.value).startswith("no plan fits")
    need, degrees = least_need(consistent_units(units), costs, 2, degree_options(2), host=HostSpec())
    assert (least.bytes, least.degrees) == (pytest.approx(need), degrees) and least.bytes > 1e-3 * whole
    with pytest.raises(NoPlanFits) as no_host:
        plan_parallel(units, costs, 2, microbatches=4, machine=Machine(memory_cap=1e-3 * whole, host=None))
    assert not no_host.value.least.offloaded
    assert no_host.value.least.bytes == pytest.approx(least_need(units, costs, 2, degree_options(2))[0])
