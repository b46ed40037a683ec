"""Helpers of several test modules, taken from tests/unit/planner/test_sharding.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from plait.models.plan_inputs import plan_configs
from plait.planner.cost.arch import units_from_configs
from plait.planner.cost.analytic import unit_costs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape
from plait.planner.pipeline.graph import consistent_units
from plait.planner.types import Unit, UnitCost


def toy_units() -> list[Unit]:
    return consistent_units([
        Unit("v.embed", "vision", "embed", False, False),
        Unit("v.layers.0", "vision", "layer", False, False),
        Unit("v.proj", "vision", "projector", True, False),
        Unit("llm.embed", "llm", "embed", True, False),
        Unit("llm.layers.0", "llm", "layer", True, False),
        Unit("llm.head", "llm", "head", True, False),
    ])


def toy_costs() -> list[UnitCost]:
    layer = UnitCost(forward_s=1.0, input_grad_s=1.0, weight_grad_s=1.0, param_bytes=800, activation_bytes=1000,
                     output_bytes=100)
    small = UnitCost(0.1, 0.1, 0.1, param_bytes=200, activation_bytes=50, output_bytes=100)
    return [small, layer, small, small, layer, small]


def vit_llm():
    configs = plan_configs({
        "vision": dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                       num_attention_heads=16, image_size=224, patch_size=14),
        "llm": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=12,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    })
    units = units_from_configs(configs, {})
    shapes = {"vision": MicrobatchShape(257), "llm": MicrobatchShape(2048)}
    return units, unit_costs(units, configs, shapes, DeviceSpec.h100())
