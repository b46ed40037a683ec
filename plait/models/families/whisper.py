"""Whisper's audio encoder (transformers' ``WhisperEncoder``; a full Whisper checkpoint gives its encoder): a fixed
window of log-mel frames, two convolutions (the second of stride 2), learned positions, pre-norm layers."""

from __future__ import annotations

from plait.models.families.base import ATTN_MLP_LORA, WHISPER_PLAN, AudioFamily, EncoderLayout

__all__ = ["FAMILY", "MODEL_TYPES"]

# config model_type -> where the encoder config lives (None: the config itself)
MODEL_TYPES = {"whisper": None}


class WhisperFamily(AudioFamily):
    name = "Whisper"
    model_types = MODEL_TYPES
    encoder_class = "transformers.models.whisper.modeling_whisper.WhisperEncoder"
    layout = EncoderLayout(("conv1", "conv2", "embed_positions"), "layers", "layer_norm")
    lora_targets = ATTN_MLP_LORA
    tp_plan = WHISPER_PLAN


FAMILY = WhisperFamily()
