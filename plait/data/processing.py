"""MultimodalProcessor: a conversation with media -> token ids, next-token labels and encoder inputs.

Steps for one sample: the tokenizer's chat template renders the conversation (assistant tokens marked
by the template's ``{% generation %}`` blocks, or found by rendering turn by turn for any other template:
:mod:`plait.data.chat_template`), each placeholder token is expanded to as many copies as
its encoder will emit features (the encoder's own feature-count function), media are decoded and run
through the Hugging Face image processor / feature extractor, and labels are the next token where that
token belongs to an assistant answer (-100 elsewhere: prompt, placeholders, padding).
"""

from __future__ import annotations

import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from plait.data.chat_template import render_prompt, render_with_assistant_mask
from plait.data.sources import RawSample, SampleError, path_note

__all__ = ["ModalitySpec", "SampleMeta", "ProcessedSample", "MultimodalProcessor", "load_audio", "load_image",
           "process_image"]

IGNORE = -100


@dataclass(frozen=True)
class ModalitySpec:
    """How one encoder branch's inputs are prepared.

    Attributes:
        encoder: branch name in the model (``"vision"``).
        modality: ``"image"`` or ``"audio"``.
        placeholder: placeholder string in the text (``"<image>"``), a single token of the tokenizer.
        placeholder_id: its token id.
        hf_processor: Hugging Face image processor or audio feature extractor.
        feature_count: the encoder's feature-count function (image ``(H, W)`` or audio samples -> tokens).
        check_item: the encoder's check of one processed item (raises ``ValueError`` when the processor's output
            does not fit the encoder: channels, mel bins, window), or None.
    """

    encoder: str
    modality: str
    placeholder: str
    placeholder_id: int
    hf_processor: Any
    feature_count: Callable[[Any], int]
    check_item: Callable[[dict[str, Any]], None] | None = None


@dataclass(frozen=True)
class SampleMeta:
    """What planners need to know of a sample without its tensors.

    Attributes:
        id, task: from the record.
        length: tokens in the LLM sequence (placeholders included).
        text_tokens: tokens that are not placeholders.
        target_tokens: tokens with a label (answer tokens).
        items: ``((encoder, tokens), ...)`` per media item, in placeholder order.
    """

    id: str
    task: str
    length: int
    text_tokens: int
    target_tokens: int
    items: tuple[tuple[str, int], ...]


