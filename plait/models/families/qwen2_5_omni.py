"""Qwen2.5-Omni's thinker (transformers' ``Qwen2_5OmniThinkerForConditionalGeneration``) as two plait branches and an
M-RoPE causal LM: its vision tower (``Qwen2_5OmniVisionEncoder``), its audio tower (``Qwen2_5OmniAudioEncoder``) and
its text model (``Qwen2_5OmniThinkerTextModel``).

Vision: the tower is Qwen2.5-VL's (patch embedding over ``T x p x p``, window attention outside
``fullatt_block_indexes``, the 2x2 merger to ``out_hidden_size``, the LLM width) with the same forward, so the
branch is :class:`~plait.models.families.qwen2_5_vl.Qwen25VLFamily`'s (processor, packing, per-call inputs,
temporal patches of a video) with the Omni tower class. A video's temporal patches are
``second_per_grid_t x position_id_per_seconds`` M-RoPE positions apart (the thinker config's
``position_id_per_seconds``, 25: the same rule as Qwen2.5-VL's ``tokens_per_second``).

Audio: the tower is Whisper's (``conv1``, stride-2 ``conv2``, sinusoidal positions, pre-norm layers) run on chunks
of ``2 n_window`` mel frames of each clip (attention inside a chunk), then a stride-2 average pool, ``ln_post`` and
``proj`` to ``output_dim`` (the LLM width). It takes the clips' valid mel frames concatenated (``input_features
[mel, sum f_i]``, ``feature_lens [n]``), as ``Qwen2_5OmniThinkerModel.get_audio_features`` passes them; a clip of
``n`` samples has ``f = ceil(n / hop)`` frames and ``((f - 1) // 2 + 1 - 2) // 2 + 1`` features, Qwen2-Audio's
count (:class:`~plait.models.families.qwen2_audio.Qwen2AudioFeatureCount`). plait's items stay the feature
extractor's 30-s windows ``[mel, 3000]`` with ``num_samples``; :meth:`Qwen25OmniAudioFamily.call_inputs` cuts each
to its frames. As for Qwen2.5-VL's merger, ``proj`` already maps to the LLM width: an imported thinker's projectors
are the identity (:mod:`plait.models.hf_io_omni`). ``proj`` rides in the embedding unit of the pipeline layout (the
layout has one post-norm module, ``ln_post``), which is exact because the tower cannot be split across stages
(:attr:`Qwen25OmniAudioFamily.layer_refusal`).

LLM: :class:`Qwen25OmniTextForCausalLM`, registered with ``AutoModelForCausalLM``; it rotates with the M-RoPE
positions ``[3, B, N]`` of :mod:`plait.data.omni_positions` (transformers' ``get_rope_index`` of the thinker: audio
and video of one clip time-aligned, ``use_audio_in_video``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniTextConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniThinkerTextModel, get_audio_cu_seqlens,
                                                                     get_pool_indices, get_valid_indices)

from plait.models.families.base import (ATTN_MLP_LORA, AudioFamily, EncoderLayout, TextStackCausalLM, positive_field,
                                        register_causal_lm)
from plait.models.families.qwen2_5_vl import Qwen25VLFamily, TemporalPatches
from plait.models.families.qwen2_audio import Qwen2AudioFeatureCount

__all__ = ["VISION", "AUDIO", "POSITION_ID_PER_SECONDS", "SECONDS_PER_CHUNK", "OmniAudioCall", "OmniTemporalPatches",
           "Qwen25OmniTextForCausalLM", "omni_audio_inputs"]

POSITION_ID_PER_SECONDS = 25
"""The thinker config's default ``position_id_per_seconds``: M-RoPE temporal positions per second of video or audio."""
SECONDS_PER_CHUNK = 2
"""The thinker config's default ``seconds_per_chunk``: seconds of a clip per interleaved video/audio chunk."""


@register_causal_lm
class Qwen25OmniTextForCausalLM(TextStackCausalLM, Qwen2ForCausalLM):
    """The thinker's LLM as a causal LM: ``Qwen2ForCausalLM`` (``lm_head``, forward, generation) whose decoder stack
    ``model`` is transformers' ``Qwen2_5OmniThinkerTextModel`` (M-RoPE: ``position_ids`` ``[3, B, N]``, or ``[B, N]``
    for text). State-dict names are ``model.*`` and ``lm_head.weight``, the thinker's ``model.language_model`` and
    ``lm_head`` tensors.

    Args:
        config: a ``Qwen2_5OmniTextConfig``.
    """

    config_class = Qwen2_5OmniTextConfig
    decoder_stack = Qwen2_5OmniThinkerTextModel


