"""Collation: processed samples -> a padded batch with positions, per-token mask metadata and costs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from plait.data.omni_positions import document_positions
from plait.data.processing import IGNORE, ProcessedSample, SampleMeta

__all__ = ["Batch", "collate"]


@dataclass
class Batch:
    """A padded batch of ``B`` samples, ``N`` = longest sample.

    Attributes:
        input_ids: ``[B, N]`` int64, ``pad_id`` on padding.
        labels: ``[B, N]`` int64 next-token targets, -100 where no loss is taken (padding included).
        attention_mask: ``[B, N]`` int64, 1 on tokens and 0 on padding.
        position_ids: ``[B, N]`` int64 position within the sample (0 on padding).
        document_ids: ``[B, N]`` int64 document index within the row (0 here: one sample per row), -1 on padding.
        item_ids: ``[B, N]`` int64, -1 on text and padding, else the media item index within the row.
        modality_inputs: per encoder name, the :class:`~plait.models.encoder.ModalityEncoder` inputs of every
            item in row-major placeholder order; encoders without items are absent.
        meta: per-sample :class:`SampleMeta` (text tokens, tokens per item, target tokens).
        answers: reference answers (validation).
        rope_position_ids: ``[3, B, N]`` int64 multimodal rotary positions (M-RoPE, :mod:`plait.data.mrope`) of
            each document when some item of the batch has an image grid (``image_grid_thw``: Qwen2.5-VL), else
            None (an item with ``second_per_grid_t`` and ``tokens_per_second``, a Qwen2.5-VL video, is positioned as
            transformers positions a video); 0 on padding, per document in packed rows. An LLM that rotates with
            M-RoPE takes these instead of ``position_ids`` (which stay the positions inside the document, for the
            attention mask); every other LLM ignores them. A document with a Qwen2.5-Omni thinker's video (with its
            audio track or not, ``VideoSpec.audio``) is positioned as the thinker positions it
            (:mod:`plait.data.omni_positions`); float32 when a document's are fractional (a Qwen3-Omni video whose
            ``second_per_grid_t x position_id_per_seconds`` is not whole, as transformers positions it).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    item_ids: torch.Tensor
    modality_inputs: dict[str, dict[str, Any]]
    meta: tuple[SampleMeta, ...]
    answers: tuple[str, ...] = field(default=())
    rope_position_ids: torch.Tensor | None = None

    @property
    def target_tokens(self) -> int:
        """Tokens that carry a label in this batch."""
        return int((self.labels != IGNORE).sum())

    def to(self, device: torch.device | str) -> "Batch":
        """The batch with every tensor moved to ``device``."""
        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, list):
                return [move(v) for v in x]
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x

        fields = {k: move(v) for k, v in self.__dict__.items() if k not in ("meta", "answers")}
        return Batch(**fields, meta=self.meta, answers=self.answers)


