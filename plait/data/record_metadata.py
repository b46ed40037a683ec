"""One record's :class:`~plait.data.processing.SampleMeta` from its media headers, without decoding pixels or
waveforms: the per-record half of the metadata pass (:mod:`plait.data.metadata`).

Image sizes come from the file header (``PIL.Image.open(...).size`` reads no pixels); the size the image processor
outputs for that input size is found once per distinct size by processing a blank image of it (exact for any
processor whose output shape depends only on the input size, as resize / center-crop processors do). Audio lengths
come from the header (``wave`` for WAV, as the decoder reads it; ``soundfile.info`` for other formats). A video's
frame count, rate and frame size come from its container and stream headers
(:func:`plait.data.video.read_video_header`: no frame is decoded), its sampled frames from
:func:`plait.data.video.sample_indices`; its audio track, when the job takes it (``video.audio``), is decoded (the
sample count after resampling is what the count needs); a video whose encoding writes text around its items
(Qwen3-VL's timestamps) has that text tokenized, from its sampled frame indices and frame rate; a Gemma 3 image under
pan-and-scan has its crop count from its size (:mod:`plait.data.pan_and_scan`). The result equals what
:class:`~plait.data.processing.MultimodalProcessor` computes when it decodes the sample.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

from PIL import Image

from plait.data.chat_template import render_prompt, render_with_assistant_mask
from plait.data.processing import (MultimodalProcessor, SampleMeta, check_clip_video, decode_reason,
                                   process_image)
from plait.data.pan_and_scan import Crop
from plait.data.sources import MediaBytes, SampleError, path_note
from plait.data.video import VideoHeader, framed_video_ids, load_audio_track, read_video_header

__all__ = ["Headers", "record_metadata"]


class Headers:
    """Per-process memo of media headers (by path) and of the processed image size per input size."""

    def __init__(self) -> None:
        self.images: dict[str, tuple[int, int]] = {}
        self.audios: dict[str, tuple[int, int]] = {}
        self.videos: dict[str, VideoHeader] = {}
        self.tracks: dict[str | bytes, int] = {}  # a video's audio track: samples at the audio branch's rate
        self.processed: dict[tuple[int, ...], Any] = {}  # (H, W), or a pan-and-scan image's list of them


def _image_size(item: str | MediaBytes, memo: Headers) -> tuple[int, int]:
    """``(width, height)`` from the image header (no pixel decode). Raises SampleError like ``load_image``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.images:
        return memo.images[key]
    try:
        with Image.open(io.BytesIO(item) if isinstance(item, bytes) else item) as img:
            size = img.size
    except FileNotFoundError as exc:
        raise SampleError(f"image file {item} does not exist{path_note(str(item))}") from exc
    except Exception as exc:  # PIL raises several types for unreadable headers
        raise SampleError(f"cannot decode image {item}: {exc}") from exc
    if key is not None:
        memo.images[key] = size
    return size


def _audio_header(item: str | MediaBytes, memo: Headers) -> tuple[int, int]:
    """``(frames, sampling rate in Hz)`` from the audio header. Raises SampleError like ``load_audio``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.audios:
        return memo.audios[key]
    if key is not None and not Path(key).is_file():
        raise SampleError(f"audio file {item} does not exist{path_note(key)}")
    is_wav = item[:4] == b"RIFF" if isinstance(item, bytes) else str(key).lower().endswith(".wav")
    try:
        if is_wav:
            with wave.open(io.BytesIO(item) if isinstance(item, bytes) else key, "rb") as w:
                if w.getsampwidth() != 2:
                    raise ValueError(f"only 16-bit PCM WAV is supported, got {8 * w.getsampwidth()}-bit")
                header = (w.getnframes(), w.getframerate())
        else:
            import soundfile

            info = soundfile.info(io.BytesIO(item) if isinstance(item, bytes) else key)
            header = (int(info.frames), int(info.samplerate))
    except Exception as exc:
        raise SampleError(f"cannot decode audio {item}: {decode_reason(exc, key if key is not None else item)}") \
            from exc
    if header[0] == 0:
        raise SampleError(f"audio file {item} has no samples")
    if key is not None:
        memo.audios[key] = header
    return header


def _video_header(item: str | MediaBytes, memo: Headers) -> VideoHeader:
    """The video's :class:`VideoHeader` (no frame decoded), memoised by path. Raises SampleError like
    ``load_video``."""
    key = None if isinstance(item, bytes) else str(item)
    if key is not None and key in memo.videos:
        return memo.videos[key]
    header = read_video_header(item)
    if key is not None:
        memo.videos[key] = header
    return header


def _processed_image_size(spec: Any, size: tuple[int, int], memo: Headers) -> tuple[int, int]:
    """``(H, W)`` of ``spec.hf_processor``'s output for an input of ``size = (width, height)``."""
    key = (id(spec), *size)
    if key not in memo.processed:
        blank = Image.new("RGB", size)
        memo.processed[key] = process_image(spec.hf_processor, blank)[1]
    return memo.processed[key]


