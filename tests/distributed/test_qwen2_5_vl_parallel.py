"""The Qwen2.5-VL vision branch under PP=2 (both layouts), PP=3 with the tower split inside its blocks across two
ranks (the per-call hook: rotary tables, cu_seqlens and the window index recomputed from ``grid_thw`` on the later
stage; window-ordered hidden states on the wire; the merger on the second rank), CP=2 and FSDP2
(``dp_shard = 2``) with activation checkpointing (gloo, ``plait train`` under torchrun) equal one process: per-step
losses and the final model.

The job mixes single-image demo records with a two-image record of different sizes, so microbatches pack images of
several grids into one tower call. Its LLM is Qwen2.5-VL's text model (``qwen2_5_vl_text``), which rotates with the
collator's M-RoPE positions ``[3, B, N]``: every layout (the LLM stages of PP, the token shards of CP) must carry them
as one process does.
"""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.data.collate import collate
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.qwen2_5_vl_parallel import qwen_vl_job

"""Qwen2.5-VL's LLM at the tiny LLM's sizes (M-RoPE sections of the 8-wide heads)."""
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
    trainer = Trainer.build(config_from_dict(qwen_vl_job(tmp_path_factory.mktemp("qwen2_5_vl"), "single")))
    assert [len(trainer.train_set[i].meta.items) for i in range(3)] == [1, 1, 2]
    assert type(trainer.model.language_model).__name__ == "Qwen25VLTextForCausalLM"
    two = collate([trainer.train_set[2]], 0)  # the two-image record: its images at grid positions, not 1-D ones
    assert two.rope_position_ids is not None
    assert not torch.equal(two.rope_position_ids, two.position_ids.expand(3, -1, -1))
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen2_5_vl_under_parallel_layouts_equals_one_process(tmp_path, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = qwen_vl_job(tmp_path, layout)
    job["parallel"].update(parallel)
    if layout == "fsdp2-checkpointing":  # each block its own FSDP2 unit, recomputed in the backward
        job["train"]["activation_checkpointing"] = "full"
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)
