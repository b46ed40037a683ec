"""``cost_model.trained_params`` and ``OptimizerSpec.grad_bytes``: the parameters that carry a gradient and optimizer
state, and the bytes of each gradient element (the one rule of offload, sharding, templates and static memory)."""

from __future__ import annotations

import pytest

from plait.planner.cost.analytic import trained_params, unit_static_bytes
from plait.planner.cost.types import OptimizerSpec
from plait.planner.types import Unit, UnitCost


def _unit(trainable: bool, fraction: float = 1.0) -> Unit:
    return Unit("llm.layers.0", "llm", "layer", trainable, trainable, fraction)


def test_trained_params_count_the_trained_share_in_the_dtype():
    cost = UnitCost(forward_s=1.0, input_grad_s=1.0, weight_grad_s=1.0, param_bytes=800)
    assert trained_params(_unit(True), cost) == 400  # bf16: 2 bytes per parameter
    assert trained_params(_unit(True), cost, "float32") == 200
    assert trained_params(_unit(True, 0.25), cost) == 100  # LoRA: the adapters' share
    assert trained_params(_unit(False), cost) == 0  # frozen: nothing trains


def test_grad_bytes_default_to_the_dtype_size():
    assert OptimizerSpec().grad_bytes() == 2.0
    assert OptimizerSpec().grad_bytes("float32") == 4.0
    assert OptimizerSpec(grad_bytes_per_param=4).grad_bytes("bfloat16") == 4.0
    cost = UnitCost(forward_s=1.0, input_grad_s=1.0, weight_grad_s=1.0, param_bytes=800)
    # 800 parameter bytes + 400 trained parameters x (2 gradient + 12 AdamW bytes)
    assert unit_static_bytes(_unit(True), cost) == pytest.approx(800 + 400 * 14)
    assert unit_static_bytes(_unit(True), cost, optimizer=OptimizerSpec(grad_bytes_per_param=4)) == 800 + 400 * 16