def _crop_sizes(processor: MultimodalProcessor, size: tuple[int, int], memo: Headers) -> list[tuple[int, int]]:
    """``(H, W)`` of the processed original and of each crop of an image of ``size = (width, height)`` under the
    image branch's pan-and-scan (:class:`plait.data.pan_and_scan.PanAndScan`)."""
    key = (id(processor.crops), -1, *size)
    if key not in memo.processed:
        memo.processed[key] = [crop.size for crop in processor.crops.items(Image.new("RGB", size), "blank")]
    return memo.processed[key]


def _item_tokens(kind: str, spec: Any, item: str | MediaBytes, memo: Headers, processor: MultimodalProcessor
                 ) -> list[Any]:
    """Placeholder tokens of each encoder item of one media item (one for an image or a clip, one per frame for a
    video with the default encoding), from its header; the checks of the decoding path. A video with its audio track
    (``spec.video.audio``) adds ``(audio branch, tokens)`` of the decoded track; a video whose encoding writes text
    around its items adds ``(None, (text, video))``, the text tokenized in context by :func:`_expanded_meta`."""
    audio = processor.specs.get("audio")
    if kind == "video":
        header = _video_header(item, memo)
        indices = spec.video.frame_indices(header, item)
        frame = _processed_image_size(spec, (header.width, header.height), memo)
        try:
            sizes = spec.video.encoding.sizes(len(indices), frame)
        except ValueError as exc:  # the family's encoding refuses the frames
            raise SampleError(f"video {item}: {exc}") from exc
        if processor.video_wrapper is not None:  # Qwen3-VL: timestamps and wrappers around the items
            text = spec.video.encoding.text(spec.video.placeholder, indices, float(header.rate), sizes)
            return [*_counts(spec, sizes, item), (None, (text, item))]
        if spec.video.audio and audio is not None:  # the track decoded: its samples after resampling count
            check_clip_video(spec.video, len(sizes), spec.video.encoding.timing(1.0), item)
            key = item if isinstance(item, bytes) else str(item)
            if key not in memo.tracks:
                memo.tracks[key] = len(load_audio_track(item, int(audio.hf_processor.sampling_rate), spec.video))
            return [*_counts(spec, sizes, item), (audio.encoder, *_counts(audio, [memo.tracks[key]], item))]
    elif kind == "image":
        if isinstance(item, Crop):  # an original or crop of a pan-and-scan image
            sizes = [_crop_sizes(processor, _image_size(item.source, memo), memo)[item.index]]
        else:
            sizes = [_processed_image_size(spec, _image_size(item, memo), memo)]
    else:
        frames, rate = _audio_header(item, memo)
        expected = int(spec.hf_processor.sampling_rate)
        if rate != expected:
            raise SampleError(f"audio {item} is sampled at {rate} Hz; the feature extractor expects {expected} Hz")
        sizes = [frames]
    return _counts(spec, sizes, item)


def _counts(spec: Any, sizes: list[Any], item: Any) -> list[int | tuple[str, int]]:
    """The branch's feature count of each size, errors naming ``item``."""
    try:
        return [spec.feature_count(size) for size in sizes]
    except ValueError as exc:
        raise SampleError(f"{item}: {exc}") from exc


