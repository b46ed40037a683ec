"""Qwen3-VL's DeepStack under PP=2 with the receiving LLM layers split across the two stages (with LoRA on the LLM,
and PP=2 x CP=2 with deferred encoder outputs), CP=2, FSDP2 (``dp_shard = 2``) with activation checkpointing and
TP=2 (gloo, ``plait train`` under torchrun) equals one process: per-step losses and the final model
(``assert_run_equals``: losses rel 1e-5, parameters rel 1e-4 / abs 1e-5).

The job is Qwen3-VL's composition built from configs: a Qwen3-VL tower whose blocks 0 and 1 give DeepStack features
(``deepstack_visual_indexes``), added after LLM layers 0 and 1 of a 3-layer Qwen3-VL text model (interleaved
M-RoPE), on records with one and two images and a text-only one. Under PP the first LLM stage holds layer 0 and the
second layers 1-2, so the DeepStack rows of layer 1 travel with the hidden states (and their gradients back to the
tower); under CP each shard adds its own visual tokens' additions; under FSDP2 and activation checkpointing the hooks
run on sharded, recomputed layers; under TP on layers with split projections (the tower's MLPs split, its attention
replicated)."""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer
from plait.train.metrics import read_metrics
from tests.helpers.jobs import demo_records, write_jsonl
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.pixtral_internvl_parallel import vision_job

VISION = dict(model_type="qwen3_vl_vision", depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1])
LLM = dict(model_type="qwen3_vl_text", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                            "mrope_interleaved": True})
BRANCH = {"modality": "image", "config": VISION, "projector": "linear",
          "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 30}}
LORA = {"r": 4, "alpha": 8}
PP2 = {"pp": {"degree": 2, "attach_encoders": True, "schedule": "interleaved_1f1b",
              "splits": {"llm": ["language_model.model.layers.1"]}}}
"""Rank 0: the tower and LLM stage 1 (embedding, layer 0); rank 1: LLM stage 2 (layers 1-2, norm, head)."""
LAYOUTS = {
    "cp2": (2, {"cp": 2}),
    "fsdp2-checkpointing": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2}),
}


# (index among the demo's image_digit records, extra answer words): LLM lengths that fight the encoder balance, so
# the hierarchical microbatch plan defers some samples' LLM work to a later microbatch than their tower's
DEFERRING = [(2, 30), (3, 0), (1, 0), (2, 0), (0, 30), (1, 15), (3, 15), (0, 0)]


def _job(tmp_path, run: str, lora: bool = False) -> dict:
    job = vision_job(tmp_path, BRANCH, run)
    job["model"]["llm"]["config"] = dict(LLM)
    if lora:
        job["model"]["llm"]["lora"] = dict(LORA)
    return job


def _reference(tmp_path_factory, lora: bool):
    trainer = Trainer.build(config_from_dict(_job(tmp_path_factory.mktemp("qwen3_vl"), "single", lora)))
    assert type(trainer.model.language_model).__name__ == "Qwen3VLTextForCausalLM"
    assert trainer.model.deepstack_layers == 2
    assert [len(trainer.train_set[i].meta.items) for i in range(3)] == [1, 1, 2]
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses and final parameters (computed once)."""
    return _reference(tmp_path_factory, lora=False)


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    """Single-process losses and final parameters with LoRA adapters on the LLM (the tower trains whole)."""
    return _reference(tmp_path_factory, lora=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_vl_under_parallel_layouts_equals_one_process(tmp_path, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = _job(tmp_path, layout)
    job["parallel"].update(parallel)
    if layout == "fsdp2-checkpointing":  # each layer its own FSDP2 unit, recomputed in the backward
        job["train"]["activation_checkpointing"] = "full"
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)


def test_qwen3_vl_lora_under_pp2_equals_one_process(tmp_path, lora_reference):
    """LoRA on the LLM (frozen base layers with adapters) with the receivers split across two stages: the DeepStack
    rows' gradients cross the hop through the frozen-base layer to the trainable tower."""
    ref_losses, ref_params = lora_reference
    assert any("lora_A" in n for n in ref_params)
    job = _job(tmp_path, "lora-pp2", lora=True)
    job["parallel"].update(PP2)
    torchrun_train(job, tmp_path, "lora-pp2", nproc=2)
    assert_run_equals(tmp_path / "lora-pp2", ref_losses, ref_params)


def _deferring_job(tmp_path, run: str, policy: str) -> dict:
    pool = demo_records("train", ("image_digit",), limit=4)
    records = []
    for k, (i, extra) in enumerate(DEFERRING):
        user, answer = pool[i]["messages"]
        words = " ".join(["seven", "two", "nine"] * extra)[: 6 * extra]
        content = f"{answer['content']} {words}" if extra else answer["content"]
        records.append(dict(pool[i], id=f"mix-{k}", messages=[user, {"role": "assistant", "content": content}]))
    job = _job(tmp_path, run)
    job["data"]["train"] = str(write_jsonl(tmp_path / "deferring.jsonl", records))
    job["train"].update(global_batch_size=8, microbatch_policy=policy)
    return job


def test_qwen3_vl_deferred_features_under_pp2_cp2_equal_one_process(tmp_path):
    """PP=2 x CP=2 (4 processes): the hierarchical plan defers samples (their features held on the first LLM stage,
    rebuilt per LLM microbatch) while each CP rank's DeepStack rows of layer 1 (its token shard's visual tokens)
    cross to the second LLM stage: equal to one process in arrival order."""
    trainer = Trainer.build(config_from_dict(_deferring_job(tmp_path, "single", "arrival")))
    ref_losses = trainer.fit()["losses"]
    ref_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    job = _deferring_job(tmp_path, "deferred-pp2-cp2", "hierarchical")
    job["parallel"].update(PP2, cp=2)
    torchrun_train(job, tmp_path, "deferred-pp2-cp2", nproc=4)
    assert_run_equals(tmp_path / "deferred-pp2-cp2", ref_losses, ref_params)
    steps = [r for r in read_metrics(tmp_path / "deferred-pp2-cp2" / "metrics.jsonl") if "loss" in r]
    assert steps and all(r["deferred_samples"] >= 1 and r["encoder_buffer_peak_bytes"] > 0 for r in steps)
