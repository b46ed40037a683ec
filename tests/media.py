"""Tiny media made in tests: videos written with PyAV (a few frames, a few KB) and a tokenizer with ``<video>``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers.jobs import DEMO

_FORMATS = {".mp4": ("mp4", "mpeg4"), ".mkv": ("matroska", "ffv1"), ".webm": ("webm", "libvpx")}


def frame_array(index: int, width: int, height: int) -> np.ndarray:
    """Frame ``index`` of a test video: ``[height, width, 3]`` uint8, a flat grey of level ``20 + 30 * index``
    (mod 250) with a white left column, so frames differ and decoded frames can be matched to their index."""
    arr = np.full((height, width, 3), (20 + 30 * index) % 250, np.uint8)
    arr[:, 0] = 255
    return arr


def write_video(path: Path, frames: int, width: int = 32, height: int = 24, rate: int = 4, codec: str | None = None,
                gop: int | None = None) -> Path:
    """Write a video of ``frames`` frames (:func:`frame_array`) at ``rate`` frames per second; the container and
    codec follow the extension (``.mp4``: MPEG-4 part 2, whose header counts the frames; ``.mkv``: FFV1 in
    Matroska and ``.webm``: VP8, whose headers give only the duration) unless ``codec`` names another
    (``"libx264"``); ``gop``: frames between keyframes. ``frames = 0`` writes a stream without frames."""
    import av

    fmt, default = _FORMATS[path.suffix]
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream(codec or default, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.gop_size = gop
        container.start_encoding()  # the header, even without frames
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_array(i, width, height), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def write_image(path: Path, width: int, height: int, level: int = 128) -> Path:
    """An RGB PNG of ``width x height`` pixels (a flat grey with a white top row)."""
    arr = np.full((height, width, 3), level, np.uint8)
    arr[0] = 255
    Image.fromarray(arr).save(path)
    return path


def video_tokenizer(folder: Path) -> Path:
    """The demo tokenizer with ``<video>`` added as a special token, saved in ``folder``; returns it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": ["<video>"]}, replace_extra_special_tokens=False)
    tok.save_pretrained(folder)
    return folder
