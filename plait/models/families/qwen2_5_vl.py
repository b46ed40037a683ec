"""The Qwen2.5-VL vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``): dynamic resolution,
window attention and the 2x2 patch merger.

The image processor (``Qwen2VLImageProcessorPil``: PIL backend, no torchvision) resizes each image to multiples of
``patch_size * merge_size`` pixels within ``[min_pixels, max_pixels]`` and patchifies it: ``pixel_values
[t*h*w, C * T * p * p]`` (``T = temporal_patch_size``; an image is one frame repeated to ``T``) and its grid
``image_grid_thw = (t, h, w)`` in patches. The tower packs the patches of every image of a call into one sequence
(``cu_seqlens`` per image, ``cu_window_seqlens`` per attention window), permutes them into window order, runs the
blocks (full attention in ``fullatt_block_indexes``, window attention elsewhere) with 2D rotary position embeddings
from the grid, and merges each 2x2 patch block with the merger (``ln_q`` + MLP to ``out_hidden_size``), back in
image order: ``t * h * w / merge_size^2`` features per image, what ``Qwen2_5_VLModel.get_image_features`` returns.

Projector role: the merger stays a unit of the tower (its last one, in the post-norm slot of the pipeline layout)
and plait's projector follows it. The merger's weights live in the tower's checkpoint (``visual.merger``), it runs
inside the stock forward on window-ordered hidden states before the reverse permutation, and the tower's
``pooler_output`` is then exactly the merged features of Hugging Face's model (peer parity without touching the
stock forward); ``plait import`` of a Qwen2.5-VL checkpoint, whose merger already maps to the LLM width, makes that
projector the identity (frozen in the imported job) and ``plait export`` folds it into the merger's last Linear
(:mod:`plait.models.hf_io`). Consequence: ``freeze`` of the branch freezes the merger with the blocks.

Pipeline stages: the per-call inputs (rotary cos/sin, ``cu_seqlens``, window index) are recomputed on every stage
from ``grid_thw`` (:class:`Qwen25VLCall`, the :mod:`plait.models.tower_call` hook); hidden states travel between
stages in window order ``[patches, hidden]`` and the merger's stage restores image order.

Whole model: Qwen2.5-VL's LLM rotates with 3-D multimodal positions (M-RoPE: ``position_ids [3, B, N]``, image
tokens at their (t, h, w) grid coordinates). transformers has the text model (``Qwen2_5_VLTextModel``, config
``qwen2_5_vl_text``) but no causal-LM class for it; :class:`Qwen25VLTextForCausalLM` is ``Qwen2ForCausalLM`` (its
``lm_head`` and forward) holding ``Qwen2_5_VLTextModel`` as its decoder stack, registered with
``AutoModelForCausalLM`` so that plait builds, saves and loads it like any causal LM. The collator computes each
document's M-RoPE positions (:mod:`plait.data.mrope`, transformers' ``get_rope_index``) into
``Batch.rope_position_ids`` and the composite passes them as the text model's public ``position_ids`` argument
(:func:`takes_mrope`), so its logits equal ``Qwen2_5_VLForConditionalGeneration``'s with HF's own positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel, Qwen2_5_VLVisionRotaryEmbedding
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids, get_vision_window_index

from plait.models.families.base import (EncoderInputCheck, EncoderLayout, TextStackCausalLM, VisionFamily, config_field,
                                        positive_field, register_causal_lm)

__all__ = ["FAMILY", "MODEL_TYPES", "ENCODER_CLASS", "TOWER_KEYS", "MAX_PIXELS", "Qwen25VLFeatureCount", "Qwen25VLCall",
           "TemporalPatches", "qwen2_5_vl_inputs", "qwen2_5_vl_dummy_input", "patch_values",
           "check_qwen2_5_vl_processor", "feature_count", "max_patches", "Qwen25VLTextForCausalLM", "MROPE_TEXT_TYPES",
           "takes_mrope"]

# config model_type -> where the vision config lives (None: the config itself; "vision_config": a full model's)
MODEL_TYPES = {"qwen2_5_vl_vision": None, "qwen2_5_vl": "vision_config"}
ENCODER_CLASS = "Qwen2_5_VisionTransformerPretrainedModel"
TOWER_KEYS = {r"^(model\.)?visual\.": ""}
"""``from_pretrained`` key mapping that loads a full Qwen2.5-VL checkpoint's tower (stored as ``visual.*``)."""
MAX_PIXELS = 12845056
"""The largest image Qwen2.5-VL is published for (its processor's ``max_pixels``, 16384 merged 28x28 blocks): the
tower's maximum, in pixels of the resized image."""


