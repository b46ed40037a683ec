"""Gemma 3 under PP=2 and CP=2 (gloo, ``plait train`` under torchrun) equals one process: per-step losses and the
final model. The job is Gemma 3's composition built from configs: a SigLIP branch with ``select = "post_norm"``, 2x2
average pooling and the ``gemma3`` projector, a Gemma 3 text LLM with a sliding-window and a global layer, and the
``bidirectional_items`` mask (each image's tokens see each other both ways; the local layer's window) on records with
one and two images: every LLM stage and every context-parallel shard must apply the same mask as one process."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.pixtral_internvl_parallel import vision_job

SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=32, patch_size=4)
BRANCH = {"modality": "image", "config": SIGLIP, "select": "post_norm", "downsample": 2, "projector": "gemma3",
          "processor": {"size": {"height": 32, "width": 32}}}
GEMMA3_LLM = dict(model_type="gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                  max_position_embeddings=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
LAYOUTS = {
    "pp2": (2, {"pp": {"degree": 2, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "cp2": (2, {"cp": 2}),
}


def _job(tmp_path, run: str) -> dict:
    job = vision_job(tmp_path, BRANCH, run)
    job["model"]["llm"]["config"] = dict(GEMMA3_LLM)
    job["attention"]["mask"] = "bidirectional_items"
    return job


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses and final parameters (computed once)."""
    trainer = Trainer.build(config_from_dict(_job(tmp_path_factory.mktemp("gemma3"), "single")))
    assert type(trainer.model.language_model).__name__ == "Gemma3ForCausalLM"
    assert [len(trainer.train_set[i].meta.items) for i in range(3)] == [1, 1, 2]
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemma3_under_parallel_layouts_equals_one_process(tmp_path, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = _job(tmp_path, layout)
    job["parallel"].update(parallel)
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)
