"""A tiny ``Qwen3VLMoeForConditionalGeneration``: the tiny Qwen3-VL of ``tests/helpers/qwen3_vl.py`` (3-block tower,
DeepStack after blocks 0 and 1 into LLM layers 0 and 1, interleaved M-RoPE) with a 2-layer mixture-of-experts text
model (4 experts of width 24, top-2), saved with its processor's files like the tiny Qwen3-VL."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from tests.helpers.qwen3_vl import END, IMAGE, START, TEXT, VIDEO, VISION, save_qwen3_vl

__all__ = ["MOE_TEXT", "qwen3_vl_moe_config", "tiny_qwen3_vl_moe", "save_qwen3_vl_moe"]

MOE_TEXT = dict(TEXT, num_hidden_layers=2, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
"""The text config: Qwen3-VL's tiny one with 2 layers, each a sparse MoE block."""


def qwen3_vl_moe_config(tied: bool = False) -> T.Qwen3VLMoeConfig:
    """The tiny ``Qwen3VLMoeConfig``."""
    return T.Qwen3VLMoeConfig(text_config=dict(MOE_TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                              video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                              tie_word_embeddings=tied)


def tiny_qwen3_vl_moe(seed: int = 0, tied: bool = False) -> T.Qwen3VLMoeForConditionalGeneration:
    """The tiny model in eval mode, every tensor random (norms, mergers and routers not left at their init)."""
    torch.manual_seed(seed)
    model = T.Qwen3VLMoeForConditionalGeneration(qwen3_vl_moe_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def save_qwen3_vl_moe(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, tied: bool = False) -> Path:
    """The tiny model saved with its processor's files (:func:`tests.helpers.qwen3_vl.save_qwen3_vl`)."""
    return save_qwen3_vl(folder, dtype, seed, tied, build=tiny_qwen3_vl_moe)
