"""A modality encoder branch: Hugging Face encoder + feature selection + pooling + projector."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from plait.data.processing import PerFrame
from plait.models.hf import (
    AudioFeatureCount,
    VisionFeatureCount,
    audio_window,
    dummy_encoder_input,
    encoder_feature_size,
    encoder_hidden_size,
    encoder_layout,
    feature_count_for,
)
from plait.models.families import internvl, pixtral, qwen2_5_vl
from plait.models.families.qwen2_audio import Qwen2AudioFeatureCount, qwen2_audio_attention_mask
from plait.models.families.siglip2 import MODEL_TYPES as SIGLIP2_TYPES, siglip2_inputs
from plait.models.projector import Projector
from plait.models.tower_call import tower_call

__all__ = ["EncoderInputCheck", "ModalityEncoder"]


class ModalityEncoder(nn.Module):
    """One encoder branch of a multimodal model.

    Inputs (one batch of items of this modality, in the order their placeholders appear, row-major):
        image: ``{"pixel_values": list of [C, H_i, W_i]}`` - sizes may differ; items of equal size are
            encoded together (positional embeddings interpolated when the size is not the native one).
        audio: ``{"input_features": [n, mel, T] (the encoder's fixed window), "num_samples": [n]}``.
    Output: ``[total_features, llm_hidden]``, the projected features of all items concatenated, where item
    ``i`` contributes exactly ``self.feature_count(size_i)`` rows (size = ``(H, W)`` or ``num_samples``).

    ``feature_layer`` picks the hidden state (-1 last, -2 second-to-last); parameters that then cannot reach
    the output (later layers, an unused post-norm or pooling head) are found once by a probe backward and
    frozen for good (``unreachable``), so data-parallel training never waits for their gradients. The probe
    runs on the encoder's device: on the meta device (a model built without weights) autograd tracks the
    same graph without computing values, so the flags are the same as with real weights.

    Raises:
        ValueError: on an unknown modality/select, or when the encoder's output does not match the
            feature-count formula.
    """

    def __init__(
        self,
        encoder: PreTrainedModel,
        projector: Projector,
        modality: str,
        feature_layer: int = -1,
        select: str = "full",
        downsample: int = 1,
        hop_length: int = 160,
        sampling_rate: int = 16000,
    ) -> None:
        super().__init__()
        if modality not in ("image", "audio"):
            raise ValueError(f"modality must be 'image' or 'audio', got {modality!r}")
        if select not in ("full", "drop_cls"):
            raise ValueError(f"select must be 'full' or 'drop_cls', got {select!r}")
        if encoder.config.model_type in internvl.MODEL_TYPES:
            internvl.check_internvl_select(select)
        self.encoder = encoder
        self.projector = projector
        self.modality = modality
        layers = len(encoder.get_submodule(encoder_layout(encoder).layers))  # hidden states: embeddings + layers
        if not -(layers + 1) <= feature_layer <= layers:
            raise ValueError(f"feature_layer={feature_layer} is outside this {layers}-layer encoder's hidden states "
                             f"({-(layers + 1)}..{layers})")
        self.feature_layer = feature_layer
        self.select = select
        self.downsample = downsample
        self.feature_count: VisionFeatureCount | AudioFeatureCount | Qwen2AudioFeatureCount = feature_count_for(
            encoder, modality, select, downsample, hop_length, sampling_rate
        )
        if self.pooled_output and feature_layer not in (-1, layers):
            raise ValueError(f"feature_layer={feature_layer}: the {encoder.config.model_type} encoder's features are "
                             "its pooled, normed last hidden state; use feature_layer = -1")
        if encoder.config.model_type == "siglip2_vision_model":
            # its forward calls its pooling head with two arguments, which a pipeline stage's nn.Identity stand-in
            # cannot take; plait never reads the pooled output, so the forward skips it (the weights stay, frozen)
            encoder.use_head = False
        self.unreachable: frozenset[str] = frozenset()
        self.unreachable = self._probe_unreachable()
        for name, param in self.encoder.named_parameters():
            if name in self.unreachable:
                param.requires_grad_(False)

    @property
    def encoder_dim(self) -> int:
        return encoder_hidden_size(self.encoder)

    @property
    def pooled_output(self) -> bool:
        """True for an encoder whose features are its output after a pooler (Qwen2-Audio's ``last_hidden_state``,
        Qwen2.5-VL's merged ``pooler_output``: ``TowerCall.stock_output``), not one of its layers' hidden states."""
        return isinstance(self.feature_count, (Qwen2AudioFeatureCount, qwen2_5_vl.Qwen25VLFeatureCount))

    @property
    def check_item(self) -> "EncoderInputCheck":
        """The check of one processed item against this encoder's input shape (:class:`EncoderInputCheck`: a
        small picklable object holding only the numbers it needs, so DataLoader workers do not receive the
        encoder)."""
        cfg = self.encoder.config
        if self.modality == "image" and cfg.model_type in internvl.MODEL_TYPES:
            return EncoderInputCheck("image", int(cfg.num_channels), tile=internvl.tile_size(cfg))
        if self.modality == "image" and cfg.model_type in qwen2_5_vl.MODEL_TYPES:
            return EncoderInputCheck("image", int(cfg.in_channels), qwen2_5_vl.patch_values(cfg))
        if self.modality == "image":
            siglip2 = cfg.model_type in SIGLIP2_TYPES
            width = int(cfg.num_channels) * int(cfg.patch_size) ** 2 if siglip2 else 0
            return EncoderInputCheck("image", int(cfg.num_channels), width)
        return EncoderInputCheck("audio", audio_window=audio_window(cfg))

    @property
    def video_encoding(self) -> PerFrame | qwen2_5_vl.TemporalPatches:
        """How this (image) branch encodes a video's sampled frames (:class:`plait.data.video.VideoEncoding`): by
        default every frame is one image item (:class:`plait.data.processing.PerFrame`); a family with temporal
        patches (Qwen2.5-VL: :class:`~plait.models.families.qwen2_5_vl.TemporalPatches`) returns its own encoding."""
        if self.encoder.config.model_type in qwen2_5_vl.MODEL_TYPES:
            return qwen2_5_vl.TemporalPatches(int(self.encoder.config.temporal_patch_size),
                                              self.encoder.config.tokens_per_second)
        return PerFrame()

    def settings(self) -> dict[str, Any]:
        """The JSON-serialisable construction arguments (saved next to the weights)."""
        return {
            "modality": self.modality,
            "feature_layer": self.feature_layer,
            "select": self.select,
            "downsample": self.downsample,
            "projector": self.projector.kind,
        }

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Projected features ``[total_features, llm_hidden]`` of a batch of items (see class docstring)."""
        return self.projector(self.encoder_forward(inputs))

    def encoder_forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Selected, pooled encoder features ``[total_features, encoder_dim]`` before the projector."""
        hidden = [self.encoder_features(kwargs) for kwargs, _ in self.item_groups(inputs)]
        return self.assemble_features(inputs, hidden)

    def encoder_features(self, model_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Selected hidden state ``[n, positions, encoder_dim]`` for a stacked batch of same-shape items."""
        if self.pooled_output:
            return tower_call(self.encoder, model_inputs).stock_output(self.encoder(**model_inputs), True)
        out = self.encoder(**model_inputs, output_hidden_states=True)
        return self.select_positions(out.hidden_states[self.feature_layer])

    def select_positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, positions, dim]`` without the CLS position when ``select="drop_cls"``."""
        return hidden[:, 1:] if self.select == "drop_cls" else hidden

    def item_groups(self, inputs: dict[str, Any]) -> list[tuple[dict[str, Any], list[int]]]:
        """The encoder calls a batch of items needs: ``(HF encoder kwargs, item indices)`` per group.

        Images of equal size form one group (``pixel_values`` ``[n, C, H, W]``, with
        ``interpolate_pos_encoding`` when the size is not the native one), in order of first appearance; SigLIP2
        images (``pixel_values`` ``[h*w, C*p*p]`` with ``spatial_shapes`` ``(h, w)``) of one patch grid likewise;
        audio is one group (``input_features`` ``[n, mel, T]``; for Qwen2-Audio with the key-padding
        ``attention_mask`` of its clips' lengths, as Hugging Face's composite model passes it).
        """
        return [(self._in_tower_dtype(kwargs), idx) for kwargs, idx in self._item_groups(inputs)]

    def _in_tower_dtype(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with their floating tensors in the dtype of the tower's weights (the tower computes in the
        dtype its job table or checkpoint gives it); unchanged for a tower without weights on this rank."""
        dtype = next((p.dtype for p in self.encoder.parameters() if p.is_floating_point()), None)
        if dtype is None:
            return kwargs
        return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype else v
                for k, v in kwargs.items()}

    def _item_groups(self, inputs: dict[str, Any]) -> list[tuple[dict[str, Any], list[int]]]:
        if self.modality == "audio":
            feats = inputs["input_features"]
            kwargs: dict[str, Any] = {"input_features": feats}
            if isinstance(self.feature_count, Qwen2AudioFeatureCount):
                kwargs["attention_mask"] = qwen2_audio_attention_mask(
                    self.encoder.config, self.feature_count, inputs["num_samples"], self.encoder.dtype)
            return [(kwargs, list(range(feats.shape[0])))]
        images = inputs["pixel_values"]
        if "image_grid_thw" in inputs:  # Qwen2.5-VL: every image's patches packed into one call
            return [(qwen2_5_vl.qwen2_5_vl_inputs(images, inputs["image_grid_thw"]), list(range(len(images))))]
        packed = self._packed_inputs(images) if len(images) else None
        if packed is not None:
            return [(packed, list(range(len(images))))]
        if "spatial_shapes" in inputs:  # SigLIP2 NaFlex: images of one patch grid (h, w) together
            shapes = inputs["spatial_shapes"]
            return [(siglip2_inputs([images[i] for i in idx], [shapes[i] for i in idx]), idx)
                    for idx in _image_groups(inputs).values()]
        native = int(self.encoder.config.image_size)
        out = []
        for shape, idx in _image_groups(inputs).items():
            kwargs = {"pixel_values": torch.stack([images[i] for i in idx])}
            if shape[-2:] != (native, native):
                kwargs["interpolate_pos_encoding"] = True
            out.append((kwargs, idx))
        return out

    def _packed_inputs(self, images: list[torch.Tensor]) -> dict[str, Any] | None:
        """The one stock-forward call of all images of a batch, for the families that take them together: Pixtral
        packs every image's patches into one sequence (block-diagonal mask), InternVL encodes every tile (all of
        one size); None for the other families (one call per image size)."""
        model_type = self.encoder.config.model_type
        if model_type in pixtral.MODEL_TYPES:
            return pixtral.pixtral_inputs(images)
        if model_type in internvl.MODEL_TYPES:
            return internvl.internvl_inputs(images)
        return None

    def _assemble_packed(self, inputs: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
        """Features of the one packed call (:meth:`_packed_inputs`): Pixtral's ``[1, P, D]`` rows as they are,
        InternVL's ``[tiles, positions, D]`` through the pixel shuffle (``[tiles x (g/d)^2, D d^2]``).

        Raises:
            ValueError: when the rows differ from the feature counts of the items' sizes.
        """
        if isinstance(self.feature_count, internvl.InternVLFeatureCount):
            sizes = [(int(p.shape[0]), int(p.shape[-2]), int(p.shape[-1])) for p in inputs["pixel_values"]]
            features = internvl.pixel_shuffle_features(hidden, self.downsample)
        else:
            sizes = [(int(p.shape[-2]), int(p.shape[-1])) for p in inputs["pixel_values"]]
            features = hidden.reshape(-1, hidden.shape[-1])
        return self._counted(features, sizes, "images of sizes")

    def assemble_features(self, inputs: dict[str, Any], hidden: list[torch.Tensor]) -> torch.Tensor:
        """Features ``[total_features, encoder_dim]`` of all items, in item order, from the selected hidden
        states of each group of ``item_groups(inputs)`` (audio is pooled and cut to each clip's count; InternVL's
        tiles pixel-shuffled, ``[total_features, encoder_dim * downsample^2]``).

        Raises:
            ValueError: when a group's feature count differs from the feature-count formula.
        """
        if self.modality == "image" and self.encoder.config.model_type in (*pixtral.MODEL_TYPES,
                                                                            *internvl.MODEL_TYPES):
            if not hidden:
                return torch.zeros(0, encoder_feature_size(self.encoder, self.downsample))
            return self._assemble_packed(inputs, hidden[0])
        if self.modality == "image" and "image_grid_thw" in inputs:
            return self._assemble_grids(inputs["image_grid_thw"], hidden)
        if self.modality == "image":
            return self._assemble_images(inputs, hidden)
        return self._assemble_audio(hidden[0], inputs["num_samples"])

    def _assemble_grids(self, grids: list[torch.Tensor], hidden: list[torch.Tensor]) -> torch.Tensor:
        """Qwen2.5-VL: the one call's merged features ``[sum of counts, out_hidden_size]``, already in image order.

        Raises:
            ValueError: when their number differs from the feature counts of the images' ``(t, h, w)`` grids.
        """
        sizes = [tuple(int(g) for g in grid) for grid in grids]
        features = hidden[0] if hidden else torch.zeros(0, encoder_feature_size(self.encoder, self.downsample))
        return self._counted(features, sizes, "image grids")

    def _counted(self, features: torch.Tensor, sizes: list[tuple[int, ...]], what: str) -> torch.Tensor:
        """``features`` (``[rows, D]``) when their rows equal the feature counts of the items' ``sizes``.

        Raises:
            ValueError: naming the encoder, the sizes (``what``) and both counts.
        """
        expected = sum(self.feature_count(size) for size in sizes)
        if features.shape[0] != expected:
            raise ValueError(f"{type(self.encoder).__name__} gave {features.shape[0]} features for {what} {sizes} "
                             f"but the feature-count formula says {expected}")
        return features

    def _assemble_images(self, inputs: dict[str, Any], hidden: list[torch.Tensor]) -> torch.Tensor:
        per_item: list[torch.Tensor | None] = [None] * len(inputs["pixel_values"])
        for (shape, idx), group in zip(_image_groups(inputs).items(), hidden):
            expected = self.feature_count(shape[-2:])
            if group.shape[1] != expected:
                raise ValueError(
                    f"{type(self.encoder).__name__} gave {group.shape[1]} features for a {shape[-2]}x{shape[-1]} "
                    f"image but the feature-count formula says {expected}"
                )
            for j, i in enumerate(idx):
                per_item[i] = group[j]
        if not per_item:
            return torch.zeros(0, self.encoder_dim)
        return torch.cat(per_item, dim=0)  # type: ignore[arg-type]

    def _assemble_audio(self, hidden: torch.Tensor, num_samples: torch.Tensor) -> torch.Tensor:
        if self.downsample > 1:
            pooled = F.avg_pool1d(hidden.transpose(1, 2), self.downsample, self.downsample, ceil_mode=True)
            hidden = pooled.transpose(1, 2)
        counts = [self.feature_count(int(n)) for n in num_samples.tolist()]
        if counts and max(counts) > hidden.shape[1]:
            raise ValueError(f"audio encoder gave {hidden.shape[1]} positions, fewer than {max(counts)} needed")
        return torch.cat([hidden[i, :c] for i, c in enumerate(counts)], dim=0)

    def _probe_unreachable(self) -> frozenset[str]:
        """Names of encoder parameters that cannot influence the selected features (probe backward; on the
        meta device when the encoder has no weights yet, which gives the same graph)."""
        params = dict(self.encoder.named_parameters())
        flags = {n: p.requires_grad for n, p in params.items()}
        was_training = self.encoder.training
        self.encoder.eval()
        try:
            for p in params.values():
                p.requires_grad_(True)
            with torch.enable_grad():
                device = next(iter(params.values())).device
                hidden = self.encoder_features(dummy_encoder_input(self.encoder, self.modality, device))
                grads = torch.autograd.grad(hidden.sum(), list(params.values()), allow_unused=True)
        finally:
            for n, p in params.items():
                p.requires_grad_(flags[n])
            self.encoder.train(was_training)
        return frozenset(n for (n, _), g in zip(params.items(), grads) if g is None)


def _image_groups(inputs: dict[str, Any]) -> dict[tuple[int, ...], list[int]]:
    """Indices of the images of each shape (``[C, H, W]``; SigLIP2: the patch grid ``(h, w)``), shapes in order of
    first appearance."""
    shapes = inputs.get("spatial_shapes")
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, img in enumerate(inputs["pixel_values"]):
        key = tuple(int(d) for d in shapes[i]) if shapes is not None else tuple(img.shape)
        groups[key].append(i)
    return dict(groups)


@dataclass(frozen=True)
class EncoderInputCheck:
    """Checks one processed item (``pixel_values [C, H, W]``, SigLIP2's patches ``[n, C x patch^2]`` with
    ``spatial_shapes``, Qwen2.5-VL's ``[t h w, C x T x patch^2]`` with ``image_grid_thw``, or ``input_features
    [mel, T]``) against an encoder's input shape, so that a processor that
    does not match the encoder is caught per sample (``data.processing.ModalitySpec.check_item``).

    Attributes:
        modality: ``"image"`` or ``"audio"``.
        channels: the image encoder's input channels (0 for audio).
        patch_values: values per patch of a SigLIP2 tower (channels x patch_size^2), 0 for other towers.
        audio_window: ``(mel bins, frames)`` the audio encoder accepts (``models.hf.audio_window``).
    """

    modality: str
    channels: int = 0
    patch_values: int = 0
    audio_window: tuple[int, int] | None = None
    tile: int = 0

    def __call__(self, item: dict[str, Any]) -> None:
        """Raises:
            ValueError: naming the processor's and the encoder's channels, patch width, tile size, mel bins or
                frames.
        """
        if self.tile:
            self._check_tiles(item["pixel_values"])
            return
        if self.modality == "image" and "image_grid_thw" in item:
            self._check_grid(item["pixel_values"], item["image_grid_thw"])
            return
        if self.modality == "image" and "spatial_shapes" in item:
            width = int(item["pixel_values"].shape[-1])
            if width != self.patch_values:
                raise ValueError(f"the image processor gives patches of {width} values, the SigLIP2 encoder expects "
                                 f"{self.patch_values} (num_channels x patch_size^2: check the processor's patch_size)")
            return
        if self.modality == "image":
            channels = int(item["pixel_values"].shape[0])
            if channels != self.channels:
                raise ValueError(f"the image processor gives {channels} channels, the encoder expects {self.channels}")
            return
        mel, frames = (int(d) for d in item["input_features"].shape)
        if (mel, frames) != self.audio_window:
            raise ValueError(f"the feature extractor gives {mel} mel bins x {frames} frames, the encoder expects "
                             f"{self.audio_window[0]} x {self.audio_window[1]} (feature_size / chunk_length of the "
                             "processor)")

    def _check_tiles(self, pixels: torch.Tensor) -> None:
        """InternVL: ``pixels`` must be ``[t, C, S, S]`` tiles of the tower's channels and tile side ``S``."""
        if pixels.dim() != 4:
            raise ValueError(f"the image processor gives pixel_values of shape {tuple(pixels.shape)}, the InternVL "
                             "encoder expects tiles [t, C, S, S] (GotOcr2ImageProcessorPil with crop_to_patches)")
        shape = (int(pixels.shape[1]), int(pixels.shape[2]), int(pixels.shape[3]))
        if shape != (self.channels, self.tile, self.tile):
            raise ValueError(f"the image processor gives tiles of {shape[0]} channels x {shape[1]}x{shape[2]} "
                             f"pixels, the InternVL encoder expects {self.channels} x {self.tile}x{self.tile}")

    def _check_grid(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        """Qwen2.5-VL: ``pixels`` must be ``[t*h*w, C*T*p*p]`` patch rows of the tower's width for ``grid``."""
        t, h, w = (int(g) for g in grid)
        width = int(pixels.shape[-1])
        if width != self.patch_values:
            raise ValueError(f"the image processor gives patches of {width} values, the Qwen2.5-VL encoder expects "
                             f"{self.patch_values} (in_channels x temporal_patch_size x patch_size^2: check the "
                             "processor's patch_size and temporal_patch_size)")
        if pixels.dim() != 2 or int(pixels.shape[0]) != t * h * w:
            raise ValueError(f"the image processor gives {tuple(pixels.shape)} patch values for a {t}x{h}x{w} grid, "
                             f"expected {t * h * w} rows")
