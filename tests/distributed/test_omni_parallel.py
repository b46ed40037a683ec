"""The Qwen2.5-Omni thinker's composition under PP=2 (both towers on the first stage, the LLM on the second), PP=3
(each tower its own stage) and CP=2 (gloo, ``plait train`` under torchrun) equals one process: per-step losses and the
final model. The job is built from the thinker's config tables (Omni vision and audio towers, its M-RoPE text model)
on records with a video and its audio track (``video.audio = true``: the clip's video and audio tokens interleaved by
2-s chunks, time-aligned M-RoPE positions), an image and text: every LLM stage and every context-parallel token
shard must carry the clip's positions and both branches' features as one process does."""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.data.collate import collate
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.qwen2_5_omni import omni_job

LAYOUTS = {
    "pp2": (2, {"pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}}),
    "pp3": (3, {"pp": {"degree": 3, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "cp2": (2, {"cp": 2}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses and final parameters (computed once)."""
    trainer = Trainer.build(config_from_dict(omni_job(tmp_path_factory.mktemp("omni"), "single")))
    assert type(trainer.model.language_model).__name__ == "Qwen25OmniTextForCausalLM"
    assert [trainer.train_set[i].meta.items for i in range(4)] == [
        (("vision", 16), ("audio", 75)), (("vision", 9),), (("vision", 16), ("audio", 100)), ()]
    clip = collate([trainer.train_set[0]], 0)  # audio at the video's temporal positions, not 1-D ones
    audio = clip.item_ids == 1
    assert int(clip.rope_position_ids[0][audio].min()) == int(clip.rope_position_ids[0][clip.item_ids == 0].min())
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_omni_thinker_under_parallel_layouts_equals_one_process(tmp_path, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = omni_job(tmp_path, layout)
    job["parallel"].update(parallel)
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)
