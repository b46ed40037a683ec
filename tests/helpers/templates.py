"""Helpers of several test modules, taken from tests/unit/planner/test_templates.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from plait.planner.pipeline.plan import synthetic_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.resilience.templates import plan_templates
from plait.planner.resilience.types import TemplateSet
from plait.planner.types import UnitCost
from plait.planner.search.types import Machine


GIB = 1 << 30
PARAM = GIB // 4
CAP = 12 * GIB  # a trained unit holds 2 GiB (parameters, gradients, AdamW state): n0 = 2 or more


def model(trainable_llm: bool = True):
    """A vision encoder (4 units, frozen but its projector) and an 8-unit LLM, with costs."""
    units = synthetic_units({"vision": [False, False, False, True]}, [trainable_llm] * 8)
    costs = [UnitCost(forward_s=0.01 * (1 + (i % 3)), input_grad_s=0.01 * (1 + (i % 3)),
                      weight_grad_s=0.01 * (1 + (i % 3)), param_bytes=PARAM, activation_bytes=GIB // 16,
                      output_bytes=1 << 20) for i, _ in enumerate(units)]
    return units, costs


def templates(num_ranks: int = 8, failures: int = 1, microbatches: int = 12, **machine) -> TemplateSet:
    units, costs = model()
    return plan_templates(units, costs, num_ranks, failures, microbatches=microbatches,
                          machine=Machine(memory_cap=CAP, dp_link=P2PModel(1e-5, 1e10), **machine))
