"""Gemma 3's pan-and-scan crops (``Gemma3ImageProcessor`` with ``do_pan_and_scan``) in plait's records.

With ``do_pan_and_scan`` set in the image branch's processor settings, ``Gemma3ImageProcessor.pan_and_scan`` cuts an
image whose aspect ratio reaches ``pan_and_scan_min_ratio_to_activate`` into 2..``pan_and_scan_max_num_crops``
crops along its long side (each at least ``pan_and_scan_min_crop_size`` pixels), from the image's size alone; the
original and each crop are resized to the tower's size, and ``Gemma3Processor.replace_image_token`` writes the
image's text as "Here is the original image <image> and here are some crops to help you see better <image> <image>"
(each ``<image>`` the processor's ``\\n\\n<start_of_image>`` soft tokens ``<end_of_image>\\n\\n``).

plait's records write one image as that very sequence with a single soft token (the branch's placeholder): with
crops, the record's sequence is replaced in the message text by the processor's own text (written by calling
``replace_image_token``, one placeholder per original and crop), before the chat template renders it, so the
tokenizer sees the string ``Gemma3Processor`` tokenizes; each original and crop is then one image item of the branch
(its tokens attend to each other both ways, as a single image's). The metadata pass finds the same crop count from
the image header (:meth:`PanAndScan.count`).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Sequence

import torch

from plait.data.sources import SampleError

__all__ = ["PanAndScan", "Crop"]


class Crop(str):
    """One image item of a pan-and-scan image: the original (``index`` 0) or a crop, labelled for errors
    (``"photo.png (crop 2 of 3)"``), with the record's ``source`` (a path or :class:`MediaBytes`) and, once the image
    is processed, its ``item`` (``{"pixel_values": [C, H, W]}``) and ``size`` (``(H, W)``)."""

    source: Any
    index: int
    item: dict[str, Any] | None
    size: tuple[int, int] | None

    def __new__(cls, source: Any, index: int, crops: int, item: dict[str, Any] | None = None,
                size: tuple[int, int] | None = None) -> "Crop":
        name = source if isinstance(source, str) else "embedded bytes"
        label = (name if crops == 0 else f"{name} (original of {crops} crops)" if index == 0
                 else f"{name} (crop {index} of {crops})")
        self = super().__new__(cls, label)
        self.source, self.index, self.item, self.size = source, index, item, size
        return self


class PanAndScan:
    """The image branch's pan-and-scan: crop counts, processed crops and the records' text.

    Args:
        hf_processor: a Gemma 3 image processor (``Gemma3ImageProcessorPil``) with ``do_pan_and_scan`` set.
        placeholder: the branch's placeholder (``<image_soft_token>``).
        boi, eoi: the tokenizer's ``<start_of_image>`` and ``<end_of_image>``.
    """

    def __init__(self, hf_processor: Any, placeholder: str, boi: str, eoi: str) -> None:
        self.hf_processor = hf_processor
        self.placeholder = placeholder
        self.block = f"\n\n{boi}{placeholder}{eoi}\n\n"
        """One image as the records write it (``Gemma3Processor.full_image_sequence`` with one soft token)."""

    @classmethod
    def of(cls, tokenizer: Any, spec: Any) -> "PanAndScan | None":
        """The pan-and-scan of image branch ``spec`` (a :class:`~plait.data.processing.ModalitySpec` or None), or
        None when its processor does not crop (no ``do_pan_and_scan``, or it is off). The processor's unset crop
        settings are set to ``Gemma3Processor``'s defaults (:meth:`_settings`).

        Raises:
            ValueError: when ``do_pan_and_scan`` is on but the processor has no ``pan_and_scan`` (not Gemma 3's) or
                the tokenizer names no ``boi_token``/``eoi_token``, naming the setting.
        """
        hf = getattr(spec, "hf_processor", None)
        if not getattr(hf, "do_pan_and_scan", False):
            return None
        where = f"model.encoders.{spec.encoder}.processor.do_pan_and_scan"
        if not hasattr(hf, "pan_and_scan"):
            raise ValueError(f"{where}: {type(hf).__name__} does not crop images (Gemma 3's image processor does)")
        boi, eoi = getattr(tokenizer, "boi_token", None), getattr(tokenizer, "eoi_token", None)
        if not boi or not eoi:
            raise ValueError(f"{where}: the tokenizer names no boi_token/eoi_token (<start_of_image>, "
                             "<end_of_image>) to write the crops' text with")
        out = cls(hf, spec.placeholder, boi, eoi)
        for key, value in out._settings().items():  # the processor called alone (a video's frames) works too
            setattr(hf, key, value)
        return out

    def _settings(self) -> dict[str, Any]:
        """The processor's crop settings; one it leaves unset (``None``: its saved config holds ``null``) takes
        ``Gemma3Processor``'s default (its ``images_kwargs``), as the processor passes them."""
        from transformers import Gemma3Processor

        defaults = Gemma3Processor.images_kwargs
        return {k: defaults[k] if getattr(self.hf_processor, k, None) is None else getattr(self.hf_processor, k)
                for k in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                          "pan_and_scan_min_ratio_to_activate")}

    def count(self, width: int, height: int) -> int:
        """Crops of an image of ``width`` x ``height`` pixels (0: it stays one image), by the processor's own
        ``pan_and_scan`` on a zero-stride blank of that size (no pixels allocated)."""
        blank = torch.zeros(()).expand(3, int(height), int(width))
        return len(self.hf_processor.pan_and_scan(blank, **self._settings()))

    def items(self, image: Any, source: Any) -> list[Crop]:
        """The original then each crop of PIL ``image`` (from record media ``source``) through the image processor,
        as :class:`Crop` items (``pixel_values [C, H, W]``, size ``(H, W)``).

        Raises:
            SampleError: naming ``source`` when the processor refuses the image.
        """
        try:
            out = self.hf_processor(images=[image], return_tensors="pt", do_pan_and_scan=True, **self._settings())
        except ValueError as exc:
            raise SampleError(f"image {Crop(source, 0, 0)}: {exc}") from exc
        pixels, crops = out["pixel_values"], int(out["num_crops"][0])
        return [Crop(source, k, crops, {"pixel_values": p}, (int(p.shape[-2]), int(p.shape[-1])))
                for k, p in enumerate(pixels)]

    def text(self, crops: int) -> str:
        """The text of an image with ``crops`` crops, one placeholder per original and crop:
        ``Gemma3Processor.replace_image_token`` with this branch's one-token image sequence."""
        from transformers import Gemma3Processor

        holder = types.SimpleNamespace(full_image_sequence=self.block)
        return Gemma3Processor.replace_image_token(holder, {"num_crops": [crops]}, 0)

    def apply(self, sample: Any, messages: Sequence[dict[str, Any]], images: list[list[Crop]]
              ) -> tuple[Any, list[dict[str, Any]]]:
        """``(sample, messages)`` with each image that has crops (``images[i]``: its :class:`Crop` items, the
        original first) written as :meth:`text` in the messages' text and its items in ``sample.media["image"]``
        (one per placeholder). Unchanged when the messages' placeholders do not match the record's images (the
        processor's placeholder check reports it); an image without crops keeps its text.

        Raises:
            SampleError: when an image with crops is not written as :attr:`block` in the record's text (naming it).
        """
        spots = [(m, k) for m, msg in enumerate(messages) for k in _find(msg.get("content"), self.placeholder)]
        if len(spots) != len(images):
            return sample, list(messages)
        contents = [msg.get("content") for msg in messages]
        half = self.block.index(self.placeholder)
        for (m, k), crops in reversed(list(zip(spots, images))):
            if len(crops) == 1:
                continue
            text = contents[m]
            start, end = k - half, k - half + len(self.block)
            if text[start:end] != self.block:
                raise SampleError(f"image {crops[0].split(' (')[0]} has {len(crops) - 1} pan-and-scan crops but its "
                                  f"placeholder is not written as {self.block!r}, the one image sequence of "
                                  "Gemma3Processor the crops' text replaces")
            contents[m] = text[:start] + self.text(len(crops) - 1) + text[end:]
        out = [dict(msg, content=c) for msg, c in zip(messages, contents)]
        media = dict(sample.media, image=tuple(c for crops in images for c in crops))
        return dataclasses.replace(sample, media=media), out


def _find(content: Any, placeholder: str) -> list[int]:
    """Start of each ``placeholder`` in a message's string ``content`` (none in other contents)."""
    if not isinstance(content, str):
        return []
    found, k = [], content.find(placeholder)
    while k >= 0:
        found.append(k)
        k = content.find(placeholder, k + len(placeholder))
    return found
