"""The one JSON round trip of planner dataclasses (plait.planner.serialize), property-tested on the real types."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.cost.types import DeviceSpec, MicrobatchShape, OptimizerSpec, UnitEstimate
from plait.planner.microbatch import (
    METHODS,
    MicrobatchPlan,
    MicrobatchPolicy,
    ModuleCostCoeffs,
    SampleCost,
    WorkloadStats,
    plan_microbatches,
    workload_stats,
)
from plait.planner.search.partitioner import partition_units
from plait.planner.search.types import UnitPartition
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import PipelinePlan, Stage
from plait.planner.serialize import JsonDataclass, dataclass_from_dict, dataclass_to_dict
from plait.planner.token_distributor import TokenAssignment, plan_tokens
from plait.planner.types import UNIT_KINDS, Unit, UnitCost

SETTINGS = settings(max_examples=40, deadline=None)
names = st.text("abcdefgh.0123456789", min_size=1, max_size=12)
nonneg = st.floats(0, 1e12, allow_nan=False)
counts = st.integers(0, 10**9)


def _round_trip(obj):
    """``obj`` through ``to_dict`` and JSON text and back; checks the JSON equals the fields' ``asdict`` JSON
    (the format of the hand-written methods this replaced) and that the object comes back equal."""
    text = json.dumps(obj.to_dict())
    assert text == json.dumps(dataclasses.asdict(obj))
    back = type(obj).from_dict(json.loads(text))
    assert back == obj
    assert json.dumps(back.to_dict()) == text
    return back


units = st.builds(Unit, names, names, st.sampled_from(UNIT_KINDS), st.booleans(), st.booleans())
unit_costs = st.builds(UnitCost, nonneg, nonneg, nonneg, counts, counts, counts)
devices = st.builds(DeviceSpec, names, st.floats(1, 1e16), st.floats(0.01, 1), st.floats(1, 1e12),
                    st.floats(1, 1e13), st.floats(1, 1e12), st.floats(0, 1))
shapes = st.builds(MicrobatchShape, st.integers(1, 10**6), st.none() | st.integers(1, 4096), st.none() | nonneg)
optimizers = st.builds(OptimizerSpec, st.none() | st.floats(0, 16), st.floats(0, 16))
estimates = st.builds(UnitEstimate, counts, nonneg, nonneg, nonneg, nonneg, nonneg, nonneg, st.booleans())
coeffs = st.builds(ModuleCostCoeffs, nonneg, nonneg, nonneg, st.booleans(), st.none() | st.booleans(),
                   st.floats(0.25, 16))
policies = st.builds(MicrobatchPolicy, st.sampled_from(METHODS), st.integers(1, 4), st.integers(1, 4),
                     st.integers(0, 99), st.booleans(), st.none() | st.integers(64, 4096), st.booleans(),
                     st.integers(0, 4), st.integers(0, 3))


@SETTINGS
@given(st.one_of(units, unit_costs, devices, shapes, optimizers, estimates, coeffs, policies))
def test_plain_planner_types_round_trip(obj):
    _round_trip(obj)


@st.composite
def sample_costs(draw):
    n, modules = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    work = st.lists(st.floats(0, 100, allow_nan=False), min_size=modules, max_size=modules)
    return [SampleCost(i, tuple(draw(work)[:-1]) + (draw(st.floats(0.1, 100)),), draw(st.integers(1, 512)))
            for i in range(n)]


@SETTINGS
@given(sample_costs(), policies, st.integers(0, 5))
def test_microbatch_plans_and_stats_round_trip(costs, policy, step):
    policy = dataclasses.replace(policy, max_tokens_per_microbatch=None)
    plan = plan_microbatches(costs, policy, step)
    assert isinstance(_round_trip(plan), MicrobatchPlan)
    stats = workload_stats(plan, costs)
    assert isinstance(_round_trip(stats), WorkloadStats)
    for cost in costs:
        _round_trip(cost)


@st.composite
def pipeline_plans(draw):
    flags = st.lists(st.booleans(), min_size=2, max_size=6)
    encoders = {name: draw(flags) for name in draw(st.lists(st.sampled_from(["vision", "audio"]), unique=True))}
    built = synthetic_units(encoders, draw(flags))
    per_module = {m: draw(st.integers(1, 2)) for m in [*encoders, "llm"]}
    layout = "encoders_colocated" if len(set(per_module[m] for m in encoders)) == 1 and draw(st.booleans()) \
        else "encoder_parallel"
    return built, plan_pipeline(built, layout, stages_per_module=per_module, num_microbatches=draw(st.integers(1, 8)))


@SETTINGS
@given(pipeline_plans())
def test_pipeline_plans_and_partitions_round_trip(built):
    units_, plan = built
    back = _round_trip(plan)
    assert all(isinstance(s, Stage) for s in back.stages) and all(isinstance(e, tuple) for e in back.edges)
    assert PipelinePlan.from_json(plan.to_json(indent=1)) == plan
    costs = [UnitCost(1.0 + i, 0.5, 0.5, 10 * i, 5, 3) for i in range(len(units_))]
    part = partition_units(units_, costs, 2)
    assert isinstance(_round_trip(part), UnitPartition)


@SETTINGS
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=16), st.integers(1, 4),
       st.sampled_from(["uniform", "zigzag", "lpt"]))
def test_token_assignments_round_trip(work, cp, method):
    assignment = plan_tokens(work, len(work) * 4, min(cp, len(work)), method=method, block_size=4)
    back = _round_trip(assignment)
    assert isinstance(back.ranges[0], tuple) and isinstance(back.work, tuple)


# ------------------------------------------------------------------ the rules themselves


@dataclass(frozen=True)
class _Leaf(JsonDataclass):
    x: int
    tag: str = ""


@dataclass(frozen=True)
class _Tree(JsonDataclass):
    leaves: tuple[_Leaf, ...]
    by_rank: dict[int, tuple[int, int]]
    pair: tuple[int, str]
    best: _Leaf | None = None
    names: list[str] = dataclasses.field(default_factory=list)


def test_nested_int_keys_optional_and_fixed_tuples():
    tree = _Tree((_Leaf(1), _Leaf(2, "b")), {0: (1, 2), 3: (4, 5)}, (7, "s"), _Leaf(9), ["a"])
    data = json.loads(tree.to_json())
    assert data["by_rank"] == {"0": [1, 2], "3": [4, 5]}
    assert _Tree.from_dict(data) == tree
    assert _Tree.from_dict({**data, "best": None}).best is None
    assert dataclass_to_dict(tree) == tree.to_dict()


def test_unknown_and_missing_fields_are_named():
    with pytest.raises(ValueError, match=r"_Leaf: unknown field\(s\) \['y', 'z'\]"):
        _Leaf.from_dict({"x": 1, "y": 2, "z": 3})
    with pytest.raises(ValueError, match=r"_Tree: missing field\(s\) \['by_rank', 'pair'\]"):
        _Tree.from_dict({"leaves": []})
    with pytest.raises(ValueError, match="expected a JSON object"):
        dataclass_from_dict(_Leaf, [1])
    with pytest.raises(ValueError, match="needs a dataclass instance"):
        dataclass_to_dict(_Leaf)
