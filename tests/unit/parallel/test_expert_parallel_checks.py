"""``apply_expert_parallel``'s refusals, raised before any process group is made: a model without MoE experts, an
EP degree that does not divide the expert count; and which modules it finds (Qwen3-MoE's fused experts)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from plait.parallel.dims import ParallelDims
from plait.parallel.expert_parallel import apply_expert_parallel, experts_modules, is_expert_parameter

SMALL = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def test_experts_are_found_and_a_model_without_them_is_refused():
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2))
    found = experts_modules(moe)
    assert [n for n, _ in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert not any(is_expert_parameter(p) for p in moe.parameters())
    assert apply_expert_parallel(moe, ParallelDims(dp=2), 0, torch.device("cpu")) is None  # ep = 1: nothing
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts: parallel.ep = 4 does not divide its 6 "):
        apply_expert_parallel(moe, ParallelDims(dp=4, ep=4), 0, torch.device("cpu"))
    dense = LlamaForCausalLM(LlamaConfig(**SMALL))
    assert experts_modules(dense) == []
    with pytest.raises(ValueError, match=r"parallel.ep = 2 needs an LLM with mixture-of-experts layers"):
        apply_expert_parallel(dense, ParallelDims(dp=2, ep=2), 0, torch.device("cpu"))
