"""A video's timing for M-RoPE positions: the rate its frames are sampled at (``VideoSpec.sampled_fps``) and the
positions of a video item (temporal patches ``tokens_per_second x second_per_grid_t`` apart, transformers' rule)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from plait.data.mrope import mrope_positions
from plait.data.processing import PerFrame
from plait.data.video import VideoHeader, VideoSpec


def test_sampled_fps_is_the_spec_rate_below_the_video_rate_else_the_video_rate():
    header = VideoHeader(10, Fraction(4), 32, 24)
    spec = VideoSpec("<video>", 5, 3.0, 8, "model.encoders.vision.video", PerFrame())
    assert spec.sampled_fps(header) == 3.0
    assert VideoSpec("<video>", 5, 0.0, 16, "f", PerFrame()).sampled_fps(header) == 4.0  # every frame
    assert VideoSpec("<video>", 5, 8.0, 16, "f", PerFrame()).sampled_fps(header) == 4.0  # not below the rate


def test_a_video_item_is_positioned_with_its_time_step():
    # text, a video of grid (2, 4, 4) (merge 2: 2 x 2 x 2 tokens), text; 0.5 s per temporal patch x 4 per second:
    # temporal patches 2 positions apart; the text after continues at start + max(h, w) / 2
    ids = torch.tensor([1] + [9] * 8 + [2, 3])
    items = torch.tensor([-1] + [0] * 8 + [-1, -1])
    got = mrope_positions(ids, items, [(2, 4, 4)], [(0.5, 4)])
    want = torch.tensor([[0, 1, 1, 1, 1, 3, 3, 3, 3, 3, 4],
                         [0, 1, 1, 2, 2, 1, 1, 2, 2, 3, 4],
                         [0, 1, 2, 1, 2, 1, 2, 1, 2, 3, 4]])
    assert torch.equal(got, want)
    image = mrope_positions(ids, items, [(2, 4, 4)])  # as an image: temporal step 1
    assert torch.equal(image[0, 1:9], torch.tensor([1, 1, 1, 1, 2, 2, 2, 2]))
    assert torch.equal(image[1:], want[1:])


def test_videos_of_different_tokens_per_second_are_refused():
    ids = torch.tensor([1] + [9] * 4 + [2] + [9] * 4 + [3])
    items = torch.tensor([-1] + [0] * 4 + [-1] + [1] * 4 + [-1])
    with pytest.raises(ValueError, match=r"videos of tokens_per_second \[2.0, 4.0\] in one document"):
        mrope_positions(ids, items, [(1, 4, 4), (1, 4, 4)], [(1.0, 2), (1.0, 4)])
    mixed = mrope_positions(ids, items, [(1, 4, 4), (1, 4, 4)], [None, (1.0, 4)])  # an image and a video
    assert mixed.shape == (3, 11)
