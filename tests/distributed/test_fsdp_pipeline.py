"""FSDP2 under pipeline parallelism: PP=2 x ``parallel.dp_shard=2`` under torchrun (gloo, 4 processes) equals one
process on the same global batches: losses (rel 1e-5), first-step gradients and final parameters after AdamW steps
(``assert_same_training``, the tolerances of ``test_fsdp.py``), with frozen encoders + trainable projectors (deferral
on: hierarchical plans that defer) and with everything trainable (encoders on the first LLM rank, the LLM cut in
two stages with its embedding tied to the head on the other rank, activation checkpointing, a pipeline whose share
of the batch holds no image)."""

from __future__ import annotations

import torch

from tests.conftest import ROOT, demo_records
from tests.distributed.test_fsdp import assert_equal_runs, job, run

WORKER = ROOT / "tests" / "distributed" / "fsdp_pipeline_worker.py"


def pipeline(**pp) -> dict:
    """``[parallel.pp]`` of degree 2, 1F1B (``pp`` updates it)."""
    return {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b", **pp}


def test_pp2_fsdp2_frozen_encoders_trainable_projectors_with_deferral(tmp_path):
    single = run(job(tmp_path, True), tmp_path, "single", 1, WORKER)
    both = run(job(tmp_path, True, dp_shard=2, pp=pipeline()), tmp_path, "pp_fsdp", 4, WORKER)
    assert both["sharded"] and both["dp"] == 2 and both["world"] == 4
    assert len(both["deferred"]) >= 1  # encoder features buffered on the first LLM stage, sharded projectors
    encoders, llm = both["groups"][0], both["groups"][1]  # ranks: (shard x 2 + pipeline rank)
    assert (both["groups"][2], both["groups"][3]) == (encoders, llm)  # both shard ranks of a stage shard alike
    assert any("projector" in g for g in encoders) and not any(".encoder." in g for g in encoders)  # frozen
    assert not any(g.startswith("language_model.") for g in encoders)  # each rank shards only its own stages
    assert sum(".layers." in g for g in llm) == 2 and not any(g.startswith("encoders.") for g in llm)
    assert_equal_runs(single, both)


def test_pp2_fsdp2_all_trainable_tied_embeddings_and_a_pipeline_without_images(tmp_path):
    images = demo_records("train", ("image_digit",), limit=3)
    others = demo_records("train", ("audio_transcribe",), limit=3) + demo_records("train", ("text",), limit=2)
    train = {"microbatch_policy": "arrival", "activation_checkpointing": "full"}
    cfg = job(tmp_path, False, images + others, train)
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = True
    single = run(cfg, tmp_path, "single", 1, WORKER)
    pp = pipeline(attach_encoders=True, stages={"vision": 1, "audio": 1, "llm": 2})
    both = run(job(tmp_path, False, images + others, train, dp_shard=2, pp=pp) | {"model": cfg["model"]}, tmp_path,
               "pp_fsdp", 4, WORKER)
    assert both["sharded"] and both["dp"] == 2
    assert min(both["images_per_rank"]) == 0 < max(both["images_per_rank"])  # its encoder groups reduce zeros
    embed = "language_model.model.embed_tokens"
    assert embed not in " ".join(both["groups"][0]) and "lm_head" not in " ".join(both["groups"][1])  # replicated
    assert any(".encoder.layers." in g for g in both["groups"][0])  # encoder layers sharded on pipeline rank 0
    assert len(both["tied_head"]) == 2  # the head's copy, on pipeline rank 1 of both shard pipelines
    for head in both["tied_head"]:  # stays equal to the embedding (gradients summed over the two copies)
        torch.testing.assert_close(head, both["params"][embed + ".weight"], rtol=0, atol=0)
    assert_equal_runs(single, both)