def collate(samples: Sequence[ProcessedSample], pad_id: int, padding_side: str = "right", pack: bool = False) -> Batch:
    """Pad ``samples`` into a :class:`Batch` (``padding_side="left"`` for generation prompts), or with
    ``pack=True`` concatenate them into one row of several documents (``B = 1``): ``document_ids`` count the
    documents, ``position_ids`` restart at 0 for each, ``item_ids`` stay unique within the row. Packed rows
    need plait's attention (documents must not see each other).

    Raises:
        ValueError: for an empty list or an unknown padding side.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    if pack:
        return _pack(samples)
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    width = max(len(s.input_ids) for s in samples)
    rows = len(samples)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE, dtype=torch.long)
    attn = torch.zeros((rows, width), dtype=torch.long)
    pos = torch.zeros((rows, width), dtype=torch.long)
    docs = torch.full((rows, width), -1, dtype=torch.long)
    items = torch.full((rows, width), -1, dtype=torch.long)
    rope_rows = _rope_rows(samples)
    rope = None if rope_rows is None else torch.zeros((3, rows, width), dtype=_rope_dtype(rope_rows))
    for r, s in enumerate(samples):
        n = len(s.input_ids)
        cols = slice(width - n, width) if padding_side == "left" else slice(0, n)
        ids[r, cols] = s.input_ids
        labels[r, cols] = s.labels
        attn[r, cols] = 1
        pos[r, cols] = torch.arange(n)
        docs[r, cols] = 0
        items[r, cols] = s.item_ids
        if rope is not None:
            rope[:, r, cols] = rope_rows[r]  # type: ignore[index]
    return Batch(ids, labels, attn, pos, docs, items, _modality_inputs(samples), tuple(s.meta for s in samples),
                 tuple(s.answer for s in samples), rope)


def _rope_dtype(rows: Sequence[torch.Tensor]) -> torch.dtype:
    """int64, or float32 when a row's positions are fractional (a Qwen3-Omni video's, as transformers gives them)."""
    return torch.float32 if any(r.is_floating_point() for r in rows) else torch.long


def _rope_rows(samples: Sequence[ProcessedSample]) -> list[torch.Tensor] | None:
    """Per sample, its M-RoPE positions ``[3, n]`` (:func:`plait.data.omni_positions.document_positions`; 1-D
    positions on three streams for a sample without grid items) when some item of ``samples`` has an
    ``image_grid_thw``; None otherwise."""
    if not any("image_grid_thw" in it for s in samples for items in s.inputs.values() for it in items):
        return None
    rows = []
    for s in samples:
        seen: dict[str, int] = {}
        in_order = []
        for name, _ in s.meta.items:
            in_order.append(s.inputs[name][seen.get(name, 0)])
            seen[name] = seen.get(name, 0) + 1
        try:
            row = document_positions(s.input_ids, s.item_ids, in_order)
        except ValueError as exc:
            raise ValueError(f"sample {s.meta.id}: {exc}") from None
        rows.append(torch.arange(len(s.input_ids)).expand(3, -1).clone() if row is None else row)
    return rows


def _modality_inputs(samples: Sequence[ProcessedSample]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    names = sorted({name for s in samples for name, items in s.inputs.items() if items})
    for name in names:
        items = [it for s in samples for it in s.inputs.get(name, [])]
        if "pixel_values" in items[0]:
            out[name] = {"pixel_values": [it["pixel_values"] for it in items]}
            if "spatial_shapes" in items[0]:  # SigLIP2 NaFlex: each image's patch grid (h, w)
                out[name]["spatial_shapes"] = [it["spatial_shapes"] for it in items]
            if "image_grid_thw" in items[0]:  # Qwen2.5-VL: each image's patch grid (t, h, w)
                out[name]["image_grid_thw"] = [it["image_grid_thw"] for it in items]
        else:
            out[name] = {
                "input_features": torch.stack([it["input_features"] for it in items]),
                "num_samples": torch.tensor([it["num_samples"] for it in items], dtype=torch.long),
            }
    return out


def _pack(samples: Sequence[ProcessedSample]) -> Batch:
    items_before = torch.tensor([0] + [len(s.meta.items) for s in samples]).cumsum(0)
    ids = torch.cat([s.input_ids for s in samples])[None]
    labels = torch.cat([s.labels for s in samples])[None]
    pos = torch.cat([torch.arange(len(s.input_ids)) for s in samples])[None]
    docs = torch.cat([torch.full((len(s.input_ids),), d) for d, s in enumerate(samples)])[None]
    items = torch.cat([torch.where(s.item_ids >= 0, s.item_ids + items_before[d], -1)
                       for d, s in enumerate(samples)])[None]
    rope = _rope_rows(samples)
    return Batch(ids, labels, torch.ones_like(ids), pos, docs, items, _modality_inputs(samples),
                 tuple(s.meta for s in samples), tuple(s.answer for s in samples),
                 None if rope is None else torch.cat([r.to(_rope_dtype(rope)) for r in rope], dim=1)[:, None])
