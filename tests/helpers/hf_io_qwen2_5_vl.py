"""Helpers of several test modules, taken from tests/unit/models/test_hf_io_qwen2_5_vl.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import torch


PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def hf_inputs(batch, image_id: int) -> dict:
    """transformers' inputs for plait's collated prompt: the same ids, patches and grids, and its token types
    (images 1), from which the model computes its own M-RoPE positions."""
    vision = batch.modality_inputs["vision"]
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
            "pixel_values": torch.cat(vision["pixel_values"]),
            "image_grid_thw": torch.stack([torch.as_tensor(g) for g in vision["image_grid_thw"]]),
            "mm_token_type_ids": (batch.input_ids == image_id).int()}
