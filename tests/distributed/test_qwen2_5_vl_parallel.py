"""The Qwen2.5-VL vision branch under PP=2 (both layouts), PP=3 with the tower split inside its blocks across two
ranks (the per-call hook: rotary tables, cu_seqlens and the window index recomputed from ``grid_thw`` on the later
stage; window-ordered hidden states on the wire; the merger on the second rank), CP=2 and FSDP2
(``dp_shard = 2``) with activation checkpointing (gloo, ``plait train`` under torchrun) equal one process: per-step
losses and the final model.

The job mixes single-image demo records with a two-image record of different sizes, so microbatches pack images of
several grids into one tower call.
"""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer
from tests.distributed.test_pipeline_training import assert_run_equals, torchrun_train
from tests.distributed.test_pixtral_internvl_parallel import vision_job
from tests.unit.models.test_qwen2_5_vl import TINY_PROCESSOR, TINY_QWEN2_5_VL

BRANCH = {"modality": "image", "config": dict(TINY_QWEN2_5_VL), "projector": "linear",
          "processor": dict(TINY_PROCESSOR)}
LAYOUTS = {
    "pp2-encoder_parallel": (2, {"pp": {"degree": 2, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "pp2-encoders_colocated": (2, {"pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "gpipe"}}),
    "pp3-tower_split": (3, {"pp": {"degree": 3, "layout": "encoder_parallel", "schedule": "1f1b",
                                   "splits": {"vision": ["encoders.vision.encoder.blocks.2"]}}}),
    "cp2": (2, {"cp": 2}),
    "fsdp2-checkpointing": (2, {"dp_shard": 2}),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses and final parameters (computed once)."""
    trainer = Trainer.build(config_from_dict(vision_job(tmp_path_factory.mktemp("qwen2_5_vl"), BRANCH, "single")))
    assert [len(trainer.train_set[i].meta.items) for i in range(3)] == [1, 1, 2]
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen2_5_vl_under_parallel_layouts_equals_one_process(tmp_path, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = vision_job(tmp_path, BRANCH, layout)
    job["parallel"].update(parallel)
    if layout == "fsdp2-checkpointing":  # each block its own FSDP2 unit, recomputed in the backward
        job["train"]["activation_checkpointing"] = "full"
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)
