"""The Voxtral audio tower (transformers' ``VoxtralEncoder``) with its multi-modal projector, as one plait branch.

The tower is Whisper-large-v3's encoder (``conv1``, stride-2 ``conv2``, learned positions, pre-norm layers, final
``layer_norm``); it reads the feature extractor's full 30-s window (``2 * max_source_positions`` mel frames) with no
padding mask and keeps every position. ``VoxtralModel.get_audio_features`` then stacks ``k = intermediate_size /
d_model`` consecutive positions into one feature of ``intermediate_size`` values (a reshape) and maps it with
``VoxtralMultiModalProjector`` (Linear without bias, ``projector_hidden_act``, Linear without bias) to the LLM width.
A clip (at most one window) therefore gives ``max_source_positions / k`` features whatever its length (375 for the
published 30-s window), the count the Voxtral tokenizer writes ``[AUDIO]`` tokens for (the clip padded to 30 s, one
token per 80 ms).

plait's tower is :class:`VoxtralProjectedEncoder`: the stock encoder class holding transformers'
``VoxtralMultiModalProjector`` as ``multi_modal_projector`` when its config carries ``projector_hidden_size`` (an
imported Voxtral: :mod:`plait.models.hf_io_voxtral`), whose forward returns the stacked, projected features as
``pooler_output`` ``[n, P / k, projector_hidden_size]``; the branch's plait projector is then the identity (folded on
export). Without that field (a bare ``voxtral_encoder``) ``pooler_output`` is the stacked features ``[n, P / k,
intermediate_size]`` and plait's projector maps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers.models.voxtral.configuration_voxtral import VoxtralEncoderConfig
from transformers.models.voxtral.modeling_voxtral import VoxtralEncoder, VoxtralMultiModalProjector

from plait.models.families.base import WHISPER_PLAN, AudioFamily, EncoderLayout, checked_clip_samples

__all__ = ["FAMILY", "MODEL_TYPES", "VoxtralProjectedEncoder", "VoxtralFeatureCount", "VoxtralAudioCall",
           "stacked_frames"]

# config model_type -> the encoder config lives at (None: the config itself; "audio_config": a full model's)
MODEL_TYPES = {"voxtral_encoder": None, "voxtral": "audio_config"}


def stacked_frames(config: Any) -> int:
    """Encoder positions stacked into one feature: ``intermediate_size / d_model`` (4 for the published tower).

    Raises:
        ValueError: when ``intermediate_size`` is not a multiple of ``d_model`` or does not divide the window's
            ``max_source_positions`` positions into whole features.
    """
    width, inter = int(config.d_model), int(config.intermediate_size)
    k = inter // width
    if k < 1 or inter % width or int(config.max_source_positions) % k:
        raise ValueError(f"the Voxtral tower's intermediate_size {inter} must be a multiple k of d_model {width} "
                         f"with k dividing max_source_positions {config.max_source_positions}")
    return k


class VoxtralProjectedEncoder(VoxtralEncoder):
    """``VoxtralEncoder`` whose forward also stacks and projects its output as ``VoxtralModel.get_audio_features``
    does: ``pooler_output`` ``[n, P / k, out]`` from ``last_hidden_state`` ``[n, P, d_model]`` (``k``:
    :func:`stacked_frames`; ``out``: ``projector_hidden_size``, or ``intermediate_size`` without a projector).

    Args:
        config: a ``VoxtralEncoderConfig``; with ``projector_hidden_size`` (the LLM width) and
            ``projector_hidden_act`` set, the tower holds transformers' ``VoxtralMultiModalProjector`` as
            ``multi_modal_projector`` (state-dict names ``multi_modal_projector.linear_1/linear_2.weight``).
    """

    config_class = VoxtralEncoderConfig

    def __init__(self, config: VoxtralEncoderConfig) -> None:
        super().__init__(config)
        out = getattr(config, "projector_hidden_size", None)
        if out is not None:
            act = getattr(config, "projector_hidden_act", None) or "gelu"
            view = SimpleNamespace(audio_config=config, text_config=SimpleNamespace(hidden_size=int(out)),
                                   projector_hidden_act=act)
            self.multi_modal_projector = VoxtralMultiModalProjector(view)
            self.post_init()

    def forward(self, input_features: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> Any:
        """The stock forward (``input_features`` ``[n, mel, 2P]``), with ``pooler_output`` ``[n, P / k, out]``."""
        out = super().forward(input_features, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state
        stacked = hidden.reshape(hidden.shape[0], -1, int(self.config.intermediate_size))
        projector = getattr(self, "multi_modal_projector", None)
        out.pooler_output = projector(stacked) if projector is not None else stacked
        return out


@dataclass(frozen=True)
class VoxtralFeatureCount:
    """Features the Voxtral tower gives a clip of ``n`` samples: ``features`` for any clip that fits the window (the
    tower reads the whole padded window; the tokenizer pads the clip to it).

    Attributes:
        features: ``max_source_positions / k`` (:func:`stacked_frames`).
        max_positions: ``max_source_positions`` (1500: conv positions of the 30-s window).
        hop_length: feature extractor hop in samples (160).
        sampling_rate: samples per second (16000).
    """

    features: int
    max_positions: int
    hop_length: int
    sampling_rate: int

    @property
    def max_samples(self) -> int:
        """Longest clip in samples: the window of ``2 * max_positions`` mel frames."""
        return 2 * self.max_positions * self.hop_length

    def __call__(self, num_samples: int) -> int:
        """Features (tokens) for a clip of ``num_samples`` samples.

        Raises:
            ValueError: for an empty clip or one longer than the window (split longer audio into 30-s clips).
        """
        checked_clip_samples(num_samples, self.max_samples, self.sampling_rate)
        return self.features


class VoxtralAudioCall:
    """Per-call interface of one Voxtral tower call (:class:`plait.models.tower_call.TowerCall`): the stock forward
    only, whose ``pooler_output`` holds the stacked, projected features.

    Args:
        encoder: the tower; kwargs: one call's stock-forward kwargs.
    """

    def __init__(self, encoder: nn.Module, kwargs: dict[str, Any]) -> None:
        self.encoder = encoder

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """``[n, P / k, out]``: the forward's ``pooler_output``.

        Raises:
            ValueError: when the tower is split across pipeline stages.
        """
        if not owns_post_norm:
            raise ValueError(FAMILY.layer_refusal)
        return out.pooler_output

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Refused: the stacking and projection run inside the tower's forward.

        Raises:
            ValueError: always.
        """
        raise ValueError(FAMILY.layer_refusal)

    def post_norm(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Refused as :meth:`layer`.

        Raises:
            ValueError: always.
        """
        raise ValueError(FAMILY.layer_refusal)


class VoxtralFamily(AudioFamily):
    """Voxtral: Whisper-large-v3's encoder over the full window, ``k`` positions stacked per feature, projected."""

    name = "Voxtral"
    model_types = MODEL_TYPES
    encoder_class = "plait.models.families.voxtral.VoxtralProjectedEncoder"
    # the projector rides in the embedding unit: exact because the tower is never split (layer_refusal)
    layout = EncoderLayout(("conv1", "conv2", "embed_positions", "multi_modal_projector"), "layers", "layer_norm")
    tp_plan = WHISPER_PLAN
    tower_call = VoxtralAudioCall
    layer_class = "VoxtralEncoderLayer"
    layer_refusal = ("the Voxtral tower's layers cannot start a pipeline stage (its frame stacking and projector "
                     "run inside its own forward): give the branch one stage")
    pooled_output = True

    def layout_of(self, config: Any) -> EncoderLayout:
        """:attr:`layout`; for a tower without its projector (no ``projector_hidden_size``), without it."""
        if getattr(config, "projector_hidden_size", None) is not None:
            return self.layout
        return EncoderLayout(("conv1", "conv2", "embed_positions"), "layers", "layer_norm")

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> VoxtralFeatureCount:
        """``max_source_positions / k`` features per clip of at most the window.

        Raises:
            ValueError: for ``downsample != 1`` (the tower's features are already stacked).
        """
        if downsample != 1:
            raise ValueError("the Voxtral tower stacks its positions itself: use downsample = 1")
        positions = int(encoder.config.max_source_positions)
        return VoxtralFeatureCount(positions // stacked_frames(encoder.config), positions, hop_length, sampling_rate)

    def feature_size(self, config: Any, hidden: int, downsample: int) -> int:
        """``projector_hidden_size`` (the tower's projector output), else ``intermediate_size`` (stacked frames)."""
        out = getattr(config, "projector_hidden_size", None)
        return int(out) if out is not None else int(config.intermediate_size)

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """Whisper's facts with ``k`` positions stacked per feature as the planner's ``output_pool`` (the
        projector inside the tower is not costed)."""
        if isinstance(config, dict):
            config = VoxtralEncoderConfig(**{k: v for k, v in config.items() if k != "model_type"})
        fields = super().arch_fields(config)
        fields["output_pool"] = stacked_frames(config)
        return fields


FAMILY = VoxtralFamily()
