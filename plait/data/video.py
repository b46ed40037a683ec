"""Video records: headers, frame sampling, decoding and the per-branch encoding hook.

A record's ``videos`` (file paths, or encoded bytes embedded in the data file) fill the ``<video>`` placeholders of
its text in order. A video is fed to the job's image branch: its frames are sampled at ``fps`` frames per second of
video (:func:`sample_indices`, from the stream's header alone), each sampled frame goes through the branch's image
processor like an image, and the branch's :class:`VideoEncoding` turns the frames into encoder items. The default
(:class:`plait.data.processing.PerFrame`) makes every frame one image item, so a video's placeholder expands to
``frames x per-frame features`` tokens of the branch's image placeholder; a tower with temporal patches (Qwen2.5-VL)
supplies its own encoding (``ModalityEncoder.video_encoding``).

Decoding uses PyAV (``av``: Python bindings to FFmpeg whose wheels bundle the FFmpeg libraries, so nothing has to
be installed on the system; torchcodec needs the system's FFmpeg libraries). :func:`read_video_header` reads the
container and stream headers only (no frame is decoded): the metadata pass (:mod:`plait.data.metadata`) counts a
video's tokens from it; :func:`load_video` decodes the sampled frames when the sample is loaded (seeking to the
keyframe before a sampled frame that lies more than :data:`SEEK_GAP_S` ahead, so a long video sampled sparsely is not
decoded whole).
"""

from __future__ import annotations

import errno
import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple, Protocol, Sequence

from PIL import Image

from plait.data.sources import SampleError, path_note

__all__ = ["VideoHeader", "VideoEncoding", "VideoSpec", "read_video_header", "sample_indices",
           "load_video", "load_sampled", "SampledVideo", "framed_video_ids", "text_stretch", "load_audio_track",
           "SEEK_GAP_S"]


ESTIMATE_SLACK_S = 1.0
"""Seconds of frames a stream whose frame count was estimated from a duration (``VideoHeader.estimated``) may end
early by without being a truncated file: an audio track's tail (AAC priming and padding) outlasts the video."""

@dataclass(frozen=True)
class VideoHeader:
    """What a video's headers say, without decoding a frame.

    Attributes:
        frames: frames of the video stream (the stream's count, else duration x frame rate, rounded).
        rate: frames per second of the stream (its average rate), exact.
        width, height: frame size in pixels.
        estimated: ``frames`` comes from a duration, not a frame count (Matroska/WebM store none). A container's
            duration may include an audio track that outlasts the video, so a stream beside an audio track may end
            up to :data:`ESTIMATE_SLACK_S` of frames early: those sampled frames repeat the stream's last one.
    """

    frames: int
    rate: Fraction
    width: int
    height: int
    estimated: bool = False

    @property
    def duration_s(self) -> float:
        """Length in seconds (``frames / rate``)."""
        return float(self.frames / self.rate)


class VideoEncoding(Protocol):
    """How an image branch turns a video's sampled frames into encoder items (the family hook).

    ``items(hf_processor, frames)``: the frames (RGB PIL images, in time order) as ``[(item, size), ...]``: each an
    item of the branch's encoder inputs (as :func:`plait.data.processing.process_image` returns for an image) and
    the size its feature-count function takes. ``timing(fps)``: the entries every item of a video sampled at ``fps``
    frames per second of video (:meth:`VideoSpec.sampled_fps`) also carries for its positions (Qwen2.5-VL's
    ``second_per_grid_t`` and ``tokens_per_second``, :mod:`plait.data.mrope`); empty for per-frame images. ``sizes(frames, frame_size)``: the same sizes from the number of
    sampled frames and the size one processed frame has (``process_image``'s size), for the metadata pass, which
    decodes nothing. ``len(items(...)) == len(sizes(...))`` and the sizes are equal.

    An encoding that writes text around its items (Qwen3-VL's timestamps) also has ``wrapper`` (the start and end
    tokens that surround a video's placeholder in a record and that its text replaces) and ``text(placeholder,
    indices, rate, sizes)``: the video's text from the sampled frame indices and the stream's frame rate, with
    ``placeholder`` once per feature of each item (:func:`framed_video_ids`).
    """

    def items(self, hf_processor: Any, frames: Sequence[Image.Image]) -> list[tuple[dict[str, Any], Any]]: ...

    def timing(self, fps: float) -> dict[str, float]: ...

    def sizes(self, frames: int, frame_size: Any) -> list[Any]: ...