@dataclass(frozen=True)
class OmniTemporalPatches(TemporalPatches):
    """Qwen2.5-VL's temporal patches (:class:`~plait.models.families.qwen2_5_vl.TemporalPatches`) whose timing also
    carries the thinker's ``seconds_per_chunk``: the collator then positions the document by the thinker's
    ``get_rope_index`` (:mod:`plait.data.omni_positions`), whose text after a video continues past the video's
    largest position on all three streams (Qwen2.5-VL's continues from its spatial extent).

    Attributes:
        seconds_per_chunk: seconds of a clip per interleaved video/audio chunk.
        thinker: the thinker whose positions and clip layout the video takes (``"qwen2_5_omni"``,
            ``"qwen3_omni_moe"``).
    """

    seconds_per_chunk: float = field(default=float(SECONDS_PER_CHUNK), compare=False)
    thinker: str = field(default="qwen2_5_omni", compare=False)

    def timing(self, fps: float) -> dict[str, Any]:
        """:meth:`TemporalPatches.timing` with ``seconds_per_chunk`` and, for another thinker than Qwen2.5-Omni's,
        its name (``thinker``: whose ``get_rope_index`` positions the document, :mod:`plait.data.omni_positions`).

        Raises:
            ValueError: for ``fps`` not above 0.
        """
        out: dict[str, Any] = {**super().timing(fps), "seconds_per_chunk": float(self.seconds_per_chunk)}
        if self.thinker != "qwen2_5_omni":
            out["thinker"] = self.thinker
        return out


class Qwen25OmniVisionFamily(Qwen25VLFamily):
    """The thinker's vision tower: Qwen2.5-VL's family with the Omni tower class; videos timed by
    ``position_id_per_seconds`` (read from the tower config when an import set it there, else the default)."""

    name = "Qwen2.5-Omni vision"
    model_types = {"qwen2_5_omni_vision_encoder": None}
    encoder_class = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder"
    tower_keys = {r"^(thinker\.)?(model\.)?visual\.": ""}
    layer_class = "Qwen2_5OmniVisionBlock"

    def video_encoding(self, config: Any) -> OmniTemporalPatches:
        """Temporal patches of ``temporal_patch_size`` frames, ``position_id_per_seconds`` positions a second, clips
        interleaved by ``seconds_per_chunk`` (the thinker's values, read from the tower config where an import set
        them, else the defaults)."""
        rate = getattr(config, "position_id_per_seconds", None) or POSITION_ID_PER_SECONDS
        chunk = getattr(config, "seconds_per_chunk", None) or SECONDS_PER_CHUNK
        return OmniTemporalPatches(int(config.temporal_patch_size), float(rate), float(chunk))


def omni_audio_inputs(input_features: torch.Tensor, frames: list[int]) -> dict[str, Any]:
    """The audio tower's stock-forward kwargs of clips ``input_features`` ``[n, mel, T]`` (feature-extractor windows)
    with ``frames[i]`` valid mel frames each: ``input_features [mel, sum frames]`` (each clip's valid frames, in
    order) and ``feature_lens [n]``, what ``Qwen2_5OmniThinkerModel.get_audio_features`` passes.

    Raises:
        ValueError: for a clip with more frames than its window.
    """
    width = int(input_features.shape[-1])
    if any(f > width for f in frames):
        raise ValueError(f"audio clips of {frames} mel frames do not fit windows of {width} frames")
    feats = torch.cat([input_features[i, :, :f] for i, f in enumerate(frames)], dim=-1)
    return {"input_features": feats, "feature_lens": torch.tensor(frames, dtype=torch.long)}


