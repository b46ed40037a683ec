"""SigLIP's vision tower (transformers' ``SiglipVisionModel``): a ViT without CLS token, with a pooling head that
plait never reads (a full SigLIP checkpoint gives its vision tower)."""

from __future__ import annotations

from plait.models.families.base import ATTN_MLP_LORA, ATTN_MLP_PLAN, EncoderLayout, VisionFamily

__all__ = ["FAMILY", "MODEL_TYPES"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"siglip_vision_model": None, "siglip": "vision_config"}


class SiglipFamily(VisionFamily):
    name = "SigLIP"
    model_types = MODEL_TYPES
    encoder_class = "SiglipVisionModel"
    layout = EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",))
    lora_targets = ATTN_MLP_LORA
    tp_plan = ATTN_MLP_PLAN
    image_processor = "SiglipImageProcessor"


FAMILY = SiglipFamily()
