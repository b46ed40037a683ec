"""The Qwen2-Audio encoder (transformers' ``Qwen2AudioEncoder``): feature count and padding mask.

The encoder is Whisper's (``conv1``, stride-2 ``conv2``, learned positions, pre-norm layers) with an average
pooler (kernel 2, stride 2) between the last layer and the final ``layer_norm``. Its input is always the
feature extractor's full window (``2 * max_source_positions`` mel frames, zero padded); Hugging Face's
``Qwen2AudioForConditionalGeneration`` masks the padded positions as attention keys (a key-padding mask from the
clip's mel frame count) and keeps the first ``num_audio_tokens`` pooled features of each clip. plait does the
same, with the same formulas (transformers' ``Qwen2AudioEncoder._get_feat_extract_output_lengths`` and
``Qwen2AudioProcessor``), so its features equal the stock model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.masking_utils import create_bidirectional_mask

from plait.models.families.base import WHISPER_PLAN, AudioFamily, EncoderLayout, MelWindow, checked_clip_samples

__all__ = ["FAMILY", "MODEL_TYPES", "ENCODER_CLASS", "Qwen2AudioFeatureCount", "qwen2_audio_attention_mask"]

# config model_type -> the encoder config lives at (None: the config itself; "audio_config": a full model's)
MODEL_TYPES = {"qwen2_audio_encoder": None, "qwen2_audio": "audio_config"}
ENCODER_CLASS = "transformers.models.qwen2_audio.modeling_qwen2_audio.Qwen2AudioEncoder"


@dataclass(frozen=True)
class Qwen2AudioFeatureCount(MelWindow):
    """Features (LLM tokens) the Qwen2-Audio encoder gives a clip of ``n`` samples, after plait's optional pooling.

    Mel frames ``f = ceil(n / hop_length)`` (the feature extractor's attention mask); the stride-2 ``conv2`` gives
    ``c = (f - 1) // 2 + 1`` positions; the pooler ``(c - 2) // 2 + 1`` features (transformers'
    ``_get_feat_extract_output_lengths``); plait's ``downsample`` then averages groups (``ceil(x / downsample)``).

    Attributes:
        hop_length: feature extractor hop in samples (160).
        downsample: plait's extra average pooling of the features (1: none).
        max_positions: ``max_source_positions`` (1500: conv positions of the 30 s window).
        sampling_rate: samples per second (16000).
    """

    hop_length: int
    downsample: int
    max_positions: int
    sampling_rate: int

    def conv_positions(self, num_samples: int) -> int:
        """Encoder positions after ``conv2`` that cover the clip (the unmasked attention keys)."""
        return (self.frames(num_samples) - 1) // 2 + 1

    def __call__(self, num_samples: int) -> int:
        """Features (tokens) for a clip of ``num_samples`` samples.

        Raises:
            ValueError: for an empty clip, one too short for a single feature, or one longer than the window.
        """
        n = checked_clip_samples(num_samples, self.max_samples, self.sampling_rate)
        pooled = (self.conv_positions(n) - 2) // 2 + 1
        if pooled <= 0:
            raise ValueError(f"audio clip of {n} samples is too short for one Qwen2-Audio feature "
                             f"(needs more than {2 * self.hop_length} samples)")
        return math.ceil(pooled / self.downsample)


def qwen2_audio_attention_mask(
    config: object, count: Qwen2AudioFeatureCount, num_samples: torch.Tensor, dtype: torch.dtype,
) -> torch.Tensor | None:
    """The key-padding mask ``Qwen2AudioForConditionalGeneration`` gives its audio tower, for clips of
    ``num_samples`` ``[n]`` samples: positions ``>= conv_positions`` are masked, built by transformers'
    ``create_bidirectional_mask`` for the encoder's attention implementation (``[n, 1, P, P]`` or None when
    nothing is masked), ``P = max_source_positions``."""
    positions = count.max_positions
    lengths = torch.tensor([count.conv_positions(int(n)) for n in num_samples.tolist()], device=num_samples.device)
    keep = (torch.arange(positions, device=num_samples.device)[None] < lengths[:, None]).long()
    dummy = torch.zeros(len(lengths), positions, 1, dtype=dtype, device=num_samples.device)
    return create_bidirectional_mask(config=config, inputs_embeds=dummy, attention_mask=keep)


class Qwen2AudioFamily(AudioFamily):
    """Qwen2-Audio: Whisper's encoder with an average pooler before its final norm and a key-padding mask."""

    name = "Qwen2-Audio"
    model_types = MODEL_TYPES
    encoder_class = ENCODER_CLASS
    # the avg_pooler runs between the last layer and layer_norm: a stage owning the embedding must own every layer
    layout = EncoderLayout(("conv1", "conv2", "embed_positions"), "layers", "layer_norm")
    tp_plan = WHISPER_PLAN
    layer_class = "Qwen2AudioEncoderLayer"
    layer_refusal = ("the Qwen2-Audio encoder's layers cannot start a pipeline stage (its padding mask and pooler "
                     "run inside its own forward): give the branch one stage")
    pooled_output = True
    output_pool = 2

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Qwen2AudioFeatureCount:
        return Qwen2AudioFeatureCount(hop_length, downsample, int(encoder.config.max_source_positions), sampling_rate)

    def call_inputs(self, encoder: Any, count: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """With the key-padding ``attention_mask`` of the clips' lengths, as Hugging Face's composite model passes
        it."""
        mask = qwen2_audio_attention_mask(encoder.config, count, inputs["num_samples"], encoder.dtype)
        return {"input_features": inputs["input_features"], "attention_mask": mask}


FAMILY = Qwen2AudioFamily()
