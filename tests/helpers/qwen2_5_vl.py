"""Helpers of several test modules, taken from tests/unit/models/test_qwen2_5_vl.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations


# window_size 56 px = 2x2 merged blocks of 2x2 patches of 14 px: 4x4-patch windows; blocks 1 and 3 attend fully
TINY_QWEN2_5_VL = dict(model_type="qwen2_5_vl_vision", depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                       patch_size=14, window_size=56, out_hidden_size=48, fullatt_block_indexes=[1, 3],
                       temporal_patch_size=2, spatial_merge_size=2)
# min/max pixels small enough for a few patches per image
TINY_PROCESSOR = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 30)
