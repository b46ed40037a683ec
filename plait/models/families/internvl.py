"""InternVL's vision tower (transformers' ``InternVLVisionModel``): dynamic tiling and pixel-shuffle downsampling.

The image processor (transformers' ``GotOcr2ImageProcessorPil`` with ``crop_to_patches=True``, what InternVL's
processor uses, no torchvision) cuts an image into ``cols x rows`` tiles of ``S x S`` pixels (the grid whose aspect
ratio is closest to the image's, ``min_patches <= cols * rows <= max_patches``) plus a thumbnail of the whole image
when there is more than one tile: one item ``pixel_values [t, C, S, S]`` per image (``data.processing.process_image``,
``size = (t, S, S)``). The tower encodes every tile as a fixed-size ViT image (CLS + ``g x g`` patches, ``g = S /
patch``); all tiles of a microbatch's images have one shape, so they are one encoder call.

Between the tower and the projector ``InternVLModel.get_image_features`` drops the CLS token, reshapes each tile's
patches to ``[g, g, D]`` and applies ``InternVLModel.pixel_shuffle`` with ``scale_factor = downsample_ratio``
(0.5): ``[g/2, g/2, 4 D]``, i.e. ``(g / 2)^2`` features of ``4 D`` values per tile. plait's ``downsample`` of an
InternVL branch is ``1 / downsample_ratio`` (2 for InternVL) and :func:`pixel_shuffle_features` calls transformers'
own ``pixel_shuffle`` (it reads nothing of its model instance, so it is called on the class), so the features equal
the stock model's projector input.

A full InternVL checkpoint (``model_type = "internvl"``, e.g. ``InternVL3-1B-hf``) gives its vision tower (its
``downsample_ratio`` 0.5 is plait's ``downsample = 2``); its saved image processor is the tiling one, used with
``crop_to_patches`` on as InternVL's processor calls it.

With ``use_mean_pooling`` (every InternVL checkpoint) the tower's ``layernorm`` is an ``nn.Identity``: the branch has
no post-norm unit. Its layers take the hidden states only (no mask, no positions), so a pipeline stage may start at
any layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.internvl.modeling_internvl import InternVLModel

from plait.models.families.base import EncoderInputCheck, EncoderLayout, VisionFamily, config_field

__all__ = ["FAMILY", "MODEL_TYPES", "TOWER_KEYS", "LAYER_CLASS", "InternVLFeatureCount", "internvl_inputs",
           "internvl_dummy_input", "pixel_shuffle_features", "has_post_norm", "tile_size", "check_internvl_processor",
           "check_internvl_select"]

# config model_type -> where the vision config lives (None: the config itself; "vision_config": a full model's)
MODEL_TYPES = {"internvl_vision": None, "internvl": "vision_config"}
TOWER_KEYS = {r"^(model\.)?vision_tower\.": ""}
"""Key mapping of a full InternVL checkpoint (``InternVLForConditionalGeneration``: ``model.vision_tower.*``) onto
the tower's own names, for ``from_pretrained(..., key_mapping=...)``."""
LAYER_CLASS = "InternVLVisionLayer"


def tile_size(config: Any) -> int:
    """The tower's square tile side in pixels (``image_size``, an int or an ``(H, W)`` pair of equal sides).

    Raises:
        ValueError: for a non-square ``image_size``.
    """
    size = config.image_size
    h, w = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if h != w:
        raise ValueError(f"InternVL tower image_size {h}x{w} is not square (tiles are square)")
    return int(h)


def has_post_norm(config: Any) -> bool:
    """False with ``use_mean_pooling`` (the tower's ``layernorm`` is an ``nn.Identity``, no unit)."""
    return not bool(getattr(config, "use_mean_pooling", True))