@dataclass
class ProcessedSample:
    """A sample ready for collation.

    Attributes:
        input_ids: ``[L]`` int64 token ids with expanded placeholders.
        labels: ``[L]`` int64 next-token targets (``labels[t]`` is the target of position ``t``), -100 where
            no loss is taken.
        item_ids: ``[L]`` int64: -1 on text tokens, else the index of the media item within the sample.
        inputs: per encoder name, a list of per-item dicts (``pixel_values [C,H,W]`` or
            ``input_features [mel, T]`` + ``num_samples``).
        meta: :class:`SampleMeta`.
        answer: the reference answer text (last assistant message), for validation.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    item_ids: torch.Tensor
    inputs: dict[str, list[dict[str, Any]]]
    meta: SampleMeta
    answer: str = ""
    prompt_only: bool = field(default=False)


def load_image(path: str | bytes) -> Image.Image:
    """Decode an image to RGB, compositing any transparency (RGBA, LA, PA, P or L with a transparent colour)
    onto a white background. ``path``: a file path, or the encoded image itself as ``bytes`` (media embedded in
    the data file, :class:`plait.data.sources.MediaBytes`, whose ``str()`` names it in errors).

    Raises:
        SampleError: when the file is missing or not a readable image.
    """
    # The Hugging Face image processors convert with transformers.image_transforms.convert_to_rgb (white
    # background), both backends; PIL's img.convert("RGB") would drop alpha and keep the hidden colours, so
    # training would see other pixels than inference. Calling that very function keeps the two identical.
    # Imported here so that this edit stays inside the function; the module is cached after the first call.
    import io

    from transformers.image_transforms import convert_to_rgb

    source = io.BytesIO(path) if isinstance(path, bytes) else path
    try:
        with Image.open(source) as img:
            return Image.fromarray(convert_to_rgb(img, return_numpy=True))
    except FileNotFoundError as exc:
        raise SampleError(f"image file {path} does not exist{path_note(path)}") from exc
    except Exception as exc:  # PIL raises several types for corrupt files
        raise SampleError(f"cannot decode image {path}: {_decode_reason(exc, source, path)}") from exc


def process_image(hf_processor: Any, image: Image.Image) -> tuple[dict[str, Any], tuple[int, int]]:
    """One image through its Hugging Face image processor: ``(item, size)``, ``size`` being what the encoder's
    feature-count function takes.

    Fixed-grid processors (CLIP, SigLIP, ViT): ``item = {"pixel_values": [C, H, W]}``, ``size = (H, W)`` pixels.
    SigLIP2 NaFlex (output with ``spatial_shapes``): ``item = {"pixel_values": [h*w, C*p*p], "spatial_shapes":
    [2]}`` with only the ``h * w`` real patches (the processor pads to ``max_num_patches``), ``size = (h, w)``
    patches.
    """
    out = hf_processor(images=[image], return_tensors="pt")
    if "spatial_shapes" in out:
        shape = out["spatial_shapes"][0].long()
        h, w = int(shape[0]), int(shape[1])
        return {"pixel_values": out["pixel_values"][0, : h * w], "spatial_shapes": shape}, (h, w)
    pixels = out["pixel_values"][0]
    return {"pixel_values": pixels}, (int(pixels.shape[-2]), int(pixels.shape[-1]))


def load_audio(path: str | bytes) -> tuple[np.ndarray, int]:
    """Decode audio to mono float32 in [-1, 1]: ``(samples [n], sampling_rate in Hz)``. ``path``: a file path,
    or the encoded file itself as ``bytes`` (embedded media, :class:`plait.data.sources.MediaBytes`).

    WAV (a ``.wav`` path, or bytes starting with ``RIFF....WAVE``) is read with the standard library; other
    formats (FLAC, OGG) with ``soundfile``.

    Raises:
        SampleError: when the file is missing, empty or not decodable.
    """
    import io

    embedded = isinstance(path, bytes)
    if not embedded and not Path(path).is_file():  # soundfile reports a missing file as "System error"
        raise SampleError(f"audio file {path} does not exist{path_note(path)}")
    is_wav = path[:4] == b"RIFF" and path[8:12] == b"WAVE" if embedded else path.lower().endswith(".wav")
    source = io.BytesIO(path) if embedded else path
    try:
        if is_wav:
            data, rate = _read_wav(source)
        else:
            import soundfile

            data, rate = soundfile.read(source, dtype="float32", always_2d=True)
            data = data.mean(axis=1)
    except FileNotFoundError as exc:
        raise SampleError(f"audio file {path} does not exist{path_note(path)}") from exc
    except Exception as exc:
        raise SampleError(f"cannot decode audio {path}: {_decode_reason(exc, source, path)}") from exc
    if data.size == 0:
        raise SampleError(f"audio file {path} has no samples")
    return data.astype(np.float32), int(rate)


def _decode_reason(exc: Exception, source: Any, path: str | bytes) -> str:
    """The decoder's message; for embedded bytes its ``<_io.BytesIO object at 0x...>`` reads "the embedded
    bytes" (a file path stays in the message as the decoder wrote it)."""
    reason = str(exc)
    return reason.replace(repr(source), "the embedded bytes") if isinstance(path, bytes) else reason


def _read_wav(path: str) -> tuple[np.ndarray, int]:
    with wave.open(path, "rb") as wav:
        width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
        raw = wav.readframes(wav.getnframes())
    if width != 2:
        raise ValueError(f"only 16-bit PCM WAV is supported, got {8 * width}-bit")
    data = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    return data.reshape(-1, channels).mean(axis=1), rate


