"""The Qwen3-VL vision tower (transformers' ``Qwen3VLVisionModel``) with its DeepStack mergers, and Qwen3-VL's LLM
as a causal LM.

The tower takes what Qwen2.5-VL's takes (``Qwen2VLImageProcessorPil`` patches ``[t*h*w, C*T*p*p]`` in merge-block
order and ``grid_thw``; 16-pixel patches, 2x2 merge blocks), adds a learned position table resampled to each grid,
runs its blocks with full attention per image (no windows) and merges each 2x2 block with ``merger``: ``t h w / 4``
features per image of ``out_hidden_size`` (the LLM width). DeepStack (Meng et al., arXiv 2406.04334): after each
block of ``deepstack_visual_indexes`` one more merger (``deepstack_merger_list``) gives another ``t h w / 4``
features of the same width, which ``Qwen3VLTextModel`` ADDS to the hidden states of the visual tokens after its
decoder layers ``0 .. k-1`` (``k = len(deepstack_visual_indexes)``).

plait's branch feature of one placeholder is therefore ``(1 + k)`` chunks of ``out_hidden_size``: the merged
feature first, then DeepStack feature ``j`` (for LLM layer ``j``), concatenated along the feature dim
(:meth:`Qwen3VLCall.stock_output` of the stock forward's ``pooler_output`` and ``deepstack_features``). The
projector maps the first chunk and passes the others through (``plait.models.projector``; an imported checkpoint's
projector is the identity, as for Qwen2.5-VL), and the composite scatters the first chunk into the placeholder
embeddings and adds the others with forward hooks on the receiving decoder layers (``plait.models.deepstack``).
One tensor per branch thus carries everything, through deferral and the encoder-to-LLM pipeline hop alike.

Pipeline stages: the DeepStack mergers read blocks in the middle of the tower, so the tower's units stay in one
stage (:attr:`Qwen3VLFamily.layer_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.vision_utils import (get_vision_attention_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

from plait.models.families.base import (EncoderLayout, TextStackCausalLM, config_field, positive_field,
                                        register_causal_lm)
from plait.models.families.qwen2_5_vl import Qwen25VLFamily, Qwen25VLFeatureCount, TemporalPatches, patch_values

__all__ = ["FAMILY", "MODEL_TYPES", "ENCODER_CLASS", "MAX_PIXELS", "Qwen3VLCall", "Qwen3VLTextForCausalLM",
           "TimestampedPatches", "deepstack_count", "qwen3_vl_dummy_input"]

MODEL_TYPES = {"qwen3_vl_vision": None, "qwen3_vl": "vision_config"}
ENCODER_CLASS = "Qwen3VLVisionModel"
MAX_PIXELS = 16777216
"""The largest image the tower takes here, in pixels of the resized image (16384 merged 32x32 blocks; Qwen3-VL's
position table is resampled to any grid, so this only bounds the work of one item)."""


def deepstack_count(config: Any) -> int:
    """``k``: the DeepStack features per placeholder of a tower of ``config`` (``len(deepstack_visual_indexes)``)."""
    return len(config_field(config, "deepstack_visual_indexes", ()) or ())


def _precomputed(config: Any, grid: torch.Tensor) -> dict[str, Any]:
    """The per-call tensors of a call on ``grid`` ``[n, 3]`` by transformers' own helpers (``vision_utils``), under
    the kwarg names the stock forward accepts precomputed."""
    merge = int(config.spatial_merge_size)
    side = int(int(config.num_position_embeddings) ** 0.5)
    indices, weights = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=side, mode="bilinear",
                                                                    align_corners=True, spatial_merge_size=merge)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, config)
    return {"interp_indices": indices, "interp_weights": weights, "position_ids": get_vision_position_ids(grid, merge),
            "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}


def qwen3_vl_dummy_input(config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
    """A one-image input of one 2x2 block of merge blocks (``4 m^2`` patches), zeros in ``dtype``; on the meta device
    the per-call tensors are passed precomputed (built on the CPU, the tensors the blocks read moved to ``device``)."""
    side = 2 * int(config.spatial_merge_size)
    pixels = torch.zeros(side * side, patch_values(config), dtype=dtype, device=device)
    if torch.device(device or "cpu").type != "meta":
        return {"hidden_states": pixels, "grid_thw": torch.tensor([[1, side, side]], device=device)}
    with torch.device("cpu"):  # the probe may run inside a torch.device("meta") context (a meta build)
        grid = torch.tensor([[1, side, side]])
        pre = _precomputed(config, grid)
    for key in ("interp_indices", "interp_weights", "position_ids"):
        pre[key] = pre[key].to(device)
    return {"hidden_states": pixels, "grid_thw": grid, **pre}


class Qwen3VLCall:
    """Per-call interface of one Qwen3-VL tower call (:class:`plait.models.tower_call.TowerCall`): the stock forward
    only. Its output is the merged features with the DeepStack features appended.

    Args:
        encoder: the tower; kwargs: one call's stock-forward kwargs (``hidden_states``, ``grid_thw``).
    """

    def __init__(self, encoder: nn.Module, kwargs: dict[str, Any]) -> None:
        self.encoder = encoder

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """``[features, (1 + k) * out_hidden_size]``: ``pooler_output`` then each of ``deepstack_features`` (image
        order, merge-block rows).

        Raises:
            ValueError: when the merger is not on this stage (the tower was split across pipeline stages).
        """
        if not owns_post_norm:
            raise ValueError(FAMILY.layer_refusal)
        return torch.cat([out.pooler_output, *(out.deepstack_features or [])], dim=-1)

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Refused: a block's DeepStack merger output cannot leave a stage.

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


@dataclass(frozen=True)
class TimestampedPatches:
    """Qwen3-VL's video encoding (``plait.data.video.VideoEncoding``): each temporal patch of ``temporal_patch_size``
    sampled frames is ONE image item of grid ``(1, h, w)`` (the rows of Qwen2.5-VL's :class:`TemporalPatches` item,
    patch by patch), written in the text as ``Qwen3VLProcessor.replace_video_token`` writes it: ``<t seconds>`` (the
    mean time of the patch's first and last frame, one decimal, from the sampled frame indices and the video's own
    frame rate: its ``_calculate_timestamps``) then ``<|vision_start|>``, the patch's ``h w / m^2`` tokens and
    ``<|vision_end|>``; a record's ``<|vision_start|><|video_pad|><|vision_end|>`` becomes that run, as the processor
    collapses the chat template's wrapper. Both are transformers' functions, called on a stand-in holding the values
    they read (no copy of the rule). Each patch is positioned as an image (``timing`` is empty): Qwen3-VL's
    ``get_rope_index`` positions a video's temporal patches so, with the timestamps as text between them.

    Frames go through the branch's image processor (``Qwen2VLImageProcessorPil``) like Qwen2.5-VL's video frames,
    not through ``Qwen3VLVideoProcessor``, which needs torchvision: its whole-video pixel budget (``size``) does not
    apply; ``[model.encoders.<name>.video]`` ``fps`` / ``max_frames`` choose the frames (:mod:`plait.data.video`).

    Attributes:
        temporal_patch_size: the tower's ``T`` (frames per temporal patch).
        merge_size: the tower's ``spatial_merge_size``.
    """

    temporal_patch_size: int
    merge_size: int
    wrapper: ClassVar[tuple[str, str]] = ("<|vision_start|>", "<|vision_end|>")
    """The tokens around each temporal patch (Qwen3VLProcessor's ``vision_start_token`` / ``vision_end_token``)."""

    def _check(self, frames: int) -> None:
        if frames < self.temporal_patch_size:
            raise ValueError(f"{frames} sampled frame(s) is shorter than one temporal patch of "
                             f"{self.temporal_patch_size} frames (Qwen3-VL's video processor refuses it); give a "
                             "longer video or raise the branch's video.fps")

    def items(self, hf_processor: Any, frames: list[Any]) -> list[tuple[dict[str, Any], tuple[int, int, int]]]:
        """``[(item, (1, h, w))]`` per temporal patch: its ``h w`` patch rows ``[h w, C T p p]`` and grid.

        Raises:
            ValueError: for fewer frames than one temporal patch, or frames whose processed grids differ.
        """
        self._check(len(frames))
        (item, (t, h, w)), = TemporalPatches(self.temporal_patch_size).items(hf_processor, frames)
        rows = item["pixel_values"].reshape(t, h * w, -1)
        return [({"pixel_values": rows[g].clone(), "image_grid_thw": torch.tensor([1, h, w])}, (1, h, w))
                for g in range(t)]

    def sizes(self, frames: int, frame_size: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """``(1, h, w)`` per temporal patch from the frame count and one processed frame's size.

        Raises:
            ValueError: as :meth:`items`.
        """
        self._check(int(frames))
        h, w = (int(d) for d in frame_size[-2:])
        return [(1, h, w)] * -(-int(frames) // self.temporal_patch_size)

    def timing(self, fps: float) -> dict[str, float]:
        """Nothing: each temporal patch is positioned as an image."""
        return {}

    def text(self, placeholder: str, indices: list[int], rate: float, sizes: list[tuple[int, int, int]]) -> str:
        """The video's text as ``Qwen3VLProcessor.replace_video_token`` writes it, with ``placeholder`` as its video
        token: per temporal patch ``<t seconds><|vision_start|>`` + ``placeholder`` x ``h w / m^2`` +
        ``<|vision_end|>``, ``t`` from the sampled frame ``indices`` and the video's frame ``rate`` (frames per
        second of the stream); ``sizes``: :meth:`sizes`."""
        holder = SimpleNamespace(
            video_processor=SimpleNamespace(merge_size=self.merge_size, temporal_patch_size=self.temporal_patch_size),
            vision_start_token=self.wrapper[0], vision_end_token=self.wrapper[1], video_token=placeholder,
            _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
        _, h, w = sizes[0]
        inputs = {"video_grid_thw": torch.tensor([[len(sizes), h, w]]),
                  "video_metadata": [SimpleNamespace(fps=float(rate), frames_indices=list(indices))]}
        return Qwen3VLProcessor.replace_video_token(holder, inputs, 0)


@register_causal_lm
class Qwen3VLTextForCausalLM(TextStackCausalLM, Qwen3ForCausalLM):
    """Qwen3-VL's LLM as a causal LM: ``Qwen3ForCausalLM`` (``lm_head``, forward, generation) whose decoder stack
    ``model`` is transformers' ``Qwen3VLTextModel`` (interleaved M-RoPE: ``position_ids`` ``[3, B, N]``, or ``[B, N]``
    for text). State-dict names are ``model.*`` and ``lm_head.weight``, the ``language_model`` / ``lm_head`` tensors
    of ``Qwen3VLForConditionalGeneration``. DeepStack features reach its decoder layers through forward hooks
    (``plait.models.deepstack``), not through the stack's ``deepstack_visual_embeds`` argument.

    Args:
        config: a ``Qwen3VLTextConfig``.
    """

    config_class = Qwen3VLTextConfig
    decoder_stack = Qwen3VLTextModel


class Qwen3VLFamily(Qwen25VLFamily):
    """Qwen3-VL: every image's patches packed into one call, merged 2x2, with DeepStack features appended. As
    Qwen2.5-VL (:class:`~plait.models.families.qwen2_5_vl.Qwen25VLFamily`: processor, packing, input checks) but its
    tower, call, feature count, dummy input, video encoding and architecture facts."""

    name = "Qwen3-VL"
    model_types = MODEL_TYPES
    encoder_class = ENCODER_CLASS
    tower_keys = {r"^(model\.)?visual\.": ""}
    # the DeepStack mergers ride with the embedding unit: the tower stays in one stage (layer_refusal)
    layout = EncoderLayout(("patch_embed", "pos_embed", "rotary_pos_emb", "deepstack_merger_list"), "blocks", "merger")
    tower_call = Qwen3VLCall
    # tensor parallelism splits each block's MLP (Megatron-LM's colwise fc1, rowwise fc2); the fused qkv projection
    # (q, k, v interleaved per output row block) and the attention stay replicated
    tp_plan = {"mlp.linear_fc1": "colwise", "mlp.linear_fc2": "rowwise"}
    layer_class = "Qwen3VLVisionBlock"
    layer_refusal = ("the Qwen3-VL tower's DeepStack mergers read blocks inside the tower and their features leave "
                     "with the merger's: keep the tower's units (embedding, blocks, merger) in one pipeline stage")

    def image_feature_count(self, config: Any, select: str) -> Qwen25VLFeatureCount:
        return Qwen25VLFeatureCount(int(config.spatial_merge_size), MAX_PIXELS // int(config.patch_size) ** 2)

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        return qwen3_vl_dummy_input(config, dtype, device)

    def video_encoding(self, config: Any) -> TimestampedPatches:
        """:class:`TimestampedPatches`: a timestamp and one image item per temporal patch."""
        return TimestampedPatches(int(config.temporal_patch_size), int(config.spatial_merge_size))

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """A Conv3d patch embedding with bias over ``T x p x p``, LayerNorms, a plain GELU MLP, full attention per
        image, the 2x2 merger as post-norm (``output_pool = merge^2``) with the ``k`` DeepStack mergers beside it
        (``deepstack = k``: features for LLM layers ``0 .. k-1``) and the learned position table (``positions``)."""
        hidden, heads = positive_field(config, "hidden_size"), positive_field(config, "num_heads")
        patch, merge = positive_field(config, "patch_size"), positive_field(config, "spatial_merge_size")
        return dict(
            modality="vision", hidden=hidden, layers=positive_field(config, "depth"), heads=heads,
            head_dim=hidden // heads, intermediate=positive_field(config, "intermediate_size"), gated_mlp=False,
            norm_bias=True, num_channels=positive_field(config, "in_channels", 3),
            patch=(positive_field(config, "temporal_patch_size") * patch, patch), patch_bias=True,
            output_pool=merge**2, item_len=(4 * merge * merge),
            positions=positive_field(config, "num_position_embeddings"),
            merger=(merge**2 * hidden, positive_field(config, "out_hidden_size")), deepstack=deepstack_count(config))


FAMILY = Qwen3VLFamily()