@dataclass(frozen=True)
class InternVLFeatureCount:
    """Features of one image of ``size = (t, S, S)``: ``t`` tiles of ``S x S`` pixels (thumbnail included), each
    giving ``(g / downsample)^2`` features after the pixel shuffle (``g = S // patch_size``; CLS dropped), or
    ``g^2 + 1`` with ``downsample = 1`` and the CLS kept (``select = "full"``).

    Attributes:
        patch_size: the tower's patch side in pixels.
        tile: the tower's ``image_size`` (tile side in pixels); a processor giving other tiles is refused.
        downsample: ``1 / downsample_ratio`` of InternVL's pixel shuffle (2), 1 for none.
        cls_tokens: 1 when the CLS position is kept (``select = "full"``, only without pixel shuffle).
    """

    patch_size: int
    tile: int
    downsample: int
    cls_tokens: int

    def __post_init__(self) -> None:
        grid = self.tile // self.patch_size
        if self.downsample < 1 or self.downsample & (self.downsample - 1):
            raise ValueError(f"downsample = {self.downsample}: InternVL's pixel shuffle takes a power of two (2)")
        if grid % self.downsample:
            raise ValueError(f"downsample = {self.downsample} does not divide the tower's {grid}x{grid} patch grid")
        if self.downsample > 1 and self.cls_tokens:
            raise ValueError("the pixel shuffle (downsample > 1) needs select = 'drop_cls' (InternVL drops the CLS)")

    @property
    def per_tile(self) -> int:
        """Features of one tile."""
        return (self.tile // self.patch_size // self.downsample) ** 2 + self.cls_tokens

    def __call__(self, size: tuple[int, int, int]) -> int:
        """Features (tokens) of an image of ``size = (tiles, S, S)``.

        Raises:
            ValueError: for no tile, a size without a tile count, or tiles of another size than the tower's.
        """
        if len(size) != 3:
            raise ValueError(f"image size {tuple(size)} has no tile count: the InternVL tower needs its tiling "
                             "processor (GotOcr2ImageProcessorPil with crop_to_patches)")
        tiles, h, w = (int(s) for s in size)
        if tiles < 1:
            raise ValueError("image has no tile")
        if (h, w) != (self.tile, self.tile):
            raise ValueError(f"the image processor gives {h}x{w} tiles, the InternVL tower expects {self.tile}x"
                             f"{self.tile} (its image_size: set the processor's size)")
        return tiles * self.per_tile


def internvl_inputs(pixel_values: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stock-forward kwargs of a microbatch's images (items ``[t_i, C, S, S]``): every tile, in item order,
    ``pixel_values [sum t_i, C, S, S]``."""
    return {"pixel_values": torch.cat(list(pixel_values))}


def internvl_dummy_input(config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
    """A one-tile input at the tower's tile size, zeros in ``dtype`` on ``device``."""
    side = tile_size(config)
    return {"pixel_values": torch.zeros(1, int(config.num_channels), side, side, dtype=dtype, device=device)}


def pixel_shuffle_features(hidden: torch.Tensor, downsample: int) -> torch.Tensor:
    """``hidden [tiles, g * g, D]`` (CLS dropped) -> ``[tiles * (g / d)^2, D d^2]`` with transformers'
    ``InternVLModel.pixel_shuffle`` (``scale_factor = 1 / d``), tile by tile in order, as
    ``InternVLModel.get_image_features`` reshapes around it. ``d = 1`` returns the rows unchanged."""
    tiles, positions, dim = hidden.shape
    if downsample == 1:
        return hidden.reshape(tiles * positions, dim)
    grid = int(round(positions ** 0.5))
    square = hidden.reshape(tiles, grid, grid, dim)
    shuffled = InternVLModel.pixel_shuffle(None, square, scale_factor=1 / downsample)  # reads nothing of self
    return shuffled.reshape(-1, shuffled.shape[-1])


def check_internvl_processor(processor: Any, config: Any) -> None:
    """Refuse an image processor whose tiles are not the tower's ``image_size``, before any sample is read.

    Raises:
        ValueError: naming ``processor.size``.
    """
    size = getattr(processor, "size", None)
    h = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
    w = size.get("width") if isinstance(size, dict) else getattr(size, "width", None)
    side = tile_size(config)
    if h is not None and (int(h), int(w)) != (side, side):
        raise ValueError(f"processor.size = {h}x{w} but the InternVL tower's tiles are {side}x{side} pixels "
                         "(its image_size)")


def check_internvl_select(select: str) -> None:
    """Refuse ``select = "full"`` for an InternVL branch: transformers' InternVL feeds its projector the patches
    without the CLS token only (``vision_feature_select_strategy = "default"``; with ``"full"``
    ``InternVLModel.get_image_features`` fails reshaping ``g^2 + 1`` positions to a ``g x g`` grid), so no
    InternVL checkpoint has features with the CLS. ``downsample = 1`` (``downsample_ratio = 1``: the pixel shuffle
    leaves the patches as they are) is kept: its features equal ``get_image_features``'.

    Raises:
        ValueError: naming the field ``select``.
    """
    if select != "drop_cls":
        raise ValueError(f"select = {select!r}: an InternVL branch takes select = 'drop_cls' (transformers' InternVL "
                         "feeds its projector the patches without the CLS token; its 'full' strategy fails)")


_IMAGENET_MEAN, _IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # InternVL's normalisation


class InternVLFamily(VisionFamily):
    """InternVL: every tile of a batch in one call, pixel-shuffled into the projector's features."""

    name = "InternVL"
    model_types = MODEL_TYPES
    encoder_class = "InternVLVisionModel"
    tower_keys = TOWER_KEYS
    has_cls = True
    layout = EncoderLayout(("embeddings",), "encoder.layer", "layernorm")
    # no tensor-parallel plan: its attention reshapes its output to the full embed_dim, which a rank holding some
    # heads does not have
    layer_class = LAYER_CLASS
    layer_hidden_only = True
    pixel_shuffle = True
    image_processor = "GotOcr2ImageProcessorPil"  # InternVL's dynamic tiling (crop_to_patches), PIL backend
    folder_processor_args = {"crop_to_patches": True}  # InternVL's processor tiles on every call
    packed = True

    def layout_of(self, config: Any) -> EncoderLayout:
        """Without post-norm unit with ``use_mean_pooling`` (its ``layernorm`` is an ``nn.Identity``)."""
        layout = self.layout
        return layout if has_post_norm(config) else EncoderLayout(layout.embed, layout.layers, None, layout.heads)

    def check_select(self, select: str) -> None:
        check_internvl_select(select)

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> InternVLFeatureCount:
        """Tiles of ``(g / downsample)^2`` features: ``downsample`` is the pixel-shuffle factor."""
        cfg = encoder.config
        self.check_drop_cls(cfg, select)
        return InternVLFeatureCount(_side(cfg.patch_size), tile_size(cfg), int(downsample), int(select == "full"))

    def feature_size(self, config: Any, hidden: int, downsample: int) -> int:
        """The pixel shuffle stacks ``downsample x downsample`` neighbouring patches into one feature."""
        return hidden * int(downsample) ** 2

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        return internvl_dummy_input(config, dtype, device)

    def check_processor(self, processor: Any, config: Any) -> None:
        check_internvl_processor(processor, config)

    def processor_defaults(self, config: Any, kwargs: dict[str, Any]) -> None:
        """InternVL's processor: tiles of the tower's image_size + thumbnail, ImageNet normalisation."""
        side = int(tile_size(config))
        kwargs.setdefault("crop_to_patches", True)
        kwargs.setdefault("size", {"height": side, "width": side})
        kwargs.setdefault("image_mean", _IMAGENET_MEAN)
        kwargs.setdefault("image_std", _IMAGENET_STD)

    def input_check(self, config: Any) -> EncoderInputCheck:
        return EncoderInputCheck("image", int(config.num_channels), tile=tile_size(config))

    def packed_inputs(self, inputs: dict[str, Any]) -> dict[str, Any] | None:
        return internvl_inputs(inputs["pixel_values"]) if len(inputs["pixel_values"]) else None

    def packed_features(self, hidden: torch.Tensor, inputs: dict[str, Any], downsample: int
                        ) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """The tiles' ``[tiles, positions, D]`` through the pixel shuffle; sizes ``(t, S, S)``."""
        sizes = [(int(p.shape[0]), int(p.shape[-2]), int(p.shape[-1])) for p in inputs["pixel_values"]]
        return pixel_shuffle_features(hidden, downsample), sizes

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """Layer scale, optional q/k norms and biases, RMS or LayerNorm, mean pooling instead of a post-norm."""
        hidden = int(config_field(config, "hidden_size"))
        bias = bool(config_field(config, "attention_bias", False))
        fields = {**super().arch_fields(config), "qkv_bias": (bias, bias, bias), "layer_scale": True,
                  "norm_bias": config_field(config, "norm_type", "layer_norm") == "layer_norm",
                  "qk_norm_dim": hidden if config_field(config, "use_qk_norm", False) else 0,
                  "post_norm": not config_field(config, "use_mean_pooling", True)}
        if not config_field(config, "use_absolute_position_embeddings", True):
            fields["positions"] = 0
        return fields


def _side(value: Any) -> int:
    """A square size (an int, or an ``(H, W)`` pair of equal sides, as InternVL's config stores it) as an int.

    Raises:
        ValueError: for a non-square pair.
    """
    if isinstance(value, int):
        return value
    h, w = (int(v) for v in value)
    if h != w:
        raise ValueError(f"size {h}x{w} is not square")
    return h


FAMILY = InternVLFamily()
