"""A tied LLM head (``tie_word_embeddings``) uses the embedding matrix: the cost model counts that matrix once (in
the embedding unit), so the units' parameter bytes add up to the real model's, while the head keeps its FLOPs and
its weight-gradient pass."""

from __future__ import annotations

import pytest
import transformers as T

from plait.planner.cost.arch import units_from_configs
from plait.planner.cost.analytic import unit_costs, unit_estimates
from plait.planner.cost.types import DeviceSpec, MicrobatchShape

KW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
          vocab_size=100)


@pytest.mark.parametrize("tied", [True, False])
def test_unit_parameter_bytes_add_up_to_the_real_model(tied):
    config = T.LlamaConfig(**KW, tie_word_embeddings=tied)
    real = sum(p.numel() for p in T.LlamaForCausalLM(config).parameters())
    units = units_from_configs({"llm": config})
    costs = unit_costs(units, {"llm": config}, MicrobatchShape(16), DeviceSpec.h100(), "fp32")
    assert sum(c.param_bytes for c in costs) == 4 * real
    head = dict(zip((u.name for u in units), costs))["llm.lm_head"]
    assert head.param_bytes == (0 if tied else 4 * 100 * 32)


def test_a_tied_head_keeps_its_flops_and_weight_gradient():
    shape = MicrobatchShape(16)
    tied, untied = ({"llm": T.LlamaConfig(**KW, tie_word_embeddings=t)} for t in (True, False))
    units = units_from_configs(tied)
    est_t, est_u = unit_estimates(units, tied, shape)[-1], unit_estimates(units, untied, shape)[-1]
    assert (est_t.params, est_t.tied_params, est_u.tied_params) == (100 * 32, 100 * 32, 0)
    assert est_t.weight_flops == est_u.weight_flops == 2 * 16 * 32 * 100
    cost_t, cost_u = (unit_costs(units, c, shape, DeviceSpec.h100())[-1] for c in (tied, untied))
    assert cost_t.weight_grad_s == cost_u.weight_grad_s > 0 and cost_t.forward_s == cost_u.forward_s
