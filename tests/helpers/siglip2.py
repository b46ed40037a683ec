"""Helpers of several test modules, taken from tests/unit/models/test_siglip2.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations


TINY_SIGLIP2 = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, patch_size=4, num_patches=16, num_channels=3)
