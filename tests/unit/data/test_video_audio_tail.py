"""A Matroska video stores no frame count, so its header's count comes from the container's duration, which an audio
track that outlasts the video lengthens: the frames sampled past the stream's end repeat its last frame (up to
``ESTIMATE_SLACK_S``), instead of the file being taken for a truncated one; a longer shortfall is still refused."""

from __future__ import annotations

import numpy as np
import pytest

from plait.data.processing import PerFrame
from plait.data.sources import SampleError
from plait.data.video import VideoSpec, load_video, read_video_header
from tests.helpers.qwen2_5_omni import write_clip


def _spec(fps: float = 0.0) -> VideoSpec:
    return VideoSpec("<video>", 5, fps, 64, "model.encoders.vision.video", PerFrame())


def test_an_audio_tail_repeats_the_last_frame(tmp_path):
    clip = write_clip(tmp_path / "tail.mkv", frames=6, rate=4, audio_s=1.9)  # video 1.5 s, audio 1.9 s
    header = read_video_header(str(clip))
    assert header.estimated and header.frames > 6  # the container's duration counts the audio's tail
    frames = load_video(str(clip), _spec())
    assert len(frames) == header.frames
    last = np.asarray(frames[5])
    assert all(np.array_equal(np.asarray(f), last) for f in frames[6:])  # the stream's last frame, repeated
    assert not np.array_equal(np.asarray(frames[4]), last)


def test_a_shortfall_longer_than_the_slack_is_refused(tmp_path):
    clip = write_clip(tmp_path / "long_tail.mkv", frames=4, rate=4, audio_s=3.0)  # video 1 s, audio 3 s
    with pytest.raises(SampleError, match=r"the stream ends after 4 frame\(s\) but its header says 12"):
        load_video(str(clip), _spec())
