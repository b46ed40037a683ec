"""A modality encoder branch: Hugging Face encoder + feature selection + pooling + projector."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from plait.models.families import encoder_family
from plait.models.families.base import EncoderInputCheck
from plait.models.hf import (
    dummy_encoder_input,
    encoder_feature_size,
    encoder_hidden_size,
    encoder_layout,
    feature_count_for,
)
from plait.models.projector import Projector
from plait.models.tower_call import tower_call

__all__ = ["ModalityEncoder"]


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
    same graph without computing values, so the flags are the same as with real weights. The same probe finds the
    parameters the tower's forward reads without calling the module that holds them (``read_uncalled``:
    Qwen2-Audio's and Voxtral's ``embed_positions.weight``), which FSDP2 cannot gather before use and so keeps
    replicated (:mod:`plait.parallel.fsdp`).

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
        if select not in ("full", "drop_cls", "post_norm"):
            raise ValueError(f"select must be 'full', 'drop_cls' or 'post_norm', got {select!r}")
        self.family = encoder_family(encoder.config.model_type, modality)
        self.family.check_select(select)
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
        self.feature_count: Any = feature_count_for(encoder, modality, select, downsample, hop_length, sampling_rate)
        if self.pooled_output and feature_layer not in (-1, layers):
            raise ValueError(f"feature_layer={feature_layer}: the {encoder.config.model_type} encoder's features are "
                             "its pooled, normed last hidden state; use feature_layer = -1")
        self.family.prepare_tower(encoder)
        self.unreachable: frozenset[str] = frozenset()
        self.read_uncalled: frozenset[str] = frozenset()
        self.unreachable, self.read_uncalled = self._probe()
        for name, param in self.encoder.named_parameters():
            if name in self.unreachable:
                param.requires_grad_(False)

    @property
    def encoder_dim(self) -> int:
        return encoder_hidden_size(self.encoder)

    @property
    def pooled_output(self) -> bool:
        """True for an encoder whose features are its output after a pooler (Qwen2-Audio's ``last_hidden_state``,
        Qwen2.5-VL's merged ``pooler_output``: ``TowerCall.stock_output``), not one of its layers' hidden states;
        and for ``select = "post_norm"`` (the last hidden state after the tower's post-layernorm, Gemma 3's)."""
        return self.family.pooled_output or self.select == "post_norm"

    @property
    def check_item(self) -> EncoderInputCheck:
        """The check of one processed item against this encoder's input shape (:class:`EncoderInputCheck`: a
        small picklable object holding only the numbers it needs, so DataLoader workers do not receive the
        encoder)."""
        return self.family.input_check(self.encoder.config)

    @property
    def video_encoding(self) -> Any:
        """How this (image) branch encodes a video's sampled frames (:class:`plait.data.video.VideoEncoding`): by
        default every frame is one image item (:class:`plait.data.processing.PerFrame`); a family with temporal
        patches (Qwen2.5-VL: :class:`~plait.models.families.qwen2_5_vl.TemporalPatches`) returns its own encoding."""
        return self.family.video_encoding(self.encoder.config)

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
        images (``pixel_values`` ``[h*w, C*p*p]`` with ``spatial_shapes`` ``(h, w)``) of one patch grid likewise
        (``VisionFamily.group_inputs``); a packed family's images are one group (``VisionFamily.packed_inputs``);
        audio is one group (``input_features`` ``[n, mel, T]``; for Qwen2-Audio with the key-padding
        ``attention_mask`` of its clips' lengths, as Hugging Face's composite model passes it:
        ``AudioFamily.call_inputs``). Floating inputs are cast to the tower's dtype.
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
            kwargs = self.family.call_inputs(self.encoder, self.feature_count, inputs)
            return [(kwargs, list(range(inputs["input_features"].shape[0])))]
        packed = self.family.packed_inputs(inputs)  # Pixtral, InternVL, Qwen2.5-VL: every image in one call
        if packed is not None:
            return [(packed, list(range(len(inputs["pixel_values"]))))]
        images, shapes = inputs["pixel_values"], inputs.get("spatial_shapes")
        return [(self.family.group_inputs(self.encoder.config, [images[i] for i in idx],
                                          [shapes[i] for i in idx] if shapes is not None else [None] * len(idx)), idx)
                for idx in _image_groups(inputs).values()]

    def assemble_features(self, inputs: dict[str, Any], hidden: list[torch.Tensor]) -> torch.Tensor:
        """Features ``[total_features, encoder_dim]`` of all items, in item order, from the selected hidden
        states of each group of ``item_groups(inputs)`` (audio is pooled and cut to each clip's count; a packed
        family's one call as the family assembles it: InternVL's tiles pixel-shuffled,
        ``[total_features, encoder_dim * downsample^2]``).

        Raises:
            ValueError: when a group's feature count differs from the feature-count formula.
        """
        if self.modality == "image" and getattr(self.family, "packed", False):
            if not hidden:
                return torch.zeros(0, encoder_feature_size(self.encoder, self.downsample))
            features, sizes = self.family.packed_features(hidden[0], inputs, self.downsample)
            return self._counted(features, sizes, self.family.packed_what)
        if self.modality == "image":
            return self._assemble_images(inputs, hidden)
        return self._assemble_audio(hidden[0], inputs["num_samples"])

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
            group = self.family.pool_features(self.encoder.config, group, shape[-2:], self.downsample)
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

    def _probe(self) -> tuple[frozenset[str], frozenset[str]]:
        """Names of encoder parameters that cannot influence the selected features, and of those that do although
        neither the module holding them nor any module between it and the tower ran its forward (the tower reads
        the tensor itself, as ``embed_positions.weight``). One probe forward and backward; on the meta device when
        the encoder has no weights yet, which gives the same graph."""
        params = dict(self.encoder.named_parameters())
        flags = {n: p.requires_grad for n, p in params.items()}
        was_training = self.encoder.training
        self.encoder.eval()
        called: set[str] = set()
        hooks = [m.register_forward_pre_hook(lambda *_, name=name: called.add(name))
                 for name, m in self.encoder.named_modules() if name]
        try:
            for p in params.values():
                p.requires_grad_(True)
            with torch.enable_grad():
                device = next(iter(params.values())).device
                hidden = self.encoder_features(dummy_encoder_input(self.encoder, self.modality, device))
                grads = torch.autograd.grad(hidden.sum(), list(params.values()), allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
            for n, p in params.items():
                p.requires_grad_(flags[n])
            self.encoder.train(was_training)
        unreachable = frozenset(n for (n, _), g in zip(params.items(), grads) if g is None)
        owners = {n: [n.rsplit(".", k)[0] for k in range(1, n.count(".") + 1)] for n in params}
        uncalled = frozenset(n for n in params if n not in unreachable and owners[n]
                             and not any(m in called for m in owners[n]))
        return unreachable, uncalled


def _image_groups(inputs: dict[str, Any]) -> dict[tuple[int, ...], list[int]]:
    """Indices of the images of each shape (``[C, H, W]``; SigLIP2: the patch grid ``(h, w)``), shapes in order of
    first appearance."""
    shapes = inputs.get("spatial_shapes")
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, img in enumerate(inputs["pixel_values"]):
        key = tuple(int(d) for d in shapes[i]) if shapes is not None else tuple(img.shape)
        groups[key].append(i)
    return dict(groups)
