"""A Gemma 3 LLM (its image tokens attend each other both ways) is refused with a causal mask: the job would train on
another attention than the model's own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.train.build import check_item_attention


def _model(model_type: str, encoders: dict) -> SimpleNamespace:
    return SimpleNamespace(encoders=encoders, language_model=SimpleNamespace(config=SimpleNamespace(
        model_type=model_type)))


def test_a_gemma3_llm_with_images_needs_the_bidirectional_item_mask():
    gemma = _model("gemma3_text", {"vision": object()})
    with pytest.raises(ValueError, match=r"attention.mask = 'causal' with a gemma3_text LLM: .* set attention.mask "
                                         r"= 'bidirectional_items'"):
        check_item_attention(gemma, "causal")
    check_item_attention(gemma, "bidirectional_items")
    check_item_attention(_model("gemma3_text", {}), "causal")  # text only: causal, as transformers runs it
    check_item_attention(_model("llama", {"vision": object()}), "causal")