@dataclass(frozen=True)
class VideoSpec:
    """How an image branch takes videos: placeholder, sampling and encoding.

    Attributes:
        placeholder: the video placeholder in the text (``"<video>"``).
        placeholder_id: its token id, or None when it is not a single token of the tokenizer (a record with
            videos is then refused, naming the field).
        fps: frames sampled per second of video; 0 samples every frame.
        max_frames: most frames a video may give (more is a bad record, naming the field).
        field: the config table of these settings, for error messages (``"model.encoders.vision.video"``).
        encoding: the branch's :class:`VideoEncoding` (``plait.data.processing.PerFrame``: an item per frame).
        audio: the video's audio track goes in with its frames to the audio branch (:func:`load_audio_track`; the
            clip's tokens interleave by the encoding's ``seconds_per_chunk``, :mod:`plait.data.omni_positions`).
        saved: the trained model folder these settings were saved with, when no job table sets them (``plait
            generate``): errors then say what to give instead of which field to set; empty for a job's table.

    Raises:
        ValueError: for a negative ``fps`` or ``max_frames`` below 1 (naming the field).
    """

    placeholder: str
    placeholder_id: int | None
    fps: float
    max_frames: int
    field: str
    encoding: VideoEncoding
    audio: bool = False
    saved: str = ""

    def __post_init__(self) -> None:
        if not self.fps >= 0:
            raise ValueError(f"{self.field}.fps must be >= 0 (0: every frame), got {self.fps}")
        if self.max_frames < 1:
            raise ValueError(f"{self.field}.max_frames must be >= 1, got {self.max_frames}")

    def frame_indices(self, header: VideoHeader, item: Any) -> list[int]:
        """:func:`sample_indices` of this spec's ``fps`` / ``max_frames`` for a video (``item`` names it)."""
        return sample_indices(header, self.fps, self.max_frames, f"video {item}", self.field)

    def wants_track(self) -> tuple[str, str]:
        """Why a video's audio track is read (``audio``) and what to do about a video without one, for errors: the
        job's field and its setting, or (:attr:`saved`) the trained model's own and what to give instead."""
        if self.saved:
            return (f"the model {self.saved} takes each video with its audio track (its saved video settings: "
                    "audio = true)", "give a video with sound, or its frames as images")
        return f"{self.field}.audio = true asks for it", "give a video with sound, or set it to false"

    def sampled_fps(self, header: VideoHeader) -> float:
        """Frames per second of video that :meth:`frame_indices` gives: ``fps``, or the video's own rate when every
        frame is taken (``fps`` 0 or not below the rate); what transformers' video metadata calls ``sampled_fps``."""
        return float(self.fps) if 0 < Fraction(str(self.fps)) < header.rate else float(header.rate)


def _open(item: str | bytes) -> Any:
    """``av.open`` of a path or of embedded bytes. Raises SampleError for a missing file."""
    import av

    if not isinstance(item, bytes) and not Path(item).is_file():
        raise SampleError(f"video file {item} does not exist{path_note(item)}")
    if len(item) == 0 if isinstance(item, bytes) else Path(item).stat().st_size == 0:
        raise SampleError(f"video {item} is empty (0 bytes): zero length")
    return av.open(io.BytesIO(item) if isinstance(item, bytes) else str(item))


