"""SigLIP2 NaFlex vision tower (transformers' ``Siglip2VisionModel``): variable resolution, one patch sequence per
image.

The image processor (``Siglip2ImageProcessorPil``) resizes each image, keeping its aspect ratio, to at most
``max_num_patches`` patches and patchifies it: ``pixel_values [max_num_patches, C * p * p]`` (padded),
``spatial_shapes (h, w)`` in patches and a padding mask. The tower resizes its ``num_patches`` position grid to
``(h, w)`` per image. plait keeps only the ``h * w`` real patches of an image and encodes images of equal
``(h, w)`` together (no padding, so the stock forward gets ``pixel_attention_mask=None`` and layers run
without mask in later pipeline stages too); the features equal the stock tower's on the padded batch at the real
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plait.models.families.base import (ATTN_MLP_PLAN, EncoderInputCheck, EncoderLayout, VisionFamily,
                                        positive_field, vision_arch_fields)

__all__ = ["FAMILY", "MODEL_TYPES", "Siglip2FeatureCount",
           "siglip2_inputs", "siglip2_dummy_input", "check_siglip2_processor"]

# config model_type -> where the vision config lives (None: the config itself)
MODEL_TYPES = {"siglip2_vision_model": None, "siglip2": "vision_config"}


@dataclass(frozen=True)
class Siglip2FeatureCount:
    """Features of one image: its ``h * w`` patches (``size = (h, w)``, the processor's ``spatial_shapes``).

    Attributes:
        max_patches: the tower's ``num_patches`` (its position grid); the processor's ``max_num_patches`` must not
            exceed it (an image with more patches is refused).
    """

    max_patches: int

    def __call__(self, size: tuple[int, int]) -> int:
        """Features (tokens) of an image of ``size = (h, w)`` patches.

        Raises:
            ValueError: when the image has no patch or more than ``max_patches``.
        """
        h, w = int(size[0]), int(size[1])
        if h < 1 or w < 1:
            raise ValueError(f"image of {h}x{w} patches has no patch")
        if h * w > self.max_patches:
            raise ValueError(f"image of {h}x{w} = {h * w} patches is larger than the SigLIP2 tower's maximum of "
                             f"{self.max_patches} patches (lower the processor's max_num_patches)")
        return h * w


def siglip2_inputs(pixel_values: list[torch.Tensor], spatial_shapes: list[torch.Tensor]) -> dict[str, Any]:
    """Stock-forward kwargs for images of one ``(h, w)``: ``pixel_values [n, h*w, C*p*p]``, ``spatial_shapes [n, 2]``
    and ``pixel_attention_mask=None`` (no padding: every position attends to every other, as the all-ones mask)."""
    pixels = torch.stack(pixel_values)
    shapes = torch.stack([torch.as_tensor(s, dtype=torch.long) for s in spatial_shapes]).to(pixels.device)
    return {"pixel_values": pixels, "spatial_shapes": shapes, "pixel_attention_mask": None}


def siglip2_dummy_input(config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
    """A one-image input at the native grid (``sqrt(num_patches)`` squared), zeros in ``dtype``. On the meta device
    ``spatial_shapes`` stays on the CPU: the stock forward checks its values (``.item()``) and builds the position
    resize weights from it, then moves them to the table's device."""
    side = int(round(int(config.num_patches) ** 0.5))
    width = int(config.num_channels) * int(config.patch_size) ** 2
    pixels = torch.zeros(1, side * side, width, dtype=dtype, device=device)
    shapes_device = "cpu" if torch.device(device or "cpu").type == "meta" else device
    return {"pixel_values": pixels, "spatial_shapes": torch.tensor([[side, side]], device=shapes_device),
            "pixel_attention_mask": None}


def check_siglip2_processor(processor: Any, config: Any) -> None:
    """Refuse a NaFlex image processor that would give images larger than the tower ``config``'s position grid,
    when the job is built (rather than per record in the metadata pass).

    Raises:
        ValueError: naming ``processor.max_num_patches`` when it is above the tower's ``num_patches``.
    """
    limit = getattr(processor, "max_num_patches", None)
    if limit is not None and int(limit) > int(config.num_patches):
        raise ValueError(f"processor.max_num_patches = {limit} is above the SigLIP2 tower's num_patches = "
                         f"{config.num_patches} (its position grid): images of more patches than that cannot be "
                         "encoded; lower it or leave it out (the default is the tower's)")


class Siglip2Family(VisionFamily):
    """SigLIP2 NaFlex: images of one patch grid encoded together; the pooling head is skipped (``use_head``)."""

    name = "SigLIP2"
    model_types = MODEL_TYPES
    encoder_class = "Siglip2VisionModel"
    layout = EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",))
    tp_plan = ATTN_MLP_PLAN
    image_processor = "Siglip2ImageProcessorPil"  # NaFlex, PIL backend (no torchvision)

    def image_feature_count(self, config: Any, select: str) -> Siglip2FeatureCount:
        return Siglip2FeatureCount(int(config.num_patches))

    def prepare_tower(self, encoder: Any) -> None:
        """Its forward calls its pooling head with two arguments, which a pipeline stage's ``nn.Identity`` stand-in
        cannot take; plait never reads the pooled output, so the forward skips it (the weights stay, frozen)."""
        encoder.use_head = False

    def group_inputs(self, config: Any, images: list[torch.Tensor], sizes: list[Any]) -> dict[str, Any]:
        """Images of one patch grid ``(h, w)`` (``sizes``: their ``spatial_shapes``) in one call."""
        return siglip2_inputs(images, sizes)

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        return siglip2_dummy_input(config, dtype, device)

    def check_processor(self, processor: Any, config: Any) -> None:
        check_siglip2_processor(processor, config)

    def processor_defaults(self, config: Any, kwargs: dict[str, Any]) -> None:
        """The tower's patch and position grid, unless configured."""
        kwargs.setdefault("patch_size", int(config.patch_size))
        kwargs.setdefault("max_num_patches", int(config.num_patches))

    def input_check(self, config: Any) -> EncoderInputCheck:
        channels = int(config.num_channels)
        return EncoderInputCheck("image", channels, channels * int(config.patch_size) ** 2)

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """NaFlex: no image size, a ``num_patches`` position grid resized per image."""
        return {**vision_arch_fields(config, 0, positive_field(config, "num_patches")), "resized_positions": True}


FAMILY = Siglip2Family()
