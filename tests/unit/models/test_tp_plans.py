"""Tensor-parallel plans: each encoder family's plan covers the real module names of a tiny model of that family
(every Linear of every layer, no pattern left unmatched), and the LLM's plan is the one transformers ships."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from plait.models.hf import build_causal_lm, build_encoder, encoder_layout, encoder_tp_plan, llm_tp_plan
from tests.helpers.jobs import TINY_AUDIO, TINY_LLM

_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
               patch_size=16)
ENCODERS = {
    "siglip_vision_model": ("image", dict(model_type="siglip_vision_model", **_VISION)),
    "clip_vision_model": ("image", dict(model_type="clip_vision_model", **_VISION)),
    "vit": ("image", dict(model_type="vit", **_VISION)),
    "whisper": ("audio", dict(TINY_AUDIO)),
}


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_plan_covers_every_linear_of_every_layer(family):
    modality, config = ENCODERS[family]
    with torch.device("meta"):
        encoder = build_encoder(modality, config=config)
    plan = encoder_tp_plan(encoder)
    layers = encoder_layout(encoder).layers
    linears = [n for n, m in encoder.named_modules() if isinstance(m, nn.Linear) and n.startswith(layers + ".")]
    assert len(linears) == 6 * 2  # q, k, v, out, fc1, fc2 per layer
    for name in linears:
        hits = [p for p in plan if _matches(p, name)]
        assert len(hits) == 1, (name, hits)
    for pattern in plan:
        assert sum(_matches(pattern, n) for n in linears) == 2, pattern  # one module per layer
    styles = {p.rsplit(".", 1)[-1]: s for p, s in plan.items()}
    assert styles["q_proj"] == styles["k_proj"] == styles["v_proj"] == styles["fc1"] == "colwise"
    assert styles["fc2"] == "rowwise" and styles.get("out_proj", styles.get("o_proj")) == "rowwise"


def test_llm_plan_is_the_one_transformers_ships():
    with torch.device("meta"):
        llm = build_causal_lm(config=dict(TINY_LLM), vocab_size=64)
    plan = llm_tp_plan(llm)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan == dict(llm.tp_plan)


def test_llm_without_a_plan_is_refused():
    with torch.device("meta"):
        llm = build_causal_lm(config=dict(TINY_LLM), vocab_size=64)
    llm._tp_plan = {}
    with pytest.raises(ValueError, match="ships no tensor-parallel plan"):
        llm_tp_plan(llm)