def read_video_header(item: str | bytes) -> VideoHeader:
    """The :class:`VideoHeader` of a video file (or embedded bytes, :class:`plait.data.sources.MediaBytes`) from its
    container and stream headers; no frame is decoded.

    Raises:
        SampleError: when the file is missing, not a readable container, a still image (an image file named as a
            video: FFmpeg's image readers), has no video stream, or has no frames (zero length), naming the file.
    """
    try:
        with _open(item) as container:
            return _header(container, item)
    except SampleError:
        raise
    except Exception as exc:  # av.error.* for unreadable containers
        raise SampleError(f"cannot decode video {item}: {_reason(exc)}") from exc


def _header(container: Any, item: Any) -> VideoHeader:
    """The header of an open container, refusing what is no video (module docstring of :func:`read_video_header`)."""
    fmt = container.format
    if fmt.name in ("image2", "image2pipe") or fmt.name.endswith("_pipe"):  # FFmpeg's still-image readers
        raise SampleError(f"video {item} is not a video container or stream plait can decode: FFmpeg reads it as a "
                          f"still image ({fmt.long_name or fmt.name}); give an image as an image, a video as a video "
                          "file (MP4, MKV, WebM, ...)")
    if not container.streams.video:
        raise SampleError(f"video {item} has no video stream: zero length, not a video (an empty or audio-only "
                          "container), or a file cut off before its video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    if not rate or rate <= 0:
        raise SampleError(f"video {item} has no frame rate in its header")
    rate = Fraction(rate)
    frames = int(stream.frames or 0)
    estimated = frames <= 0
    if estimated:
        if stream.duration is not None and stream.time_base is not None:
            seconds = Fraction(stream.duration) * Fraction(stream.time_base)
        elif container.duration is not None:
            seconds = Fraction(container.duration, 1_000_000)  # av.time_base: microseconds
        else:
            seconds = Fraction(0)
        frames = int(round(seconds * rate))
    if frames <= 0:
        raise SampleError(f"video {item} has no frames (zero length)")
    ctx = stream.codec_context
    if ctx is None or not ctx.width or not ctx.height:
        raise SampleError(f"video {item} has no frame size in its video stream's header: the file is truncated or "
                          "damaged")
    return VideoHeader(frames, rate, int(ctx.width), int(ctx.height), estimated)


def sample_indices(header: VideoHeader, fps: float, max_frames: int, label: str = "video",
                   field: str = "video") -> list[int]:
    """Indices of the frames sampled from a video: ``ceil(frames x fps / rate)`` frames, frame ``k`` being the one
    shown at time ``k / fps`` (``floor(k x rate / fps)``); every frame when ``fps`` is 0 or not below the video's
    own rate. Exact (rational arithmetic), a function of the header only.

    Args:
        header: the video's header.
        fps: frames per second to sample (0: every frame).
        max_frames: the most frames allowed.
        label, field: the video and the config table, for the error.

    Raises:
        SampleError: when more than ``max_frames`` frames would be sampled (naming the limit and its field).
    """
    step = header.rate / Fraction(str(fps)) if fps else Fraction(1)
    if step <= 1:
        indices = list(range(header.frames))
    else:
        count = math.ceil(header.frames / step)
        indices = [math.floor(k * step) for k in range(count)]
    if len(indices) > max_frames:
        at, fix = (f"{fps:g} frames per second", "lower") if fps else ("every frame", "set")
        raise SampleError(f"{label} gives {len(indices)} frames ({header.duration_s:.2f} s sampled at {at}), more than "
                          f"{field}.max_frames = {max_frames}; raise {field}.max_frames or {fix} {field}.fps")
    return indices


def load_video(item: str | bytes, spec: VideoSpec) -> list[Image.Image]:
    """Decode the frames ``spec`` samples from a video (:meth:`VideoSpec.frame_indices` of its header), as RGB
    images in time order.

    Raises:
        SampleError: as :func:`read_video_header`, for too many frames, and when the frames cannot be decoded or the
            stream ends before a sampled frame (a truncated or corrupt file), naming the file.
    """
    return load_sampled(item, spec).frames


class SampledVideo(NamedTuple):
    """A video's sampled frames (RGB, in time order), the rate they were sampled at (frames per second of video,
    :meth:`VideoSpec.sampled_fps`), their frame indices and the stream's own frame rate."""

    frames: list[Image.Image]
    fps: float
    indices: list[int]
    rate: float


def load_sampled(item: str | bytes, spec: VideoSpec) -> SampledVideo:
    """:func:`load_video`'s frames with their sampling (:class:`SampledVideo`). Raises as :func:`load_video`."""
    try:
        with _open(item) as container:
            header = _header(container, item)
            wanted = spec.frame_indices(header, item)
            return SampledVideo(_decode(container, wanted, header, item), spec.sampled_fps(header), wanted,
                                float(header.rate))
    except SampleError:
        raise
    except Exception as exc:  # av.error.* (InvalidDataError, ...) for corrupt streams
        raise SampleError(f"cannot decode video {item}: {_reason(exc)}") from exc


SEEK_GAP_S = 2.0
"""Seconds of video between the last decoded frame and the next sampled one beyond which decoding seeks (to the
keyframe at or before the sampled frame) instead of decoding every frame in between."""


def _decode(container: Any, wanted: list[int], header: VideoHeader, item: Any) -> list[Image.Image]:
    """The frames at ``wanted`` (sorted indices) of the first video stream, in order. Frame ``i`` is the one whose
    timestamp is ``i / rate`` after the stream's start (the ``i``-th decoded frame where frames carry none); where
    the next sampled frame lies more than :data:`SEEK_GAP_S` past the last decoded one, decoding seeks to the
    keyframe before it."""
    stream = container.streams.video[0]
    timed = stream.time_base is not None
    start = stream.start_time  # None: the first frame's timestamp (the first sampled frame is frame 0)
    per_frame = 1 / (header.rate * Fraction(stream.time_base)) if timed else Fraction(1)  # timestamp units a frame
    gap = SEEK_GAP_S * float(header.rate)  # frames
    frames, out, index, last = container.decode(stream), [], -1, None
    for target in wanted:
        if timed and start is not None and target - index > gap:
            _seek(container, stream, start + int(target * per_frame))
            frames = container.decode(stream)
        for frame in frames:
            start = frame.pts if start is None else start
            index = round((frame.pts - start) / per_frame) if timed and frame.pts is not None else index + 1
            last = frame
            if index >= target:
                out.append(frame.to_image().convert("RGB"))
                break
        else:
            if (header.estimated and container.streams.audio and last is not None
                    and target - index <= ESTIMATE_SLACK_S * header.rate):
                out.append(last.to_image().convert("RGB"))  # the duration counted an audio tail: the last frame
                continue
            raise SampleError(f"cannot decode video {item}: the stream ends after {index + 1} frame(s) but its header "
                              f"says {header.frames} (frame {target} is sampled); the file is truncated or corrupt")
    return out


def _seek(container: Any, stream: Any, timestamp: int) -> None:
    """Move ``container`` to the keyframe of ``stream`` at or before ``timestamp`` (in the stream's time base)."""
    container.seek(timestamp, stream=stream, backward=True, any_frame=False)


def _reason(exc: Exception) -> str:
    """What is wrong with a video FFmpeg cannot read, in plain words, then FFmpeg's own words without its error number
    and the file name (PyAV's ``[Errno 541478725] End of file: '<path>'``): ``the file ends early: it is truncated
    (cut off while it was written, copied or downloaded) (FFmpeg: End of file)``."""
    import av

    words = getattr(exc, "strerror", None) or str(exc).split(": '<_io.BytesIO")[0] or type(exc).__name__
    if isinstance(exc, EOFError):
        plain = "the file ends early: it is truncated (cut off while it was written, copied or downloaded)"
    elif isinstance(exc, av.error.InvalidDataError):
        plain = "its data is not a video FFmpeg can read: the file is truncated, damaged, or not a video"
    elif isinstance(exc, OSError) and exc.errno == errno.EIO:
        plain = "FFmpeg cannot read its data: the file is truncated or damaged"
    else:
        plain = "FFmpeg cannot read it"
    return f"{plain} (FFmpeg: {words})"


def load_audio_track(item: str | bytes, rate: int, video: VideoSpec) -> Any:
    """The audio track of a video (its first audio stream) decoded to mono float32 samples in [-1, 1] at ``rate``
    Hz (``numpy`` ``[n]``; FFmpeg's resampler through PyAV), for a branch whose ``video.audio`` asks for it.

    Raises:
        SampleError: naming the file and why its track is read (:meth:`VideoSpec.wants_track`: the job's field, or
            the trained model's settings), when the video has no audio track or the track has no samples; as
            :func:`read_video_header` for a missing or unreadable file.
    """
    import av
    import numpy as np

    try:
        with _open(item) as container:
            if not container.streams.audio:
                why, fix = video.wants_track()
                raise SampleError(f"video {item} has no audio track, but {why} ({fix})")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=int(rate))
            chunks = []
            for frame in container.decode(container.streams.audio[0]):
                chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except SampleError:
        raise
    except Exception as exc:  # av.error.* for corrupt streams
        raise SampleError(f"cannot decode the audio track of video {item}: {_reason(exc)}") from exc
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        why, fix = video.wants_track()
        raise SampleError(f"video {item}: its audio track has no samples, but {why} ({fix})")
    return samples