def _audio_lengths(feature_lens: torch.Tensor) -> list[int]:
    """Features per clip of ``feature_lens`` mel frames (the tower's ``_get_feat_extract_output_lengths``)."""
    return [((int(f) - 1) // 2 + 1 - 2) // 2 + 1 for f in feature_lens.tolist()]


class OmniAudioCall:
    """Per-call interface of one Omni audio tower call (:class:`plait.models.tower_call.TowerCall`): the stock
    forward only. Its packed output ``[sum c_i, D]`` is returned per clip, zero padded: ``[n, max c_i, D]``, which the
    branch cuts to each clip's count.

    Args:
        encoder: the tower; kwargs: one call's stock-forward kwargs (:func:`omni_audio_inputs`).
    """

    def __init__(self, encoder: nn.Module, kwargs: dict[str, Any]) -> None:
        self.encoder, self.lengths = encoder, self.feature_lengths(encoder, kwargs["feature_lens"])

    def feature_lengths(self, encoder: nn.Module, feature_lens: torch.Tensor) -> list[int]:
        """Features per clip of ``feature_lens`` ``[n]`` mel frames (the tower's ``_get_feat_extract_output_lengths``)."""
        return _audio_lengths(feature_lens)

    @property
    def refusal(self) -> str:
        """Why the tower cannot be split across pipeline stages (its family's ``layer_refusal``)."""
        return AUDIO.layer_refusal

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """``[n, max c_i, output_dim]`` (clip ``i``'s features in rows ``:c_i``).

        Raises:
            ValueError: when the tower is split across pipeline stages, or its rows differ from the clips' counts.
        """
        if not owns_post_norm:
            raise ValueError(self.refusal)
        hidden = out.last_hidden_state
        if hidden.shape[0] != sum(self.lengths):
            raise ValueError(f"the Omni audio tower gave {hidden.shape[0]} features for clips of "
                             f"{self.lengths} features")
        return nn.utils.rnn.pad_sequence(list(hidden.split(self.lengths)), batch_first=True)

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Refused: the tower's chunked attention runs inside its own forward.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.refusal)

    def post_norm(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Refused as :meth:`layer`.

        Raises:
            ValueError: always.
        """
        raise ValueError(self.refusal)


class Qwen25OmniAudioFamily(AudioFamily):
    """The thinker's audio tower: Whisper's encoder over chunks of each clip, pooled and projected to the LLM
    width; Qwen2-Audio's feature count."""

    name = "Qwen2.5-Omni audio"
    model_types = {"qwen2_5_omni_audio_encoder": None}
    encoder_class = "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniAudioEncoder"
    # audio_bos_eos_token: a table the thinker never reads (off the hidden-state path)
    layout = EncoderLayout(("conv1", "conv2", "positional_embedding", "proj"), "layers", "ln_post",
                           ("audio_bos_eos_token",))
    tower_call = OmniAudioCall
    layer_class = "Qwen2_5OmniAudioEncoderLayer"
    layer_refusal = ("the Qwen2.5-Omni audio tower's layers cannot start a pipeline stage (its chunked attention, "
                     "pooling and projection run inside its own forward): give the branch one stage")
    pooled_output = True
    output_pool = 2
    lora_targets = ATTN_MLP_LORA  # Whisper's layer: q/k/v/out projections, fc1, fc2 (not the tower's proj)

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Qwen2AudioFeatureCount:
        """Qwen2-Audio's count over the 30-s window (``max_source_positions`` conv positions).

        Raises:
            ValueError: for ``downsample != 1`` (the tower's output is already pooled and projected).
        """
        if downsample != 1:
            raise ValueError("the Qwen2.5-Omni audio tower's features are pooled and projected: use downsample = 1")
        return Qwen2AudioFeatureCount(hop_length, 1, int(encoder.config.max_source_positions), sampling_rate)

    def feature_size(self, config: Any, hidden: int, downsample: int) -> int:
        """The projection's width ``output_dim``."""
        return int(config.output_dim)

    def call_inputs(self, encoder: Any, count: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """:func:`omni_audio_inputs` of the clips' valid mel frames (``count.frames`` of their samples)."""
        frames = [count.frames(int(n)) for n in inputs["num_samples"].tolist()]
        return omni_audio_inputs(inputs["input_features"], frames)

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        """One clip of one chunk (``2 n_window`` frames); on the meta device the tower's index tensors are passed
        precomputed (built on the CPU: its forward reads their values; ``cu_seqlens`` stays there, its layers read
        it)."""
        frames = 2 * int(config.n_window)
        feats = torch.zeros(int(config.num_mel_bins), frames, dtype=dtype, device=device)
        with torch.device("cpu"):
            lens = torch.tensor([frames])
        if torch.device(device or "cpu").type != "meta":
            return {"input_features": feats, "feature_lens": lens.to(device)}
        with torch.device("cpu"):
            pre = self.meta_indices(config, lens, device)
        pre["padded_feature"] = feats[None]
        return {"input_features": feats, "feature_lens": lens, **pre}

    def meta_indices(self, config: Any, lens: torch.Tensor, device: torch.device | str | None) -> dict[str, Any]:
        """The index tensors the tower's forward builds from ``lens`` (``[clips]`` mel frames, on the CPU), for a
        forward on the meta device: each on ``device`` but ``cu_seqlens``, which the layers read on the CPU."""
        chunks = lens.clone()
        pre = {"chunk_lengths": chunks, "valid_indices": get_valid_indices(chunks),
               "pool_indices": get_pool_indices(lens), "cu_seqlens": get_audio_cu_seqlens(chunks)}
        return {k: v if k == "cu_seqlens" else v.to(device) for k, v in pre.items()}

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """Whisper's facts with the stride-2 output pool and sinusoidal positions (no table); an item is the 30-s
        window's ``max_source_positions`` positions, every layer attending inside chunks of ``n_window`` positions
        (``2 n_window`` mel frames). ``proj`` (``d_model x output_dim``) is not costed."""
        fields = super().arch_fields(config)
        fields["positions"] = 0
        fields["window"] = positive_field(config, "n_window")
        return fields


VISION = Qwen25OmniVisionFamily()
AUDIO = Qwen25OmniAudioFamily()
