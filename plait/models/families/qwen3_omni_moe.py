"""Qwen3-Omni-MoE's thinker (transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration``) as two plait branches and
a MoE causal LM: its vision tower (``Qwen3OmniMoeVisionEncoder``), its audio tower (``Qwen3OmniMoeAudioEncoder``) and
its text model (``Qwen3OmniMoeThinkerTextModel``).

Vision: the tower is Qwen3-VL's (learned position table resampled to each grid, full attention per image, the 2x2
merger and the DeepStack mergers, here ``merger_list``) with the same forward, so the branch is
:class:`~plait.models.families.qwen3_vl.Qwen3VLFamily`'s (processor, packing, DeepStack rows: merged feature then
one feature per receiving LLM layer, ``plait.models.deepstack``) with the Omni tower class, and videos are one item
of temporal patches (:class:`~plait.models.families.qwen2_5_omni.OmniTemporalPatches`) positioned by this thinker's
``get_rope_index`` (:mod:`plait.data.omni_positions`: a clip's video and audio tokens in time order).

Audio: the tower cuts each clip's valid mel frames into chunks of ``2 n_window`` frames, runs three stride-2 Conv2d
(``conv2d1..3``) and ``conv_out`` per chunk, adds sinusoidal positions, attends inside windows of ``n_window_infer``
frames, then ``ln_post``, ``proj1``, GELU and ``proj2`` to ``output_dim`` (the LLM width). A clip of ``n`` samples
has ``f = ceil(n / hop)`` frames and ``13 (f // 100) + c(f mod 100)`` features (transformers'
``_get_feat_extract_output_lengths`` with ``n_window = 50``: :class:`Qwen3OmniAudioFeatureCount`). Its call is the
Qwen2.5-Omni tower's (:class:`~plait.models.families.qwen2_5_omni.OmniAudioCall`: the clips' valid frames
concatenated, ``feature_lens``) with this count.

LLM: :class:`Qwen3OmniMoeTextForCausalLM` (MoE decoder layers: ``mlp.experts`` with fused ``gate_up_proj`` /
``down_proj`` and a top-k router ``mlp.gate``, the layout expert parallelism splits,
:mod:`plait.parallel.expert_parallel`), interleaved M-RoPE positions ``[3, B, N]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (Qwen3OmniMoeThinkerTextModel,
                                                                         _get_feat_extract_output_lengths,
                                                                         get_audio_cu_seqlens, get_valid_indices)

from plait.models.families.base import (EncoderLayout, MelWindow, TextStackCausalLM, checked_clip_samples,
                                        positive_field, register_causal_lm)
from plait.models.families.qwen2_5_omni import (POSITION_ID_PER_SECONDS, SECONDS_PER_CHUNK, OmniAudioCall,
                                                OmniTemporalPatches, Qwen25OmniAudioFamily)
from plait.models.families.qwen3_vl import Qwen3VLFamily

__all__ = ["VISION", "AUDIO", "THINKER", "Qwen3OmniAudioFeatureCount", "Qwen3OmniAudioCall",
           "Qwen3OmniMoeTextForCausalLM", "audio_token_count"]

THINKER = "qwen3_omni_moe"
"""The thinker's name on its videos' timing (``plait.data.omni_positions`` positions them by its rule)."""


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """Features the audio tower gives a clip of ``frames`` mel frames (transformers'
    ``_get_feat_extract_output_lengths``)."""
    with torch.device("cpu"):  # also inside a meta-device build (the tower's probe)
        return int(_get_feat_extract_output_lengths(torch.tensor(int(frames)), int(n_window)))


@register_causal_lm
class Qwen3OmniMoeTextForCausalLM(TextStackCausalLM, Qwen3MoeForCausalLM):
    """The thinker's LLM as a causal LM: ``Qwen3MoeForCausalLM`` (``lm_head``, forward with the router's auxiliary
    loss when asked, generation) whose decoder stack ``model`` is transformers' ``Qwen3OmniMoeThinkerTextModel``
    (interleaved M-RoPE: ``position_ids`` ``[3, B, N]``, or ``[B, N]`` for text). State-dict names are ``model.*``
    and ``lm_head.weight``, the thinker's ``model.language_model`` and ``lm_head`` tensors. DeepStack features reach
    its decoder layers through forward hooks (``plait.models.deepstack``).

    Args:
        config: a ``Qwen3OmniMoeTextConfig``.
    """

    config_class = Qwen3OmniMoeTextConfig
    decoder_stack = Qwen3OmniMoeThinkerTextModel
    # transformers decides whether a class may pick its experts implementation from its module's source (the
    # experts class's decorator); this class's experts are transformers' own, which may
    _can_set_experts_implementation_cached_value = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts, self.num_experts_per_tok = config.num_experts, config.num_experts_per_tok


@dataclass(frozen=True)
class Qwen3OmniAudioFeatureCount(MelWindow):
    """Features (LLM tokens) the Qwen3-Omni audio tower gives a clip of ``n`` samples: ``audio_token_count`` of its
    ``ceil(n / hop_length)`` mel frames.

    Attributes:
        hop_length: feature extractor hop in samples (160).
        n_window: half a conv chunk in mel frames (50).
        max_positions: ``max_source_positions`` (1500: a 30-s window is ``2 max_positions`` frames).
        sampling_rate: samples per second (16000).
    """

    hop_length: int
    n_window: int
    max_positions: int
    sampling_rate: int

    def __call__(self, num_samples: int) -> int:
        """Features (tokens) for a clip of ``num_samples`` samples.

        Raises:
            ValueError: for an empty clip or one longer than the window.
        """
        n = checked_clip_samples(num_samples, self.max_samples, self.sampling_rate)
        return audio_token_count(self.frames(n), self.n_window)


class Qwen3OmniAudioCall(OmniAudioCall):
    """:class:`~plait.models.families.qwen2_5_omni.OmniAudioCall` with the Qwen3-Omni tower's feature count."""

    def feature_lengths(self, encoder: Any, feature_lens: torch.Tensor) -> list[int]:
        return [audio_token_count(f, int(encoder.config.n_window)) for f in feature_lens.tolist()]

    @property
    def refusal(self) -> str:
        return AUDIO.layer_refusal


