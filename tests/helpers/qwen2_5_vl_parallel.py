"""Helpers of several test modules, taken from tests/distributed/test_qwen2_5_vl_parallel.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from tests.helpers.pixtral_internvl_parallel import vision_job
from tests.helpers.qwen2_5_vl import TINY_PROCESSOR, TINY_QWEN2_5_VL


BRANCH = {"modality": "image", "config": dict(TINY_QWEN2_5_VL), "projector": "linear",
          "processor": dict(TINY_PROCESSOR)}
MROPE_LLM = dict(model_type="qwen2_5_vl_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})


def qwen_vl_job(tmp_path, run: str) -> dict:
    """The vision job of the Pixtral/InternVL test with the Qwen2.5-VL branch and Qwen2.5-VL's M-RoPE LLM."""
    job = vision_job(tmp_path, BRANCH, run)
    job["model"]["llm"]["config"] = dict(MROPE_LLM)
    job["model"]["encoders"]["vision"]["processor"]["min_pixels"] = 56 * 56  # >= 2x2 merged blocks per image
    return job