@dataclass(frozen=True)
class Qwen25VLFeatureCount:
    """Features of one image or clip of ``(t, h, w)`` patches (the processor's ``image_grid_thw``):
    ``t * h * w / merge_size^2`` (one per merged block), as ``Qwen2_5_VLModel.get_image_features`` splits them.

    Attributes:
        merge_size: the tower's ``spatial_merge_size`` (2: 2x2 blocks).
        max_patches: patches of the largest image the tower takes (:data:`MAX_PIXELS` / ``patch_size^2``).
    """

    merge_size: int
    max_patches: int

    def __call__(self, size: tuple[int, ...]) -> int:
        """Features (tokens) of a grid ``size = (t, h, w)`` (or ``(h, w)``: one frame) in patches.

        Raises:
            ValueError: for an empty grid, a side that is not a multiple of ``merge_size`` (the processor's
                ``merge_size`` or ``patch_size`` is not the tower's), or more patches than ``max_patches``.
        """
        t, h, w = (1, *size) if len(size) == 2 else size
        t, h, w = int(t), int(h), int(w)
        if min(t, h, w) < 1:
            raise ValueError(f"image grid {t}x{h}x{w} has no patch")
        if h % self.merge_size or w % self.merge_size:
            raise ValueError(f"image grid of {h}x{w} patches is not a multiple of the Qwen2.5-VL tower's "
                             f"{self.merge_size}x{self.merge_size} merge blocks (the processor's merge_size or "
                             "patch_size differs from the tower's)")
        if h * w > self.max_patches:
            raise ValueError(f"image of {h}x{w} = {h * w} patches is larger than the Qwen2.5-VL tower's maximum of "
                             f"{self.max_patches} patches ({MAX_PIXELS} pixels: lower the processor's max_pixels)")
        return t * h * w // self.merge_size**2


def patch_values(config: Any) -> int:
    """Values per patch row of ``pixel_values``: ``in_channels * temporal_patch_size * patch_size^2``."""
    return int(config.in_channels) * int(config.temporal_patch_size) * int(config.patch_size) ** 2


def check_qwen2_5_vl_processor(processor: Any, config: Any) -> None:
    """Refuse, when the job is built, an image processor that does not fit the tower ``config``: its ``patch_size``,
    ``temporal_patch_size`` or ``merge_size`` differs from the tower's, or its largest image (``max_pixels``,
    ``size.longest_edge``) is above :data:`MAX_PIXELS`.

    Raises:
        ValueError: starting with the processor field (``processor.max_pixels = ...``).
    """
    for field, tower in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):
        value = getattr(processor, field, None)
        if value is not None and int(value) != int(getattr(config, tower)):
            raise ValueError(f"processor.{field} = {value} but the Qwen2.5-VL tower's {tower} is "
                             f"{getattr(config, tower)}; leave it out to use the tower's")
    size = getattr(processor, "size", None) or {}
    largest = size.get("longest_edge") if hasattr(size, "get") else None
    if largest is not None and int(largest) > MAX_PIXELS:
        raise ValueError(f"processor.max_pixels = {largest} is above the Qwen2.5-VL tower's maximum of {MAX_PIXELS} "
                         "pixels (size.longest_edge); lower it or leave it out")


def qwen2_5_vl_inputs(pixel_values: list[torch.Tensor], grids: list[torch.Tensor]) -> dict[str, Any]:
    """Stock-forward kwargs packing images of any sizes into one call: ``hidden_states [sum t*h*w, C*T*p*p]``
    (the tower's name for its input patches) and ``grid_thw [n, 3]``."""
    pixels = torch.cat(pixel_values)
    grid = torch.stack([torch.as_tensor(g, dtype=torch.long) for g in grids]).to(pixels.device)
    return {"hidden_states": pixels, "grid_thw": grid}