class MultimodalProcessor:
    """Tokenizer + per-modality Hugging Face processors + feature-count functions.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (any: one that wraps assistant turns in
            ``{% generation %}`` marks them itself, others are rendered turn by turn, see
            :func:`plait.data.chat_template.render_with_assistant_mask`).
        specs: one :class:`ModalitySpec` per encoder branch (at most one branch per modality).
        max_length: longest sequence in tokens; longer samples are refused, never cut through a span.

    Raises:
        ValueError: when two specs share a modality or a placeholder is not a single token.
    """

    def __init__(self, tokenizer: Any, specs: list[ModalitySpec], max_length: int) -> None:
        modalities = [s.modality for s in specs]
        if len(set(modalities)) != len(modalities):
            raise ValueError(f"at most one encoder per modality, got {modalities}")
        for s in specs:
            ids = tokenizer.convert_tokens_to_ids(s.placeholder)
            if ids is None or ids == tokenizer.unk_token_id or ids != s.placeholder_id:
                raise ValueError(f"placeholder {s.placeholder!r} is not the single token id {s.placeholder_id}")
        self.tokenizer = tokenizer
        self.specs = {s.modality: s for s in specs}
        self.max_length = max_length

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def __call__(self, sample: RawSample, prompt_only: bool = False) -> ProcessedSample:
        """Process one sample; with ``prompt_only`` the last (assistant) message is left out and a
        generation prompt is appended (for validation by generation).

        Raises:
            SampleError: naming the record and file, for a placeholder/item count mismatch, an item of a
                modality the model has no encoder for, unreadable media, a sample longer than
                ``max_length`` or a chat-template failure.
        """
        label = f"record {sample.id!r} ({sample.source})"
        try:
            return self._process(sample, prompt_only)
        except SampleError as exc:
            raise SampleError(f"{label}: {exc}") from exc

    def _process(self, sample: RawSample, prompt_only: bool) -> ProcessedSample:
        messages = list(sample.messages[:-1] if prompt_only else sample.messages)
        ids, assistant = self._render(messages, prompt_only)
        inputs, counts = self._media(sample, ids)
        out_ids: list[int] = []
        out_mask: list[int] = []
        out_item: list[int] = []
        cursors = {m: 0 for m in self.specs}
        by_id = {s.placeholder_id: s for s in self.specs.values()}
        items: list[tuple[str, int]] = []
        for tok, is_answer in zip(ids, assistant):
            spec = by_id.get(tok)
            if spec is None:
                out_ids.append(tok)
                out_mask.append(is_answer)
                out_item.append(-1)
                continue
            n = counts[spec.modality][cursors[spec.modality]]
            cursors[spec.modality] += 1
            out_ids += [tok] * n
            out_mask += [0] * n
            out_item += [len(items)] * n
            items.append((spec.encoder, n))
        if len(out_ids) > self.max_length:
            raise SampleError(f"{len(out_ids)} tokens is longer than data.max_length={self.max_length}")
        input_ids = torch.tensor(out_ids, dtype=torch.long)
        mask = torch.tensor(out_mask + [0], dtype=torch.bool)[1:]
        labels = torch.where(mask, torch.roll(input_ids, -1), torch.full_like(input_ids, IGNORE))
        meta = SampleMeta(
            sample.id,
            sample.task,
            len(out_ids),
            sum(1 for i in out_item if i < 0),
            int(mask.sum()),
            tuple(items),
        )
        answer = sample.messages[-1]["content"]
        return ProcessedSample(input_ids, labels, torch.tensor(out_item), inputs, meta, answer, prompt_only)

    def _render(self, messages: list[dict[str, str]], prompt_only: bool) -> tuple[list[int], list[int]]:
        if prompt_only:
            ids = render_prompt(self.tokenizer, messages)
            return ids, [0] * len(ids)
        ids, mask = render_with_assistant_mask(self.tokenizer, messages)
        if not any(mask):
            raise SampleError("the chat template marked no assistant tokens (empty answer?)")
        return ids, mask

    def _media(self, sample: RawSample, ids: list[int]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[int]]]:
        inputs: dict[str, list[dict[str, Any]]] = {}
        counts: dict[str, list[int]] = {}
        for modality, paths in sample.media.items():
            if paths and modality not in self.specs:
                raise SampleError(f"has {len(paths)} {modality} item(s) but the model has no {modality} encoder")
        for modality, spec in self.specs.items():
            paths = sample.media.get(modality, ())
            n_placeholders = sum(1 for t in ids if t == spec.placeholder_id)
            if n_placeholders != len(paths):
                raise SampleError(
                    f"{n_placeholders} {spec.placeholder} placeholder(s) in the text but {len(paths)} {modality} item(s)"
                )
            items = [self._item(spec, p) for p in paths]
            inputs[spec.encoder] = [it for it, _ in items]
            counts[modality] = [c for _, c in items]
        return inputs, counts

    def _item(self, spec: ModalitySpec, path: str) -> tuple[dict[str, Any], int]:
        if spec.modality == "image":
            item, size = process_image(spec.hf_processor, load_image(path))
            return self._checked(spec, item, path), self._count(spec, size, path)
        data, rate = load_audio(path)
        expected = int(spec.hf_processor.sampling_rate)
        if rate != expected:
            raise SampleError(f"audio {path} is sampled at {rate} Hz; the feature extractor expects {expected} Hz")
        count = self._count(spec, len(data), path)
        feats = spec.hf_processor(data, sampling_rate=rate, return_tensors="pt")["input_features"][0]
        return self._checked(spec, {"input_features": feats, "num_samples": len(data)}, path), count

    @staticmethod
    def _checked(spec: ModalitySpec, item: dict[str, Any], path: str) -> dict[str, Any]:
        """``item`` after the encoder's check (:attr:`ModalitySpec.check_item`), errors naming the file."""
        if spec.check_item is not None:
            try:
                spec.check_item(item)
            except ValueError as exc:
                raise SampleError(f"{path}: {exc}") from exc
        return item

    @staticmethod
    def _count(spec: ModalitySpec, size: Any, path: str) -> int:
        try:
            return spec.feature_count(size)
        except ValueError as exc:
            raise SampleError(f"{path}: {exc}") from exc
