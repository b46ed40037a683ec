"""Helpers of several test modules, taken from tests/unit/models/test_qwen2_audio.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations


TINY_QWEN2_AUDIO = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=2,
                        encoder_ffn_dim=64, num_mel_bins=80, max_source_positions=150)
