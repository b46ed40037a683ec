"""The plain ViT (transformers' ``ViTModel``, built without its pooler): CLS token, biased attention by config."""

from __future__ import annotations

from typing import Any

from plait.models.families.base import EncoderLayout, VisionFamily, config_field

__all__ = ["FAMILY", "MODEL_TYPES"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"vit": None}


class VitFamily(VisionFamily):
    name = "ViT"
    model_types = MODEL_TYPES
    encoder_class = "ViTModel"
    build_kwargs = {"add_pooling_layer": False}
    has_cls = True
    layout = EncoderLayout(("embeddings",), "layers", "layernorm", ("pooler",))
    tp_plan = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
               "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    image_processor = "ViTImageProcessor"
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2")

    def arch_fields(self, config: Any) -> dict[str, Any]:
        bias = bool(config_field(config, "qkv_bias", True))
        return {**super().arch_fields(config), "qkv_bias": (bias, bias, bias)}


FAMILY = VitFamily()