class Qwen3OmniMoeVisionFamily(Qwen3VLFamily):
    """The thinker's vision tower: Qwen3-VL's family with the Omni tower class (DeepStack mergers at
    ``merger_list``); videos are one timed item of temporal patches positioned by the thinker."""

    name = "Qwen3-Omni vision"
    model_types = {"qwen3_omni_moe_vision_encoder": None}
    encoder_class = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder"
    tower_keys = {r"^(thinker\.)?(model\.)?visual\.": ""}
    layout = EncoderLayout(("patch_embed", "pos_embed", "rotary_pos_emb", "merger_list"), "blocks", "merger")
    layer_class = "Qwen3OmniMoeVisionBlock"

    def video_encoding(self, config: Any) -> OmniTemporalPatches:  # type: ignore[override]
        """Temporal patches of ``temporal_patch_size`` frames, ``position_id_per_seconds`` positions a second (the
        thinker's value, read from the tower config where an import set it, else 25), positioned by this thinker."""
        rate = getattr(config, "position_id_per_seconds", None) or POSITION_ID_PER_SECONDS
        return OmniTemporalPatches(int(config.temporal_patch_size), float(rate), float(SECONDS_PER_CHUNK), THINKER)


class Qwen3OmniMoeAudioFamily(Qwen25OmniAudioFamily):
    """The thinker's audio tower: Conv2d downsampling per chunk, windowed attention, a two-layer projection to the
    LLM width; its own feature count."""

    name = "Qwen3-Omni audio"
    model_types = {"qwen3_omni_moe_audio_encoder": None}
    encoder_class = "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeAudioEncoder"
    layout = EncoderLayout(("conv2d1", "conv2d2", "conv2d3", "conv_out", "positional_embedding", "proj1", "proj2"),
                           "layers", "ln_post")
    tower_call = Qwen3OmniAudioCall
    layer_class = "Qwen3OmniMoeAudioEncoderLayer"
    layer_refusal = ("the Qwen3-Omni audio tower's layers cannot start a pipeline stage (its chunked convolutions, "
                     "windowed attention and projection run inside its own forward): give the branch one stage")
    output_pool = 1

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Qwen3OmniAudioFeatureCount:
        """:class:`Qwen3OmniAudioFeatureCount` of the tower's ``n_window`` over the 30-s window.

        Raises:
            ValueError: for ``downsample != 1`` (the tower's output is already projected).
        """
        if downsample != 1:
            raise ValueError("the Qwen3-Omni audio tower's features are downsampled and projected: use downsample = 1")
        cfg = encoder.config
        return Qwen3OmniAudioFeatureCount(hop_length, int(cfg.n_window), int(cfg.max_source_positions), sampling_rate)

    def meta_indices(self, config: Any, lens: torch.Tensor, device: torch.device | str | None) -> dict[str, Any]:
        """The Qwen3-Omni tower's index tensors for a meta-device forward (its chunks of ``2 n_window`` frames,
        windows of ``n_window_infer``): ``valid_indices`` on ``device``, the rest on the CPU."""
        chunks = lens.clone()
        cu = get_audio_cu_seqlens(chunks, lens, int(config.n_window_infer), int(config.n_window))
        return {"chunk_lengths": chunks, "valid_indices": get_valid_indices(chunks, int(config.n_window)).to(device),
                "cu_seqlens": cu, "max_seqlen": int((cu[1:] - cu[:-1]).max())}

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """Whisper's layer facts (``d_model``, heads, ``encoder_ffn_dim``) with sinusoidal positions (no table); an
        item is the 30-s window's features after the Conv2d front end (:func:`audio_token_count` of its
        ``2 max_source_positions`` frames), every layer attending inside windows of ``n_window_infer`` frames' features.
        The Conv2d front end and the two projections are costed as Whisper's convolutions (approximate)."""
        fields = super().arch_fields(config)
        n_window = positive_field(config, "n_window")
        fields["item_len"] = audio_token_count(2 * positive_field(config, "max_source_positions"), n_window)
        fields["output_pool"] = 1
        fields["window"] = audio_token_count(positive_field(config, "n_window_infer"), n_window)
        return fields


VISION = Qwen3OmniMoeVisionFamily()
AUDIO = Qwen3OmniMoeAudioFamily()
