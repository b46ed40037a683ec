"""SigLIP's vision tower (transformers' ``SiglipVisionModel``): a ViT without CLS token, with a pooling head that
plait never reads (a full SigLIP checkpoint gives its vision tower).

``downsample = d`` average-pools each ``d x d`` block of the patch grid into one feature, as Gemma 3's projector
does before its norm (``Gemma3MultiModalProjector.avg_pool``, kernel and stride ``d``): ``(H / p / d) * (W / p /
d)`` features per image (:class:`PooledFeatureCount`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from plait.models.families.base import ATTN_MLP_LORA, ATTN_MLP_PLAN, EncoderLayout, VisionFamily

__all__ = ["FAMILY", "MODEL_TYPES", "PooledFeatureCount"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"siglip_vision_model": None, "siglip": "vision_config"}


@dataclass(frozen=True)
class PooledFeatureCount:
    """Features of one image when each ``pool x pool`` block of its ``(H / patch) x (W / patch)`` patch grid is
    average-pooled into one: ``(H // patch // pool) * (W // patch // pool)``.

    Attributes:
        patch_size: the tower's patch side in pixels.
        pool: the pooling kernel (and stride) in patches (the branch's ``downsample``).
    """

    patch_size: int
    pool: int

    def grid(self, size: tuple[int, ...]) -> tuple[int, int]:
        """The patch grid ``(rows, cols)`` of an image of ``size = (H, W)`` pixels.

        Raises:
            ValueError: when the image is smaller than one patch or ``pool`` does not divide the grid.
        """
        h, w = int(size[-2]) // self.patch_size, int(size[-1]) // self.patch_size
        if h < 1 or w < 1:
            raise ValueError(f"image of {size[-2]}x{size[-1]} pixels is smaller than one {self.patch_size}-pixel "
                             "patch")
        if h % self.pool or w % self.pool:
            raise ValueError(f"downsample = {self.pool} does not divide the {h}x{w} patch grid of a "
                             f"{size[-2]}x{size[-1]} image")
        return h, w

    def __call__(self, size: tuple[int, ...]) -> int:
        """Features (tokens) of an image of ``size = (H, W)`` pixels.

        Raises:
            ValueError: as :meth:`grid`.
        """
        h, w = self.grid(size)
        return (h // self.pool) * (w // self.pool)


class SiglipFamily(VisionFamily):
    name = "SigLIP"
    model_types = MODEL_TYPES
    encoder_class = "SiglipVisionModel"
    layout = EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",))
    lora_targets = ATTN_MLP_LORA
    tp_plan = ATTN_MLP_PLAN
    image_processor = "SiglipImageProcessor"
    average_pool = True

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Any:
        """``VisionFeatureCount`` (one feature per patch), or with ``downsample > 1`` :class:`PooledFeatureCount`.

        Raises:
            ValueError: for ``select="drop_cls"`` (no CLS token) or ``downsample < 1``.
        """
        if downsample == 1:
            return super().feature_count(encoder, select, 1)
        self.check_drop_cls(encoder.config, select)
        if downsample < 1:
            raise ValueError(f"downsample = {downsample} must be >= 1")
        return PooledFeatureCount(int(encoder.config.patch_size), downsample)

    def pool_features(self, config: Any, hidden: torch.Tensor, size: tuple[int, ...], downsample: int
                      ) -> torch.Tensor:
        """``hidden`` ``[n, (H/p) * (W/p), D]`` of ``n`` images of ``size = (H, W)`` average-pooled over each
        ``downsample x downsample`` block of patches: ``[n, (H/p/d) * (W/p/d), D]`` (row-major, the layout of
        Gemma 3's ``AvgPool2d`` on the ``[n, D, H/p, W/p]`` grid).

        Raises:
            ValueError: as :meth:`PooledFeatureCount.grid`.
        """
        if downsample == 1:
            return hidden
        h, w = PooledFeatureCount(int(config.patch_size), downsample).grid(size)
        grid = hidden.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[2], h, w).contiguous()
        return F.avg_pool2d(grid, kernel_size=downsample, stride=downsample).flatten(2).transpose(1, 2)


FAMILY = SiglipFamily()
