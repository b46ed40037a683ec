"""Pixtral's vision tower (transformers' ``PixtralVisionModel``): native resolution, 2D RoPE, several images of
different sizes packed into one patch sequence.

The image processor (``PixtralImageProcessorPil``, no torchvision) resizes each image, keeping its aspect ratio, so
that its longest side is at most ``size["longest_edge"]`` pixels and both sides are multiples of the patch size:
one ``pixel_values [C, H, W]`` per image. The stock forward takes a padded batch ``[n, C, H_max, W_max]`` with each
image's ``image_sizes (H, W)``, keeps each image's ``(H / p) x (W / p)`` patches, packs all of them into ONE
sequence ``[1, P, D]`` (P = the images' patches together), gives every patch its 2D rotary position (row, column
in its image) and attends with a block-diagonal mask (transformers' ``generate_block_attention_mask``: a patch sees
the patches of its own image only). plait calls that forward as it is: a microbatch's images are one group, and its
output rows are the images' features in item order.

The tower has no final norm (``post_norm`` None in its pipeline layout) and no CLS token. Its layers need per-call
inputs (cos/sin of the 2D RoPE, the block mask, or ``cu_seq_lens`` under flash attention) that its own forward
computes from the image sizes: a pipeline stage that starts inside its layers recomputes them from the same sizes
(:class:`PixtralCall`, the :mod:`plait.models.tower_call` hook) with transformers' own
``PixtralVisionRotaryEmbedding`` and ``generate_block_attention_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.pixtral.modeling_pixtral import PixtralVisionRotaryEmbedding, generate_block_attention_mask
from transformers.utils.generic import is_flash_attention_requested

from plait.models.families.base import EncoderLayout, VisionFamily, positive_field

__all__ = ["FAMILY", "MODEL_TYPES", "LAYER_CLASS", "PixtralFeatureCount", "PixtralCall", "pixtral_inputs",
           "pixtral_dummy_input", "check_pixtral_processor"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"pixtral": None}
LAYER_CLASS = "PixtralAttentionLayer"


@dataclass(frozen=True)
class PixtralFeatureCount:
    """Features of one image of ``size = (H, W)`` pixels: its ``(H // patch) * (W // patch)`` patches.

    Attributes:
        patch_size: the tower's ``patch_size`` in pixels.
        max_side: the tower's ``image_size``: the longest side in pixels it is trained for (``image_size / patch``
            patches per side); a larger image is refused (lower the processor's ``size.longest_edge``).
    """

    patch_size: int
    max_side: int

    @property
    def max_patches(self) -> int:
        """Most patches of one image: ``(image_size // patch_size) ** 2``."""
        return (self.max_side // self.patch_size) ** 2

    def __call__(self, size: tuple[int, int]) -> int:
        """Features (tokens) of an image of ``size = (H, W)`` pixels.

        Raises:
            ValueError: when the image is smaller than one patch or a side is longer than ``max_side``.
        """
        h, w = int(size[0]), int(size[1])
        if h < self.patch_size or w < self.patch_size:
            raise ValueError(f"image of {h}x{w} pixels is smaller than one {self.patch_size}-pixel patch")
        if max(h, w) > self.max_side:
            raise ValueError(
                f"image of {h}x{w} pixels = {(h // self.patch_size) * (w // self.patch_size)} patches is larger than "
                f"the Pixtral tower's maximum of {self.max_side} pixels per side ({self.max_side // self.patch_size} "
                f"patches; lower the processor's size.longest_edge)")
        return (h // self.patch_size) * (w // self.patch_size)


def pixtral_inputs(pixel_values: list[torch.Tensor]) -> dict[str, Any]:
    """Stock-forward kwargs packing images ``[C, H_i, W_i]`` into one call: ``pixel_values [n, C, H_max, W_max]``
    (zero padded at the bottom and right, as the processor pads a batch) and ``image_sizes``, a list of ``(H_i, W_i)``
    (Python ints: the forward slices each image's patches with them, also on the meta device)."""
    height = max(int(p.shape[-2]) for p in pixel_values)
    width = max(int(p.shape[-1]) for p in pixel_values)
    padded = torch.stack([F.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pixel_values])
    return {"pixel_values": padded, "image_sizes": [(int(p.shape[-2]), int(p.shape[-1])) for p in pixel_values]}


def pixtral_dummy_input(config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
    """A one-image input of two by two patches, zeros in ``dtype`` on ``device`` (the unreachable-parameter probe)."""
    side = 2 * int(config.patch_size)
    return pixtral_inputs([torch.zeros(int(config.num_channels), side, side, dtype=dtype, device=device)])


def check_pixtral_processor(processor: Any, config: Any) -> None:
    """Refuse a ``PixtralImageProcessor`` that does not fit the tower ``config``, before any sample is read.

    Raises:
        ValueError: naming the processor field: ``patch_size`` other than the tower's, or ``size.longest_edge``
            above the tower's ``image_size``.
    """
    patch = getattr(processor, "patch_size", None)
    patch = patch.get("height") if isinstance(patch, dict) else getattr(patch, "height", patch)
    if patch is not None and int(patch) != int(config.patch_size):
        raise ValueError(f"processor.patch_size = {patch} but the Pixtral tower's patch_size is {config.patch_size}")
    size = getattr(processor, "size", None)
    edge = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    if edge is not None and int(edge) > int(config.image_size):
        raise ValueError(f"processor.size.longest_edge = {edge} is above the Pixtral tower's image_size = "
                         f"{config.image_size} pixels (its largest image side)")


class PixtralCall:
    """Per-call inputs of one Pixtral tower call (the :class:`plait.models.tower_call.TowerCall` interface), from
    its ``image_sizes`` only: each patch's 2D position (row, column in its image, images packed in order) through a
    fresh ``PixtralVisionRotaryEmbedding`` (a parameter-free module built from the config, since a later stage's
    own may be on the meta device) and the block-diagonal mask of ``generate_block_attention_mask`` (or, under
    flash attention, the images' ``cu_seq_lens`` as the stock forward passes them). Hidden states between stages
    are the packed ``[1, P, hidden]``.

    Args:
        encoder: the tower (possibly a pipeline rank's pruned one).
        kwargs: one call's stock-forward kwargs (:func:`pixtral_inputs`).
    """

    def __init__(self, encoder: nn.Module, kwargs: dict[str, Any]) -> None:
        self.config = encoder.config
        patch = int(self.config.patch_size)
        self.grids = [(int(h) // patch, int(w) // patch) for h, w in kwargs["image_sizes"]]
        self._inputs: dict[tuple[torch.dtype, torch.device], dict[str, Any]] = {}

    def _positions(self, device: torch.device) -> torch.Tensor:
        """``[P, 2]`` (row, column) of every patch, images in order (the stock forward's ``position_ids``)."""
        grids = [torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                            indexing="ij"), dim=-1).reshape(-1, 2) for h, w in self.grids]
        return torch.cat(grids)

    def _layer_kwargs(self, hidden: torch.Tensor) -> dict[str, Any]:
        """``attention_mask``, ``position_embeddings`` (and flash attention's sequence bounds) for ``hidden``'s
        dtype and device, computed once per call."""
        key = (hidden.dtype, hidden.device)
        if key not in self._inputs:
            rotary = PixtralVisionRotaryEmbedding(self.config).to(hidden.device)
            out: dict[str, Any] = {"position_embeddings": rotary(hidden, self._positions(hidden.device))}
            lengths = [h * w for h, w in self.grids]
            if is_flash_attention_requested(self.config):
                cu = torch.tensor([0, *lengths], device=hidden.device).cumsum(0, dtype=torch.int32)
                out.update(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                           max_length_k=max(lengths))
            else:
                out["attention_mask"] = generate_block_attention_mask(lengths, hidden)
            self._inputs[key] = out
        return self._inputs[key]

    def stock_output(self, out: Any, owns_post_norm: bool) -> torch.Tensor:
        """The packed ``last_hidden_state`` ``[1, P, hidden]``."""
        return out.last_hidden_state

    def layer(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """``PixtralAttentionLayer`` number ``index`` on the packed ``hidden`` ``[1, P, hidden]``."""
        kwargs = dict(self._layer_kwargs(hidden))
        return layer(hidden, kwargs.pop("attention_mask"), **kwargs)

    def post_norm(self, module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The tower has no post-norm unit; a module here is applied as it is."""
        return module(hidden)


class PixtralFamily(VisionFamily):
    """Pixtral: every image of a batch packed into one call; per-call layer inputs (:class:`PixtralCall`)."""

    name = "Pixtral"
    model_types = MODEL_TYPES
    encoder_class = "PixtralVisionModel"
    # no final norm; patch_positional_embedding (2D RoPE, buffers only) rides with the embedding (a later stage
    # rebuilds its rotary table: PixtralCall)
    layout = EncoderLayout(("patch_conv", "ln_pre", "patch_positional_embedding"), "transformer.layers",
                           None)
    # heads split with their 2D RoPE (the same per-head rotation on every head); gated MLP
    tp_plan = {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
               "attention.o_proj": "rowwise", "feed_forward.gate_proj": "colwise", "feed_forward.up_proj": "colwise",
               "feed_forward.down_proj": "rowwise"}
    tower_call = PixtralCall
    layer_class = LAYER_CLASS
    layer_refusal = ("a Pixtral layer needs its call's 2D rotary positions and block mask: run it through "
                     "plait.models.tower_call (families.pixtral.PixtralCall.layer)")
    image_processor = "PixtralImageProcessorPil"  # native resolution, PIL backend
    packed = True

    def image_feature_count(self, config: Any, select: str) -> PixtralFeatureCount:
        return PixtralFeatureCount(int(config.patch_size), int(config.image_size))

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        return pixtral_dummy_input(config, dtype, device)

    def check_processor(self, processor: Any, config: Any) -> None:
        check_pixtral_processor(processor, config)

    def processor_defaults(self, config: Any, kwargs: dict[str, Any]) -> None:
        """The tower's patch and largest side, unless configured."""
        kwargs.setdefault("patch_size", int(config.patch_size))
        kwargs.setdefault("size", {"longest_edge": int(config.image_size)})

    def packed_inputs(self, inputs: dict[str, Any]) -> dict[str, Any] | None:
        return pixtral_inputs(inputs["pixel_values"]) if len(inputs["pixel_values"]) else None

    def packed_features(self, hidden: torch.Tensor, inputs: dict[str, Any], downsample: int
                        ) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """The packed ``[1, P, D]`` rows as they are; sizes ``(H, W)``."""
        sizes = [(int(p.shape[-2]), int(p.shape[-1])) for p in inputs["pixel_values"]]
        return hidden.reshape(-1, hidden.shape[-1]), sizes

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """2D RoPE (no position table), RMSNorms, gated MLP, no bias, no CLS, no post-norm."""
        patches = (positive_field(config, "image_size") // positive_field(config, "patch_size")) ** 2
        return {**super().arch_fields(config), "gated_mlp": True, "qkv_bias": (False, False, False),
                "o_bias": False, "mlp_bias": False, "norm_bias": False, "patch_bias": False, "pre_norm": True,
                "post_norm": False, "prefix_tokens": 0, "item_len": patches, "positions": 0}


FAMILY = PixtralFamily()
