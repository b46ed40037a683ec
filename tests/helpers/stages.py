"""Helpers of several test modules, taken from tests/unit/parallel/test_stages.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import dataclasses

import torch

from plait.models.multimodal import MultimodalModel
from plait.models.units import model_units
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.types import PipelinePlan
from tests.distributed.pipeline_worker import make_batch


SPLIT = {"vision": 2, "audio": 2, "llm": 3}


def on_one_rank(plan: PipelinePlan) -> PipelinePlan:
    """The same stages, all on pipeline rank 0 (runs in this process with local hand-overs only)."""
    return plan.replace(stages=tuple(dataclasses.replace(s, rank=0) for s in plan.stages))


def check_branch_chain(model: MultimodalModel, name: str, inputs: dict) -> None:
    """Cut the branch into one stage per unit and feed each stage's output to the next: the last one must give
    ``ModalityEncoder.forward`` (which reads ``hidden_states[feature_layer]`` of the full encoder)."""
    expected = model.encoders[name](inputs)
    units = model_units(model)
    n = sum(u.module == name for u in units)
    plan = on_one_rank(plan_pipeline(units, stages_per_module={name: n}))
    stages = build_rank_stages(model, plan, 0)
    batch = make_batch("t", 0)
    batch.modality_inputs = {name: inputs}
    payload: dict = {}
    for index in plan.module_stages(name):
        payload = stages.stages[index].forward(batch, {index - 1: payload} if payload else {}, None, {})
    torch.testing.assert_close(payload[name][0], expected, rtol=1e-5, atol=1e-6)
    assert len(payload[name]) == 1 and n >= 3
