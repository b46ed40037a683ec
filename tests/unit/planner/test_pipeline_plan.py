"""Pipeline plans: partitioning, DAG edges, frozen flags, validation and JSON round trips."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.pipeline.plan import check_plan_units, plan_pipeline, synthetic_units
from plait.planner.pipeline.types import PipelinePlan, Stage
from plait.planner.types import Unit


def _names(module: str, n: int) -> list[str]:
    return [f"{module}.{i}" for i in range(n)]


def test_synthetic_units_flags_follow_definition():
    units = synthetic_units({"vision": [False, False, True], "audio": [False, False]}, [False, True, False])
    flags = {u.name: (u.trainable, u.needs_input_grad) for u in units}
    # vision: frozen, frozen, trainable projector -> nothing upstream of the projector trains
    assert flags["vision.0"] == (False, False) and flags["vision.2"] == (True, False)
    assert flags["audio.1"] == (False, False)
    # the LLM sits after a trainable projector: every LLM unit needs an input gradient
    assert all(flags[f"llm.{i}"][1] for i in range(3))
    assert [u.kind for u in units if u.module == "vision"] == ["embed", "layer", "projector"]
    assert [u.kind for u in units if u.module == "llm"] == ["embed", "layer", "head"]


def test_even_split_sizes_and_order():
    units = synthetic_units({}, [True] * 10)
    plan = plan_pipeline(units, stages_per_module={"llm": 3})
    assert [len(s.units) for s in plan.stages] == [4, 3, 3]
    assert [n for s in plan.stages for n in s.units] == _names("llm", 10)
    assert plan.edges == ((0, 1), (1, 2))
    assert [s.rank for s in plan.stages] == [0, 1, 2]


def test_encoder_parallel_dag():
    units = synthetic_units({"vision": [True] * 5, "audio": [False] * 3}, [True] * 6)
    plan = plan_pipeline(units, "encoder_parallel", stages_per_module={"vision": 2, "llm": 3})
    assert [s.modules for s in plan.stages] == [("vision",), ("vision",), ("audio",), ("llm",), ("llm",), ("llm",)]
    assert plan.stages[0].units == ("vision.0", "vision.1", "vision.2")
    assert plan.stages[1].units == ("vision.3", "vision.4")  # the projector sits on the branch's last stage
    assert plan.edges == ((0, 1), (1, 3), (2, 3), (3, 4), (4, 5))
    assert plan.predecessors(3) == (1, 2)
    # depth = S_enc + S_llm - i for encoder stage i, S_llm - j for LLM stage j
    assert [plan.depth(s) for s in range(6)] == [2 + 3 - 0, 2 + 3 - 1, 1 + 3 - 0, 3, 2, 1]
    assert plan.encoder_modules == ("vision", "audio") and plan.llm_stages == (3, 4, 5)
    assert plan.stage_of_unit("audio.1") == 2
    assert plan.num_ranks == 6


def test_encoders_colocated_line():
    units = synthetic_units({"vision": [True] * 4, "audio": [True] * 2}, [True] * 4)
    plan = plan_pipeline(units, "encoders_colocated", stages_per_module={"vision": 2, "audio": 2, "llm": 2})
    assert [s.modules for s in plan.stages] == [("vision", "audio")] * 2 + [("llm",)] * 2
    assert plan.stages[0].units == ("vision.0", "vision.1", "audio.0")
    assert plan.stages[0].module_units("audio") == ("audio.0",)
    assert plan.stages[1].module_units("vision") == ("vision.2", "vision.3")
    assert plan.edges == ((0, 1), (1, 2), (2, 3))
    assert [plan.depth(s) for s in range(4)] == [4, 3, 2, 1]


def test_frozen_flags_per_stage():
    # frozen vision layers + trainable projector, frozen LLM (LLaVA stage 1)
    units = synthetic_units({"vision": [False, False, False, True]}, [False] * 4)
    plan = plan_pipeline(units, stages_per_module={"vision": 2, "llm": 2})
    flags = [(s.trainable, s.needs_input_grad, s.runs_backward) for s in plan.stages]
    assert flags == [(False, False, False), (True, False, True), (False, True, True), (False, True, True)]


def test_explicit_splits_and_shared_ranks():
    units = synthetic_units({"vision": [True] * 4}, [True] * 6)
    plan = plan_pipeline(
        units, splits={"vision": ["vision.1"], "llm": ["llm.2", "llm.5"]}, ranks=[0, 0, 1, 2, 1]
    )
    assert [s.units for s in plan.stages] == [
        ("vision.0",), ("vision.1", "vision.2", "vision.3"), ("llm.0", "llm.1"), ("llm.2", "llm.3", "llm.4"), ("llm.5",)
    ]  # fmt: skip
    assert plan.stages_on_rank(0) == (0, 1) and plan.stages_on_rank(1) == (2, 4)
    assert plan.num_ranks == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"splits": {"llm": ["llm.9"]}}, "not a unit"),
        ({"splits": {"llm": ["llm.3", "llm.2"]}}, "out of order"),
        ({"splits": {"llm": ["llm.0"]}}, "first unit"),
        ({"splits": {"llm": ["llm.2", "llm.2"]}}, "repeated"),
        ({"splits": {"llm": ["llm.2"]}, "stages_per_module": {"llm": 2}}, "both"),
        ({"stages_per_module": {"text": 2}}, "unknown module"),
        ({"stages_per_module": {"llm": 7}}, "1..6"),
        ({"stages_per_module": {"llm": 0}}, "1..6"),
        ({"ranks": [0]}, "ranks has 1 entries"),
        ({"ranks": [0, 2]}, "ranks [1] hold no stage"),
        ({"layout": "ring"}, "layout"),
    ],
)
def test_builder_errors(kwargs, message):
    units = synthetic_units({"vision": [True] * 2}, [True] * 6)
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_pipeline(units, **kwargs)


def test_unit_list_errors():
    good = list(synthetic_units({"vision": [True] * 2}, [True] * 2))
    with pytest.raises(ValueError, match="duplicate unit name"):
        plan_pipeline(good + [good[0]])
    with pytest.raises(ValueError, match="not contiguous"):
        plan_pipeline([good[0], good[2], good[1], good[3]])
    with pytest.raises(ValueError, match="no unit belongs to module 'llm'"):
        plan_pipeline(good[:2])
    units = synthetic_units({"vision": [True] * 3, "audio": [True] * 3}, [True] * 2)
    with pytest.raises(ValueError, match="same number of stages"):
        plan_pipeline(units, "encoders_colocated", stages_per_module={"vision": 2})


def _llm_stage(index, units, rank=None, trainable=True, needs=None):
    needs = index > 0 if needs is None else needs
    return Stage(index, ("llm",), units, index if rank is None else rank, trainable, needs)


def test_plan_validation_errors():
    a, b = _llm_stage(0, ("x",)), _llm_stage(1, ("y",))
    with pytest.raises(ValueError, match="differ"):
        PipelinePlan("encoder_parallel", (a, b), edges=((1, 0),))
    with pytest.raises(ValueError, match="in stage 0 and stage 1"):
        PipelinePlan("encoder_parallel", (a, _llm_stage(1, ("x",))))
    with pytest.raises(ValueError, match="index 3"):
        PipelinePlan("encoder_parallel", (a, _llm_stage(3, ("y",))))
    mixed = Stage(0, ("vision", "llm"), ("v", "l"), 0, True, False, (1, 1))
    with pytest.raises(ValueError, match="mixes LLM units"):
        PipelinePlan("encoders_colocated", (mixed, b))
    enc = Stage(0, ("vision",), ("v",), 0, True, False)
    with pytest.raises(ValueError, match="last stage must be an LLM stage"):
        PipelinePlan("encoder_parallel", (a, dataclasses.replace(enc, index=1, rank=1)))
    # inconsistent gradient flags along an edge
    with pytest.raises(ValueError, match="does not need an input gradient"):
        PipelinePlan("encoder_parallel", (a, _llm_stage(1, ("y",), trainable=False, needs=False)))
    with pytest.raises(ValueError, match="no predecessor runs backward"):
        PipelinePlan("encoder_parallel", (_llm_stage(0, ("x",), trainable=False, needs=False), b))
    with pytest.raises(ValueError, match="module_unit_counts"):
        Stage(0, ("vision", "audio"), ("v", "a"), 0, True, False)


def test_json_round_trip_and_tamper():
    units = synthetic_units({"vision": [False, True], "audio": [True, True, True]}, [False] * 5)
    plan = plan_pipeline(units, stages_per_module={"audio": 2, "llm": 3}, num_microbatches=6)
    text = plan.to_json(indent=2)
    assert PipelinePlan.from_json(text) == plan
    data = json.loads(text)
    assert PipelinePlan.from_dict(data).stages[2].units == ("audio.2",)
    data["edges"][0] = [0, 4]
    with pytest.raises(ValueError, match="differ"):
        PipelinePlan.from_dict(data)
    with pytest.raises(ValueError, match="unknown field"):
        PipelinePlan.from_dict({**plan.to_dict(), "extra": 1})
    assert plan.replace(num_microbatches=2).num_microbatches == 2


def test_check_plan_units_detects_other_model():
    units = synthetic_units({"vision": [True] * 2}, [True] * 4)
    plan = plan_pipeline(units, stages_per_module={"llm": 2})
    check_plan_units(plan, units)
    with pytest.raises(ValueError, match="does not cover"):
        check_plan_units(plan, synthetic_units({"vision": [True] * 3}, [True] * 4))
    frozen = synthetic_units({"vision": [False] * 2}, [True] * 4)
    with pytest.raises(ValueError, match="flags"):
        check_plan_units(plan, frozen)
    swapped = list(units)
    swapped[2], swapped[3] = swapped[3], swapped[2]
    with pytest.raises(ValueError, match="out of model order"):
        check_plan_units(plan, swapped)


@st.composite
def model_and_plan(draw):
    n_enc = draw(st.integers(0, 3))
    layout = draw(st.sampled_from(["encoder_parallel", "encoders_colocated"]))
    enc_stages = [draw(st.integers(1, 3)) for _ in range(n_enc)]
    if layout == "encoders_colocated" and enc_stages:
        enc_stages = [enc_stages[0]] * n_enc
    encoders = {
        f"enc{k}": draw(st.lists(st.booleans(), min_size=s, max_size=s + 3)) for k, s in enumerate(enc_stages)
    }
    llm_stages = draw(st.integers(1, 4))
    llm = draw(st.lists(st.booleans(), min_size=llm_stages, max_size=llm_stages + 4))
    counts = {f"enc{k}": s for k, s in enumerate(enc_stages)} | {"llm": llm_stages}
    units = synthetic_units(encoders, llm)
    return units, plan_pipeline(units, layout, stages_per_module=counts), counts


@settings(max_examples=60, deadline=None)
@given(model_and_plan())
def test_random_plans_cover_units_and_flags(case):
    units, plan, counts = case
    by_name = {u.name: u for u in units}
    modules = list(dict.fromkeys(u.module for u in units))
    for module in modules:
        planned = [n for s in plan.stages if module in s.modules for n in s.module_units(module)]
        assert planned == [u.name for u in units if u.module == module]
        assert len(plan.module_stages(module)) == counts[module]
    for stage in plan.stages:
        chunks = [stage.module_units(m) for m in stage.modules]
        assert stage.trainable == any(by_name[n].trainable for c in chunks for n in c)
        assert stage.needs_input_grad == any(by_name[c[0]].needs_input_grad for c in chunks)
    s_llm = counts["llm"]
    if plan.layout == "encoder_parallel":
        for module in modules[:-1]:
            idx = plan.module_stages(module)
            assert [plan.depth(s) for s in idx] == [counts[module] + s_llm - i for i in range(len(idx))]
            assert plan.successors(idx[-1]) == (plan.llm_stages[0],)
    else:
        assert plan.edges == tuple((i, i + 1) for i in range(plan.num_stages - 1))
    assert PipelinePlan.from_json(plan.to_json()) == plan


def test_interleaved_ranks_and_virtual_stages():
    from plait.planner.pipeline.plan import interleaved_ranks

    assert interleaved_ranks([0, 1], 3, 2) == (0, 1, 2, 3, 4, 2, 3, 4)
    assert interleaved_ranks([], 2, 3) == (0, 1, 0, 1, 0, 1)
    units = synthetic_units({"vision": [False, True]}, [True] * 6)
    plan = plan_pipeline(units, stages_per_module={"vision": 1, "llm": 6}, ranks=interleaved_ranks([0], 2, 3))
    assert plan.virtual_stages == 3 and plan.num_ranks == 3
    assert plan.stages_on_rank(1) == (1, 3, 5) and plan.stages_on_rank(2) == (2, 4, 6)
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert plan_pipeline(units, stages_per_module={"vision": 1, "llm": 2}).virtual_stages == 1
    for bad in (([0], 0, 2), ([0], 2, 0), ([-1], 2, 2)):
        with pytest.raises(ValueError):
            interleaved_ranks(*bad)
