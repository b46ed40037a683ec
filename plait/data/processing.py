"""MultimodalProcessor: a conversation with media -> token ids, next-token labels and encoder inputs.

Steps for one sample: the tokenizer's chat template renders the conversation (assistant tokens marked
by the template's ``{% generation %}`` blocks, or found by rendering turn by turn for any other template:
:mod:`plait.data.chat_template`), each placeholder token is expanded to as many copies as
its encoder will emit features (the encoder's own feature-count function), media are decoded and run
through the Hugging Face image processor / feature extractor, and labels are the next token where that
token belongs to an assistant answer (-100 elsewhere: prompt, placeholders, padding). A video's sampled frames
(:mod:`plait.data.video`) become image items of the image branch (:class:`PerFrame`, or the family's encoding), so
its placeholder expands to the image placeholder, frames x per-frame features times; with the video's audio track
(``VideoSpec.audio``: a :class:`Clip`), to the video's and the track's tokens interleaved by chunks of seconds; with an
encoding that writes text around its items (Qwen3-VL's timestamps: a :class:`FramedVideo`), to that text, the
record's start and end tokens around the placeholder dropped (:func:`unwrap_videos`).
"""

from __future__ import annotations

import os
import re
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from plait.data.chat_template import render_prompt, render_with_assistant_mask
from plait.data.sources import RawSample, SampleError, path_note
from plait.data.omni_positions import clip_runs, clip_wrapper_error, document_positions
from plait.data.pan_and_scan import Crop, PanAndScan
from plait.data.video import VideoSpec, framed_video_ids, load_audio_track, load_sampled, text_stretch