def record_metadata(processor: MultimodalProcessor, raw: Any, prompt_only: bool = False,
                    memo: Headers | None = None) -> SampleMeta:
    """The :class:`SampleMeta` ``processor(raw, prompt_only)`` would give, from media headers only.

    Raises:
        SampleError: for what the processor refuses and headers show (template failure, no answer tokens, a
            placeholder/item count mismatch, a modality without encoder, a missing or unreadable media header,
            a wrong sampling rate, a too long clip or sequence), naming the record and its file and line.
    """
    try:
        return _record_metadata(processor, raw, prompt_only, memo or Headers())
    except SampleError as exc:
        raise SampleError(f"record {raw.id!r} ({raw.source}): {exc}") from exc


def _record_metadata(processor: MultimodalProcessor, raw: Any, prompt_only: bool, memo: Headers) -> SampleMeta:
    messages = list(raw.messages[:-1] if prompt_only else raw.messages)
    if processor.crops is not None:  # Gemma 3's pan-and-scan: the crop count from the image size
        crops = [processor.crops.count(*_image_size(it, memo)) for it in raw.media.get("image", ())]
        raw, messages = processor.crops.apply(raw, messages, [[Crop(it, k, n) for k in range(n + 1)]
                                                              for it, n in zip(raw.media.get("image", ()), crops)])
    if prompt_only:
        ids = render_prompt(processor.tokenizer, messages)
        answer = [0] * len(ids)
    else:
        ids, answer = render_with_assistant_mask(processor.tokenizer, messages)
        if not any(answer):
            raise SampleError("the chat template marked no assistant tokens (empty answer?)")
    ids, answer = processor.unwrap(ids, answer)
    processor.check_placeholders(raw.media, ids)
    counts = {pid: [_item_tokens(kind, spec, it, memo, processor) for it in raw.media.get(kind, ())]
              for kind, (spec, pid, _) in processor.placeholders().items()}
    return _expanded_meta(processor, raw, ids, answer, counts)


def _expanded_meta(processor: MultimodalProcessor, raw: Any, ids: list[int], answer: list[int],
                   counts: dict[int, list[list[Any]]]) -> SampleMeta:
    """Counts of the expanded sequence (each placeholder repeated by its encoder items' tokens; ``counts``: per
    placeholder id, per occurrence, the tokens of each encoder item, and a video's ``(None, (text, video))``: its
    text tokenized with the text stretch before it, :func:`plait.data.video.framed_video_ids`), as the processor
    lays it out: ``target_tokens`` counts answer tokens at positions >= 1 (a label is the next token)."""
    encoder = {pid: spec.encoder for spec, pid, _ in processor.placeholders().values()}
    seen = dict.fromkeys(encoder, 0)
    items: list[tuple[str, int]] = []
    length = text = targets = 0
    first_answer = None
    stretch: list[int] = []  # text tokens since the last added or answer token (processing.text_stretch)
    for tok, is_answer in zip(ids, answer):
        if tok in encoder:
            entry = counts[tok][seen[tok]]
            for count in entry:  # (branch, n): a video's audio track; (None, (text, video)): a video's text
                name, n = count if isinstance(count, tuple) else (encoder[tok], count)
                if name is None:  # the run replaces the stretch before it
                    sizes = [c for c in entry if not isinstance(c, tuple)]
                    image = processor.specs["image"]
                    run, _ = framed_video_ids(processor.tokenizer, image.video, image.placeholder_id, n[0], sizes,
                                              n[1], stretch)
                    extra = len(run) - len(stretch) - sum(sizes)
                    length, text = length + extra, text + extra
                    continue
                items.append((name, n))
                first_answer = 0 if first_answer is None and n else first_answer
                length += n
            seen[tok] += 1
            stretch = []
            continue
        if tok in processor.splitting or is_answer:
            stretch = []
        else:
            stretch.append(tok)
        first_answer = int(is_answer) if first_answer is None else first_answer
        length, text, targets = length + 1, text + 1, targets + int(is_answer)
    if length > processor.max_length:
        raise SampleError(f"{length} tokens is longer than data.max_length={processor.max_length}")
    return SampleMeta(raw.id, raw.task, length, text, targets - (first_answer or 0), tuple(items))