def framed_video_ids(tokenizer: Any, spec: VideoSpec, image_id: int, text: str, counts: list[int], item: Any,
                     before: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """The token run of a video whose encoding writes ``text`` around its items (``spec.encoding.text``, Qwen3-VL's
    timestamps): ``(ids, local)``, ``ids`` with the branch's image placeholder ``image_id`` where the video
    placeholder stood (features replace those embeddings) and ``local`` the item of each token (its index within the
    video, -1 on text). ``counts``: each item's feature count. ``before``: the text tokens right before the video
    (back to the last added token: :func:`text_stretch`), tokenized again with the text as one piece, as the
    processor's string is (a space before the timestamp may join its ``<``); ``ids`` replaces them (tokens that do
    not decode and encode back to themselves stay as they are, at its start).

    Raises:
        SampleError: naming the video ``item`` when the text's runs of placeholders do not match ``counts``.
    """
    prefix = tokenizer.decode(list(before), clean_up_tokenization_spaces=False) if before else ""
    if tokenizer.encode(prefix, add_special_tokens=False) == list(before):
        ids = tokenizer.encode(prefix + text, add_special_tokens=False)
    else:  # not the tokens of their own text: kept, the text tokenized alone
        ids = list(before) + tokenizer.encode(text, add_special_tokens=False)
    local: list[int] = []
    runs: list[int] = []  # placeholder tokens of each run
    for k, tok in enumerate(ids):
        on = tok == spec.placeholder_id
        if on and (k == 0 or ids[k - 1] != tok):
            runs.append(0)
        if on:
            runs[-1] += 1
        local.append(len(runs) - 1 if on else -1)
    if runs != list(counts):
        raise SampleError(f"video {item}: its text gives placeholder runs {runs}, not the items' tokens {list(counts)}")
    return [image_id if t == spec.placeholder_id else t for t in ids], local


def text_stretch(ids: Sequence[int], mask: Sequence[int], items: Sequence[int], splitting: set[int]) -> int:
    """Where the trailing stretch of ``ids`` that a tokenizer reads as one piece of text starts: after the last token
    in ``splitting`` (added tokens, which split a string before it is tokenized), answer token (``mask``) or media
    token (``items`` >= 0)."""
    k = len(ids)
    while k > 0 and ids[k - 1] not in splitting and not mask[k - 1] and items[k - 1] < 0:
        k -= 1
    return k