__all__ = ["ModalitySpec", "SampleMeta", "ProcessedSample", "MultimodalProcessor", "PerFrame", "Clip", "load_audio",
           "load_image", "process_image", "decode_reason", "check_clip_video", "FramedVideo", "unwrap_videos"]

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
        video: for an image branch that also takes videos, how (:class:`plait.data.video.VideoSpec`: placeholder,
            frame sampling, the family's encoding of frames into image items), else None.
    """

    encoder: str
    modality: str
    placeholder: str
    placeholder_id: int
    hf_processor: Any
    feature_count: Callable[[Any], int]
    check_item: Callable[[dict[str, Any]], None] | None = None
    video: VideoSpec | None = None


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
            ``input_features [mel, T]`` + ``num_samples``), in sequence order; a video gives its encoding's items
            (one per frame by default).
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
        raise SampleError(f"cannot decode image {path}: {decode_reason(exc, path, source, 'image data')}") from exc


def process_image(hf_processor: Any, image: Image.Image) -> tuple[dict[str, Any], tuple[int, ...]]:
    """One image through its Hugging Face image processor: ``(item, size)``, ``size`` being what the encoder's
    feature-count function takes.

    Fixed-grid processors (CLIP, SigLIP, ViT): ``item = {"pixel_values": [C, H, W]}``, ``size = (H, W)`` pixels.
    SigLIP2 NaFlex (output with ``spatial_shapes``): ``item = {"pixel_values": [h*w, C*p*p], "spatial_shapes":
    [2]}`` with only the ``h * w`` real patches (the processor pads to ``max_num_patches``), ``size = (h, w)``
    patches. Qwen2.5-VL (output with ``image_grid_thw``): ``item = {"pixel_values": [t*h*w, C*T*p*p],
    "image_grid_thw": [3]}``, ``size = (t, h, w)`` patches. InternVL tiling (output with ``num_patches``):
    ``item = {"pixel_values": [t, C, S, S]}`` (every tile, the thumbnail last), ``size = (t, S, S)``.
    """
    out = hf_processor(images=[image], return_tensors="pt")
    if "image_grid_thw" in out:  # Qwen2.5-VL: the patches of the (t, h, w) grid, flattened
        grid = out["image_grid_thw"][0].long()
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, tuple(int(g) for g in grid)
    if "num_patches" in out:  # InternVL / GOT-OCR2 dynamic tiling: every tile of the image (thumbnail last)
        tiles = out["pixel_values"]
        return {"pixel_values": tiles}, (int(tiles.shape[0]), int(tiles.shape[-2]), int(tiles.shape[-1]))
    if "spatial_shapes" in out:
        shape = out["spatial_shapes"][0].long()
        h, w = int(shape[0]), int(shape[1])
        return {"pixel_values": out["pixel_values"][0, : h * w], "spatial_shapes": shape}, (h, w)
    pixels = out["pixel_values"][0]
    return {"pixel_values": pixels}, (int(pixels.shape[-2]), int(pixels.shape[-1]))


@dataclass(frozen=True)
class Clip:
    """A video with its audio track (``VideoSpec.audio``): the video's one item of the image branch and the audio
    track's item of the audio branch, each with its tokens, and the order their tokens take in the text
    (``runs``: ``[("video", n), ("audio", n), ...]``, :func:`plait.data.omni_positions.clip_runs`)."""

    video: tuple[dict[str, Any], int]
    audio: tuple[dict[str, Any], int]
    runs: list[tuple[str, int]]


@dataclass(frozen=True)
class FramedVideo:
    """A video whose encoding writes text around its items: its items with their tokens, that ``text``
    (``VideoSpec.encoding.text``, tokenized with the text before it by :func:`plait.data.video.framed_video_ids`)
    and the video, for errors."""

    items: list[tuple[dict[str, Any], int]]
    text: str
    video: Any


def unwrap_videos(ids: list[int], mask: list[int], placeholder_id: int,
                  wrapper: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """``ids`` and ``mask`` without the ``wrapper`` tokens (start, end) right around each video placeholder, as
    ``Qwen3VLProcessor`` collapses the chat template's ``<|vision_start|><|video_pad|><|vision_end|>`` before writing
    a video's own run; unchanged for ``wrapper`` None."""
    if wrapper is None:
        return ids, mask
    drop = {j for k in range(1, len(ids) - 1)
            if ids[k] == placeholder_id and (ids[k - 1], ids[k + 1]) == tuple(wrapper) for j in (k - 1, k + 1)}
    keep = [k for k in range(len(ids)) if k not in drop]
    return [ids[k] for k in keep], [mask[k] for k in keep]


def check_clip_video(video: VideoSpec, items: int, timing: dict[str, Any], path: Any) -> None:
    """Refuse taking a video's audio track (``video.audio``) unless the branch encodes the video as one item
    (``items``) whose ``timing`` carries the thinker's ``seconds_per_chunk`` (Qwen2.5-Omni's temporal patches).

    Raises:
        SampleError: naming the video ``path`` and the field.
    """
    if items != 1 or "seconds_per_chunk" not in timing:
        raise SampleError(f"video {path}: {video.field}.audio = true needs a tower that encodes a video as one timed "
                          "item of temporal patches (Qwen2.5-Omni's)")


@dataclass(frozen=True)
class PerFrame:
    """The default :class:`plait.data.video.VideoEncoding` of an image branch: every sampled frame is one image item
    (:func:`process_image`), so a video's placeholder expands to frames x per-frame features."""

    def items(self, hf_processor: Any, frames: list[Image.Image]) -> list[tuple[dict[str, Any], Any]]:
        """Each frame through :func:`process_image`: ``[(item, size), ...]``."""
        return [process_image(hf_processor, frame) for frame in frames]

    def sizes(self, frames: int, frame_size: Any) -> list[Any]:
        """``frame_size`` (one processed frame's size) once per frame."""
        return [frame_size] * frames

    def timing(self, fps: float) -> dict[str, float]:
        """Nothing: each frame is an image, positioned as one."""
        return {}


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
        raise SampleError(f"cannot decode audio {path}: {decode_reason(exc, path, source)}") from exc
    if data.size == 0:
        raise SampleError(f"audio file {path} has no samples")
    return data.astype(np.float32), int(rate)


def decode_reason(exc: BaseException, path: str | bytes, source: Any = None, content: str = "audio frames") -> str:
    """Why a media file (a path, or embedded bytes read through ``source``) could not be decoded, in words: an
    empty file reads ``no audio frames (empty file, 0 bytes)`` (``content`` names what is missing), a file that
    ends inside its header (the standard library's bare ``EOFError``) ``no audio frames (the file ends inside its
    header: truncated)``; otherwise the decoder's message without a dangling ``": "`` (libsndfile's ``Error opening
    '<path>': ``), or the exception's type when it has none. For embedded bytes the decoder's
    ``<_io.BytesIO object at 0x...>`` reads "the embedded bytes" (a file path stays as the decoder wrote it)."""
    embedded = isinstance(path, bytes)
    size = len(path) if embedded else (os.path.getsize(path) if os.path.isfile(path) else None)
    if size == 0:
        return f"no {content} (empty file, 0 bytes)"
    reason = str(exc).strip()
    if embedded and source is not None:
        reason = reason.replace(repr(source), "the embedded bytes")
    if isinstance(exc, EOFError):
        return f"no {content} (the file ends inside its header: truncated{'; ' + reason if reason else ''})"
    return reason.rstrip(":").rstrip() or type(exc).__name__


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
        specs: one :class:`ModalitySpec` per encoder branch (at most one branch per modality); the image branch's
            ``video`` takes the records' videos (each expands into image items of that branch,
            :mod:`plait.data.video`).
        max_length: longest sequence in tokens; longer samples are refused, never cut through a span.

    Raises:
        ValueError: when two specs share a modality, a placeholder is not a single token, or two placeholders
            are the same token.
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
        image = self.specs.get("image")
        if image is not None and image.video is not None and image.video.audio and "audio" not in self.specs:
            raise ValueError(f"{image.video.field}.audio = true but the model has no audio encoder for the videos' "
                             "audio tracks")
        self.video_wrapper = self._video_wrapper()
        self.crops = PanAndScan.of(tokenizer, image)
        """Gemma 3's pan-and-scan of the image branch, or None (:mod:`plait.data.pan_and_scan`)."""
        self.splitting = set(tokenizer.added_tokens_decoder) if self.video_wrapper is not None else set()
        """Added tokens (a string is split at them before it is tokenized): where a video's text stretch starts."""
        ids = [pid for _, pid, _ in self.placeholders().values()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"placeholders must be distinct tokens, got {list(self.placeholders())} -> {ids}")

    def _video_wrapper(self) -> tuple[int, int] | None:
        """The ids of the image branch's video encoding's ``wrapper`` tokens, or None (also when the video
        placeholder is no token: the job takes no videos, and each video record is refused by its own check).

        Raises:
            ValueError: when one is not a single token of the tokenizer (naming the video field).
        """
        image = self.specs.get("image")
        wrapper = getattr(image.video.encoding, "wrapper", None) if image is not None and image.video else None
        if wrapper is None or image.video.placeholder_id is None:
            return None
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in wrapper]
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise ValueError(f"{image.video.field}: the tower's videos need {list(wrapper)} as tokens of the tokenizer")
        return int(ids[0]), int(ids[1])

    def unwrap(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """:func:`unwrap_videos` of a rendered sample for this processor's video placeholder and wrapper."""
        video = self.placeholders().get("video")
        return (ids, mask) if video is None else unwrap_videos(ids, mask, video[1], self.video_wrapper)

    def placeholders(self) -> dict[str, tuple[ModalitySpec, int, str]]:
        """Per kind of media a record holds (``"image"``, ``"audio"``, ``"video"``: the keys of
        :attr:`RawSample.media`) that this processor takes: ``(branch spec, placeholder id, placeholder)``. Videos
        go to the image branch whose ``video`` placeholder is a token."""
        out = {m: (s, s.placeholder_id, s.placeholder) for m, s in self.specs.items()}
        image = self.specs.get("image")
        if image is not None and image.video is not None and image.video.placeholder_id is not None:
            out["video"] = (image, image.video.placeholder_id, image.video.placeholder)
        return out

    def check_placeholders(self, media: dict[str, tuple[Any, ...]], ids: list[int]) -> None:
        """Refuse a record whose media do not match its placeholders.

        Raises:
            SampleError: for items of a kind no branch takes (naming the video placeholder field when the
                placeholder is not a token) or a placeholder/item count mismatch.
        """
        kinds = self.placeholders()
        for kind, items in media.items():
            if items and kind not in kinds:
                raise SampleError(f"has {len(items)} {kind} item(s) but {self._no_branch(kind)}")
        for kind, (_, pid, placeholder) in kinds.items():
            n_items, n_placeholders = len(media.get(kind, ())), sum(1 for t in ids if t == pid)
            if n_placeholders != n_items:
                raise SampleError(f"{n_placeholders} {placeholder} placeholder(s) in the text but {n_items} {kind} "
                                  "item(s)")

    def _no_branch(self, kind: str) -> str:
        image = self.specs.get("image")
        if kind == "video" and image is not None and image.video is not None:
            return (f"the video placeholder {image.video.placeholder!r} is not a token of the tokenizer "
                    f"({image.video.field}.placeholder)")
        if kind == "video":
            return "the model has no image encoder to encode video frames"
        return f"the model has no {kind} encoder"

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
        if self.crops is not None:  # each image: its original and crops, the processor's text around them
            images = [self.crops.items(load_image(p), p) for p in sample.media.get("image", ())]
            sample, messages = self.crops.apply(sample, messages, images)
        ids, assistant = self.unwrap(*self._render(messages, prompt_only))
        media = self._media(sample, ids)
        inputs: dict[str, list[dict[str, Any]]] = {s.encoder: [] for s in self.specs.values()}
        out_ids: list[int] = []
        out_mask: list[int] = []
        out_item: list[int] = []
        kinds = self.placeholders()
        by_id = {pid: kind for kind, (_, pid, _) in kinds.items()}
        cursors = dict.fromkeys(by_id.values(), 0)
        items: list[tuple[str, int]] = []
        ordered: list[tuple[dict[str, Any], str]] = []  # each item and the record field it came from
        clips: list[tuple[int, int, dict[str, Any], str]] = []  # each clip's token span, video item and field
        for tok, is_answer in zip(ids, assistant):
            kind = by_id.get(tok)
            if kind is None:
                out_ids.append(tok)
                out_mask.append(is_answer)
                out_item.append(-1)
                continue
            spec, entry = kinds[kind][0], media[kind][cursors[kind]]
            if isinstance(entry, Clip):  # a video with its audio track: two items, their tokens interleaved
                first, start = len(items), len(out_ids)
                for what, (item, n) in (("video", entry.video), ("audio", entry.audio)):
                    branch = spec if what == "video" else self.specs["audio"]
                    items.append((branch.encoder, n))
                    inputs[branch.encoder].append(item)
                    ordered.append((item, self._field(sample, kind, cursors[kind])))
                for what, n in entry.runs:
                    pid = spec.placeholder_id if what == "video" else self.specs["audio"].placeholder_id
                    out_ids += [pid] * n
                    out_mask += [0] * n
                    out_item += [first + (what == "audio")] * n
                clips.append((start, len(out_ids), entry.video[0], self._field(sample, kind, cursors[kind])))
                cursors[kind] += 1
                continue
            if isinstance(entry, FramedVideo):  # text around the items (Qwen3-VL's timestamps)
                first, start = len(items), text_stretch(out_ids, out_mask, out_item, self.splitting)
                run, local = framed_video_ids(self.tokenizer, spec.video, spec.placeholder_id, entry.text,
                                              [n for _, n in entry.items], entry.video, out_ids[start:])
                for item, n in entry.items:
                    items.append((spec.encoder, n))
                    inputs[spec.encoder].append(item)
                    ordered.append((item, self._field(sample, kind, cursors[kind])))
                out_ids[start:], out_mask[start:] = run, [0] * len(run)
                out_item[start:] = [first + k if k >= 0 else -1 for k in local]
                cursors[kind] += 1
                continue
            for item, n in entry:  # a video: one item per frame (or temporal group)
                out_ids += [spec.placeholder_id] * n
                out_mask += [0] * n
                out_item += [len(items)] * n
                items.append((spec.encoder, n))
                inputs[spec.encoder].append(item)
                ordered.append((item, self._field(sample, kind, cursors[kind])))
            cursors[kind] += 1
        if len(out_ids) > self.max_length:
            raise SampleError(f"{len(out_ids)} tokens is longer than data.max_length={self.max_length}")
        for start, end, video, field in clips:  # each clip inside its thinker's start and end tokens
            if (wrong := clip_wrapper_error(self.tokenizer, out_ids, start, end, video)) is not None:
                raise SampleError(f"{field}: {wrong}")
        input_ids = torch.tensor(out_ids, dtype=torch.long)
        self._check_positions(input_ids, torch.tensor(out_item), ordered)
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

    @staticmethod
    def _field(sample: RawSample, kind: str, index: int) -> str:
        """``videos[1] (path)``: where a media item is in the record."""
        path = sample.media[kind][index]
        return f"{kind}s[{index}] ({path if isinstance(path, str) else 'embedded bytes'})"

    @staticmethod
    def _check_positions(input_ids: torch.Tensor, item_ids: torch.Tensor,
                         ordered: list[tuple[dict[str, Any], str]]) -> None:
        """Refuse a record the collator could not position (M-RoPE: :func:`plait.data.omni_positions.
        document_positions`), e.g. two videos with no text token between them, naming each item it names.

        Raises:
            SampleError: with the positions' reason and the record fields of the items it names.
        """
        try:
            document_positions(input_ids, item_ids, [item for item, _ in ordered])
        except ValueError as exc:
            named = sorted({int(i) for i in re.findall(r"item (\d+)", str(exc))})
            where = "; ".join(f"item {i} is {ordered[i][1]}" for i in named if i < len(ordered))
            raise SampleError(f"{exc}" + (f" ({where})" if where else "")) from exc

    def _render(self, messages: list[dict[str, str]], prompt_only: bool) -> tuple[list[int], list[int]]:
        if prompt_only:
            ids = render_prompt(self.tokenizer, messages)
            return ids, [0] * len(ids)
        ids, mask = render_with_assistant_mask(self.tokenizer, messages)
        if not any(mask):
            raise SampleError("the chat template marked no assistant tokens (empty answer?)")
        return ids, mask

    def _media(self, sample: RawSample, ids: list[int]) -> dict[str, list[list[tuple[dict[str, Any], int]]]]:
        """Per media kind, per item in placeholder order, its encoder items and their tokens (one for an image or
        a clip, one per frame for a video)."""
        self.check_placeholders(sample.media, ids)
        return {kind: [self._item(kind, spec, p) for p in sample.media.get(kind, ())]
                for kind, (spec, _, _) in self.placeholders().items()}

    def _item(self, kind: str, spec: ModalitySpec, path: str
              ) -> list[tuple[dict[str, Any], int]] | Clip | FramedVideo:
        if kind == "video":
            video = load_sampled(path, spec.video)
            try:
                items = spec.video.encoding.items(spec.hf_processor, video.frames)
                timing = spec.video.encoding.timing(video.fps)  # Qwen2.5-VL: the video's M-RoPE time step
            except ValueError as exc:  # the family's encoding refuses the frames
                raise SampleError(f"video {path}: {exc}") from exc
            out = [(self._checked(spec, {**item, **timing}, path), self._count(spec, size, path))
                   for item, size in items]
            if self.video_wrapper is not None:
                sizes = [size for _, size in items]
                return FramedVideo(out, spec.video.encoding.text(spec.video.placeholder, video.indices, video.rate,
                                                                 sizes), path)
            return self._clip(spec, path, out) if spec.video.audio else out
        if isinstance(path, Crop):  # one original or crop of a pan-and-scan image
            return [(self._checked(spec, path.item, path), self._count(spec, path.size, path))]
        if kind == "image":
            item, size = process_image(spec.hf_processor, load_image(path))
            return [(self._checked(spec, item, path), self._count(spec, size, path))]
        data, rate = load_audio(path)
        expected = int(spec.hf_processor.sampling_rate)
        if rate != expected:
            raise SampleError(f"audio {path} is sampled at {rate} Hz; the feature extractor expects {expected} Hz")
        return [self._audio_item(spec, data, path)]

    def _audio_item(self, spec: ModalitySpec, data: np.ndarray, path: str) -> tuple[dict[str, Any], int]:
        """A clip's item (``input_features`` of the feature extractor, ``num_samples``) and its tokens."""
        count = self._count(spec, len(data), path)
        feats = spec.hf_processor(data, sampling_rate=int(spec.hf_processor.sampling_rate),
                                  return_tensors="pt")["input_features"][0]
        return self._checked(spec, {"input_features": feats, "num_samples": len(data)}, path), count

    def _clip(self, spec: ModalitySpec, path: str, video: list[tuple[dict[str, Any], int]]) -> Clip:
        """The :class:`Clip` of a video's one temporal-patch item ``video`` and its audio track.

        Raises:
            SampleError: for a video of several items (per-frame images: the clip needs one video item with its
                timing), or as :func:`plait.data.video.load_audio_track`.
        """
        check_clip_video(spec.video, len(video), video[0][0] if video else {}, path)
        audio_spec = self.specs["audio"]
        data = load_audio_track(path, int(audio_spec.hf_processor.sampling_rate), spec.video)
        audio = self._audio_item(audio_spec, data, path)
        (item, n_video), = video
        item = {**item, "audio_track": True}
        try:
            runs = clip_runs(item, n_video, audio[1])
        except ValueError as exc:
            raise SampleError(f"video {path}: {exc}") from exc
        return Clip((item, n_video), audio, runs)

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