def qwen2_5_vl_dummy_input(config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
    """A one-image input of one window (``window_size`` pixels square), zeros in ``dtype``. On the meta device the
    per-call tensors are passed precomputed (the stock forward accepts them): position ids and window index on
    ``device``, the sequence boundaries (read with ``.tolist()``) and the grid on the CPU."""
    merge = int(config.spatial_merge_size)
    side = -(-max(1, int(config.window_size) // int(config.patch_size)) // merge) * merge  # whole merge blocks
    pixels = torch.zeros(side * side, patch_values(config), dtype=dtype, device=device)
    if torch.device(device or "cpu").type != "meta":
        return {"hidden_states": pixels, "grid_thw": torch.tensor([[1, side, side]], device=device)}
    with torch.device("cpu"):  # the probe may run inside a torch.device("meta") context (a meta build)
        grid = torch.tensor([[1, side, side]])
        pre = _precomputed(config, grid)
    pre["position_ids"], pre["window_index"] = pre["position_ids"].to(device), pre["window_index"].to(device)
    return {"hidden_states": pixels, "grid_thw": grid, **pre}


def _precomputed(config: Any, grid: torch.Tensor) -> dict[str, Any]:
    """The per-call tensors of a call on ``grid`` ``[n, 3]`` by transformers' own helpers (``vision_utils``), under
    the kwarg names the stock forward accepts precomputed."""
    merge = int(config.spatial_merge_size)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, config)
    window_index, cu_window = get_vision_window_index(grid, merge, int(config.window_size), int(config.patch_size))
    out = {"position_ids": get_vision_position_ids(grid, merge), "cu_seqlens": cu_seqlens,
           "window_index": window_index.to(grid.device), "cu_window_seqlens": cu_window}
    out["max_seqlen"], out["max_window_seqlen"] = max_seqlen, get_max_seqlen(cu_window, config)
    return out


class Qwen25VLCall:
    """Per-call inputs of one Qwen2.5-VL tower call (the :class:`plait.models.tower_call.TowerCall` interface),
    from its ``grid_thw`` only: every block gets ``cu_seqlens`` (per image for ``fullatt_block_indexes``, per
    window otherwise), the matching ``max_seqlen`` (flash attention) and the rotary ``(cos, sin)`` in window order;
    the merger's output is put back in image order. Hidden states between stages are ``[patches, hidden]`` in
    window order (the stock forward's ``last_hidden_state``).

    Args:
        encoder: the tower (a pipeline rank's pruned one: its ``patch_embed`` and ``rotary_pos_emb`` may be
            ``nn.Identity``; the rotary table is rebuilt from the config, a parameter-free module).
        kwargs: one call's stock-forward kwargs (:func:`qwen2_5_vl_inputs`).
    """

    def __init__(self, encoder: nn.Module, kwargs: dict[str, Any]) -> None:
        self.encoder, self.grid = encoder, kwargs["grid_thw"]

    @cached_property
    def _pre(self) -> dict[str, Any]:
        return _precomputed(self.encoder.config, self.grid)

    def _rope(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary ``(cos, sin)`` ``[patches, head_dim]`` in window order, as the stock forward computes them."""
        if not hasattr(self, "_cos_sin"):
            rotary = Qwen2_5_VLVisionRotaryEmbedding(self.encoder.config).to(hidden.device)
            pre, seq = self._pre, hidden.shape[0]
            cos_sin = rotary(hidden, pre["position_ids"].to(hidden.device))
            index = pre["window_index"].to(hidden.device)
            self._cos_sin = tuple(self.encoder.permute_input_for_window_attn(f, index, seq) for f in cos_sin)
        return self._cos_sin  # type: ignore[return-value]

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """The merged features ``[features, out_hidden_size]`` (``pooler_output``, image order) when the merger
        ran, else the last block's ``[patches, hidden]`` in window order."""
        return out.pooler_output if owns_post_norm else out.last_hidden_state

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block number ``index`` on window-ordered ``hidden`` ``[patches, hidden]``."""
        full = index in self.encoder.config.fullatt_block_indexes
        pre = self._pre
        cu = (pre["cu_seqlens"] if full else pre["cu_window_seqlens"]).to(hidden.device)
        longest = pre["max_seqlen"] if full else pre["max_window_seqlen"]
        return layer(hidden, cu_seqlens=cu, max_seqlen=longest, position_embeddings=self._rope(hidden))

    def post_norm(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The merger on window-ordered ``hidden``, its output back in image order ``[features, out_hidden]``."""
        return module(hidden)[torch.argsort(self._pre["window_index"].to(hidden.device))]


@dataclass(frozen=True)
class TemporalPatches:
    """Qwen2.5-VL's video encoding (``plait.data.video.VideoEncoding``): a video is ONE item of the image branch
    whose temporal patches join ``temporal_patch_size`` consecutive sampled frames (the last frame repeated to fill
    the final patch, as Qwen2-VL's video processor pads), grid ``(ceil(frames / T), h, w)``: ``t h w / 4``
    features instead of ``frames h w / 4`` per-frame ones.

    Each frame goes through the branch's image processor (same resize, normalisation and block-major patch order),
    whose rows are ``[h w, C, T, p, p]`` with the frame in every temporal slot; temporal patch ``g`` takes slot
    ``j`` from frame ``g T + j``, the row layout of ``Qwen2VLVideoProcessor`` (which needs torchvision).

    :meth:`timing` gives, from the rate the frames were sampled at (``fps``) and the tower's ``tokens_per_second``,
    what the item also carries of transformers' ``Qwen2_5_VLProcessor``'s video inputs for its M-RoPE positions:
    ``second_per_grid_t``
    (seconds of video per temporal patch, ``T / fps``, its ``second_per_grid_ts``) and ``tokens_per_second`` (the
    tower config's temporal position step per second); :mod:`plait.data.mrope` then positions the item as a video
    (temporal patches ``tokens_per_second x second_per_grid_t`` positions apart), not as an image. The tower's value
    travels with the item because the collator, which computes positions, does not know the tower.

    Attributes:
        temporal_patch_size: the tower's ``T`` (frames per temporal patch).
        tokens_per_second: the tower config's ``tokens_per_second``; None leaves the timing out (positioned as an
            image of ``t`` temporal patches). Not part of equality: it does not change the patches.
    """

    temporal_patch_size: int
    tokens_per_second: float | None = field(default=None, compare=False)

    def items(self, hf_processor: Any, frames: list[Any]) -> list[tuple[dict[str, Any], tuple[int, int, int]]]:
        """``[(item, (t, h, w))]``: the video's patches ``[t h w, C T p p]`` and grid.

        Raises:
            ValueError: for no frame, or frames whose processed grids differ.
        """
        if not frames:
            raise ValueError("video has no frame")
        outs = [hf_processor(images=[frame], return_tensors="pt") for frame in frames]
        grids = {tuple(int(g) for g in out["image_grid_thw"][0]) for out in outs}
        if len(grids) != 1:
            raise ValueError(f"video frames give different patch grids {sorted(grids)}")
        (_, h, w), = grids
        size = self.temporal_patch_size
        steps = -(-len(outs) // size)
        pixels = [o["pixel_values"] for o in outs] + [outs[-1]["pixel_values"]] * (steps * size - len(outs))
        area = int(hf_processor.patch_size) ** 2
        rows = [p.reshape(h * w, -1, size, area) for p in pixels]  # [hw, C, T, p*p]
        patches = [torch.stack([rows[g * size + j][:, :, j] for j in range(size)], dim=2).reshape(h * w, -1)
                   for g in range(steps)]
        grid = torch.tensor([steps, h, w])
        return [({"pixel_values": torch.cat(patches), "image_grid_thw": grid}, (steps, h, w))]

    def timing(self, fps: float) -> dict[str, float]:
        """``{"second_per_grid_t": T / fps, "tokens_per_second": ...}`` for frames sampled at ``fps`` frames per second
        of video (``Qwen2_5_VLProcessor``'s ``second_per_grid_ts``); empty without ``tokens_per_second``.

        Raises:
            ValueError: for ``fps`` not above 0.
        """
        if not fps > 0:
            raise ValueError(f"video sampled at {fps} frames per second")
        if self.tokens_per_second is None:
            return {}
        return {"second_per_grid_t": self.temporal_patch_size / float(fps),
                "tokens_per_second": float(self.tokens_per_second)}

    def sizes(self, frames: int, frame_size: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """The one item's grid from the frame count and one processed frame's size ``(1, h, w)`` or ``(h, w)``."""
        h, w = (int(d) for d in frame_size[-2:])
        return [(-(-int(frames) // self.temporal_patch_size), h, w)]


def max_patches(config: Any) -> int:
    """Patches of a :data:`MAX_PIXELS` image for the tower's ``patch_size``."""
    return MAX_PIXELS // int(config.patch_size) ** 2


def feature_count(config: Any) -> Qwen25VLFeatureCount:
    """The tower's feature-count function (shared by the processor and the encoder)."""
    return Qwen25VLFeatureCount(int(config.spatial_merge_size), max_patches(config))



MROPE_TEXT_TYPES = ("qwen2_5_vl_text", "qwen3_vl_text", "qwen2_5_omni_text", "qwen3_vl_moe_text",
                    "qwen3_omni_moe_text")
"""Text-model ``model_type`` values whose LLM rotates with M-RoPE positions ``[3, B, N]`` (Qwen2.5-VL's; Qwen3-VL's,
whose interleaved M-RoPE takes the same positions: an image's are the same, ``plait.models.families.qwen3_vl``)."""


def takes_mrope(config: Any) -> bool:
    """Whether an LLM of ``config`` rotates with M-RoPE positions (``Batch.rope_position_ids``)."""
    return getattr(config, "model_type", None) in MROPE_TEXT_TYPES


@register_causal_lm
class Qwen25VLTextForCausalLM(TextStackCausalLM, Qwen2ForCausalLM):
    """Qwen2.5-VL's LLM as a causal LM: ``Qwen2ForCausalLM`` (``lm_head``, forward, generation) whose decoder stack
    ``model`` is transformers' ``Qwen2_5_VLTextModel`` (M-RoPE: ``position_ids`` ``[3, B, N]``, or ``[B, N]`` for
    text, which it spreads over the three streams). State-dict names are ``model.*`` and ``lm_head.weight``, the
    ``language_model`` / ``lm_head`` tensors of ``Qwen2_5_VLForConditionalGeneration``.

    Args:
        config: a ``Qwen2_5_VLTextConfig``.
    """

    config_class = Qwen2_5_VLTextConfig
    decoder_stack = Qwen2_5_VLTextModel


class Qwen25VLFamily(VisionFamily):
    """Qwen2.5-VL: every image's patches packed into one call, merged 2x2 by the merger (the pooled output)."""

    name = "Qwen2.5-VL"
    model_types = MODEL_TYPES
    encoder_class = ENCODER_CLASS
    tower_keys = TOWER_KEYS
    # the merger (ln_q + MLP over 2x2 blocks) in the post-norm slot; rotary_pos_emb (a buffer only) rides with
    # patch_embed; the blocks' per-call inputs come from Qwen25VLCall
    layout = EncoderLayout(("patch_embed", "rotary_pos_emb"), "blocks", "merger")
    tower_call = Qwen25VLCall
    pooled_output = True
    image_processor = "Qwen2VLImageProcessorPil"  # dynamic resolution, PIL backend (no torchvision)
    packed = True
    packed_what = "image grids"

    def image_feature_count(self, config: Any, select: str) -> Qwen25VLFeatureCount:
        return feature_count(config)

    def feature_size(self, config: Any, hidden: int, downsample: int) -> int:
        """The merger's output width ``out_hidden_size``."""
        return int(config.out_hidden_size)

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        return qwen2_5_vl_dummy_input(config, dtype, device)

    def check_processor(self, processor: Any, config: Any) -> None:
        check_qwen2_5_vl_processor(processor, config)

    def processor_defaults(self, config: Any, kwargs: dict[str, Any]) -> None:
        """The tower's patch, temporal patch and merge sizes, unless set."""
        kwargs.setdefault("patch_size", int(config.patch_size))
        kwargs.setdefault("temporal_patch_size", int(config.temporal_patch_size))
        kwargs.setdefault("merge_size", int(config.spatial_merge_size))

    def input_check(self, config: Any) -> EncoderInputCheck:
        return EncoderInputCheck("image", int(config.in_channels), patch_values(config))

    def video_encoding(self, config: Any) -> TemporalPatches:
        """Temporal patches of ``temporal_patch_size`` frames, timed by ``tokens_per_second``."""
        return TemporalPatches(int(config.temporal_patch_size), config.tokens_per_second)

    def packed_inputs(self, inputs: dict[str, Any]) -> dict[str, Any] | None:
        return qwen2_5_vl_inputs(inputs["pixel_values"], inputs["image_grid_thw"])

    def packed_features(self, hidden: torch.Tensor, inputs: dict[str, Any], downsample: int
                        ) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """The one call's merged features, already in image order; sizes: the images' ``(t, h, w)`` grids."""
        return hidden, [tuple(int(g) for g in grid) for grid in inputs["image_grid_thw"]]

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """A bias-free Conv3d patch embedding over ``T x p x p`` (``patch = (T p, p)``), rotary positions (no table),
        RMSNorms, gated MLP with biases, window attention outside ``fullatt_block_indexes``, the 2x2 merger as
        post-norm (``output_pool = merge^2``). It has no native size: an item is one window."""
        hidden, heads = positive_field(config, "hidden_size"), positive_field(config, "num_heads")
        patch, merge = positive_field(config, "patch_size"), positive_field(config, "spatial_merge_size")
        window = (positive_field(config, "window_size") // patch) ** 2
        return dict(
            modality="vision", hidden=hidden, layers=positive_field(config, "depth"), heads=heads,
            head_dim=hidden // heads, intermediate=positive_field(config, "intermediate_size"), gated_mlp=True,
            norm_bias=False, num_channels=positive_field(config, "in_channels", 3),
            patch=(positive_field(config, "temporal_patch_size") * patch, patch), patch_bias=False,
            output_pool=merge**2, item_len=window, window=window,
            merger=(merge**2 * hidden, positive_field(config, "out_hidden_size")),
            full_layers=tuple(int(i) for i in config_field(config, "fullatt_block_indexes", ())))


FAMILY = Qwen25VLFamily()
