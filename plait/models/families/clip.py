"""CLIP's vision tower (transformers' ``CLIPVisionModel``): a ViT with a CLS token, a bias-free patch convolution and
a LayerNorm before the layers (a full CLIP checkpoint gives its vision tower)."""

from __future__ import annotations

from typing import Any

from plait.models.families.base import ATTN_MLP_LORA, ATTN_MLP_PLAN, EncoderLayout, VisionFamily

__all__ = ["FAMILY", "MODEL_TYPES"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"clip_vision_model": None, "clip": "vision_config"}


class ClipFamily(VisionFamily):
    name = "CLIP"
    model_types = MODEL_TYPES
    encoder_class = "CLIPVisionModel"
    has_cls = True
    layout = EncoderLayout(("embeddings", "pre_layrnorm"), "encoder.layers", "post_layernorm")
    lora_targets = ATTN_MLP_LORA
    tp_plan = ATTN_MLP_PLAN
    image_processor = "CLIPImageProcessor"

    def arch_fields(self, config: Any) -> dict[str, Any]:
        return {**super().arch_fields(config), "patch_bias": False, "pre_norm": True}


FAMILY = ClipFamily()
