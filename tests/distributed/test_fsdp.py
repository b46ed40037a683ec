"""FSDP2 (``parallel.dp_shard``) and HSDP under torchrun (gloo) equal one process on the same global batches:
losses (rel 1e-5), first-step gradients and final parameters after AdamW steps (``assert_same_training``: rel 1e-5
of each gradient's scale; parameters rtol 1e-5 / atol 1e-6), with frozen encoders + trainable projectors and with
everything trainable; deferral on (hierarchical plans that defer), activation checkpointing inside the sharded
units, gradients reduce-scattered after every microbatch (``parallel.fsdp_reduce = "microbatch"``), a DP rank whose
share of the batch holds no image (HSDP 2x2), and resuming across a dp_shard change (DCP
reshards: one process -> dp_shard=2 and dp_shard=2 -> DDP). Parameters resharded after the forward (the default) and
kept to the backward (``parallel.fsdp_reshard = "after_backward"``: the CPU-offload, per-microbatch-reduction,
resumed and HSDP runs; fewer all-gathers). A step whose global batch holds no audio leaves the audio branch with no
gradient, so AdamW (weight decay 0.1) leaves its parameters and state as one process does."""

from __future__ import annotations


import torch

from tests.helpers.jobs import demo_records
from tests.helpers.qwen2_audio import TINY_QWEN2_AUDIO
from tests.helpers.fsdp import assert_equal_runs, assert_same_params, assert_untouched_without, job, run


def tied(cfg: dict) -> dict:
    """``cfg`` with the LLM's embedding tied to its head (the demo's ``tie_word_embeddings``)."""
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = True
    return cfg


def test_fsdp2_frozen_encoders_trainable_projectors(tmp_path):
    """Tied LLM embedding and head (one FSDP2 group, sharded once), and the same run with CPU offload."""
    single = run(tied(job(tmp_path, True)), tmp_path, "single", 1)
    fsdp = run(tied(job(tmp_path, True, train={"activation_checkpointing": "selective"}, dp_shard=2)), tmp_path,
               "fsdp", 2)
    assert fsdp["sharded"] and not single["sharded"] and fsdp["dp"] == 2
    assert len(fsdp["deferred"]) >= 1  # the plan defers: the buffered encoder-output path runs sharded
    assert not any(n.startswith("encoders.vision.encoder") for n in single["grads"])  # frozen: replicated
    assert any("projector" in g for g in fsdp["groups"]) and not any(".encoder." in g for g in fsdp["groups"])
    assert_equal_runs(single, fsdp)
    assert sum(g.endswith("(tied)") for g in fsdp["groups"]) == 1 and fsdp["replicated"] == 0  # sharded once
    offload = run(tied(job(tmp_path, True, dp_shard=2, offload="cpu", fsdp_reshard="after_backward")), tmp_path,
                  "offload", 2)
    assert offload["offloaded"] and offload["sharded"]  # FSDP2's shards and their gradients on the host
    assert_equal_runs(single, offload)
    # parallel.fsdp_reshard: "auto" (a manual job's: after the forward) vs "after_backward" (kept to the backward)
    assert not any(fsdp["kept_after_forward"]) and all(offload["kept_after_forward"])
    assert 0 < offload["all_gathers"] < fsdp["all_gathers"]


def test_fsdp2_all_trainable_with_checkpointing_and_resume_across_dp_shard(tmp_path):
    """Also: a later step whose global batch holds no audio leaves the audio branch as one process does (no
    gradient: no weight decay, no AdamW step; ``weight_decay`` 0.1 in every run of this test)."""
    decay = {"weight_decay": 0.1}
    single = run(job(tmp_path, False, train=decay), tmp_path, "single", 1, step_without="audio")
    fsdp = run(job(tmp_path, False, train={"activation_checkpointing": "full", **decay}, dp_shard=2), tmp_path,
               "fsdp", 2, step_without="audio")
    assert fsdp["sharded"] and len(fsdp["deferred"]) >= 1
    assert any(n.startswith("encoders.vision.encoder.") for n in single["grads"])
    assert sum(".layers." in g for g in fsdp["groups"]) >= 2  # one group per layer unit
    assert_equal_runs(single, fsdp)
    assert_untouched_without(single, fsdp, 2)  # FSDP2 runs the unused branch nowhere (no dummy item)
    # parallel.fsdp_reduce = "microbatch": a reduce-scatter after each of a rank's 2 microbatches, shards accumulate
    each = run(job(tmp_path, False, train=decay, dp_shard=2, fsdp_reduce="microbatch", fsdp_reshard="after_backward"),
               tmp_path, "each", 2)
    assert each["reduce_each_microbatch"] and not fsdp["reduce_each_microbatch"] and each["sharded"]
    assert all(each["kept_after_forward"]) and 0 < each["all_gathers"] < fsdp["all_gathers"]
    assert_equal_runs(single, each)
    # resume step 1 of the one-process run with dp_shard=2, and step 1 of the dp_shard=2 run as DDP (dp=2)
    step1 = "checkpoints/step_000001"
    to_fsdp = run(job(tmp_path, False, train=decay, dp_shard=2, fsdp_reshard="after_backward"), tmp_path, "to_fsdp",
                  2, resume_from=str(tmp_path / "run_single" / step1))
    to_ddp = run(job(tmp_path, False, train=decay, dp=2), tmp_path, "to_ddp", 2,
                 resume_from=str(tmp_path / "run_fsdp" / step1))
    assert (to_fsdp["start"], to_ddp["start"], to_fsdp["sharded"], to_ddp["sharded"]) == (1, 1, True, False)
    for resumed in (to_fsdp, to_ddp):
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(single["losses"][1:]), rtol=1e-5,
                                   atol=0)
        assert_same_params(single, resumed)


def test_hsdp_2x2_with_a_rank_that_sees_no_image(tmp_path):
    images = demo_records("train", ("image_digit",), limit=3)
    others = demo_records("train", ("audio_transcribe",), limit=3) + demo_records("train", ("text",), limit=2)
    records = images + others
    single = run(job(tmp_path, False, records, {"microbatch_policy": "arrival"}), tmp_path, "single", 1)
    hsdp = run(job(tmp_path, False, records, {"microbatch_policy": "arrival"}, dp=2, dp_shard=2,
                   fsdp_reshard="after_backward"), tmp_path, "hsdp", 4)
    assert hsdp["sharded"] and hsdp["dp"] == 4 and hsdp["world"] == 4 and all(hsdp["kept_after_forward"])
    assert min(hsdp["images_per_rank"]) == 0 < max(hsdp["images_per_rank"])  # a rank joins the encoder's
    assert_equal_runs(single, hsdp)  # collectives on a dummy image, with zero gradient


def test_fsdp2_with_lora_adapters_in_their_own_groups(tmp_path):
    cfg = job(tmp_path, False)
    cfg["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
    cfg["model"]["encoders"]["vision"]["lora"] = {"r": 2, "alpha": 4.0}
    single = run(cfg, tmp_path, "single", 1)
    fsdp = run(cfg | {"parallel": {**cfg["parallel"], "dp_shard": 2}}, tmp_path, "fsdp", 2)
    lora_parts = [n for n in single["grads"] if n.startswith(("language_model.", "encoders.vision.encoder."))]
    assert lora_parts and all(".lora_" in n for n in lora_parts)  # only the adapters of the LoRA parts train
    assert sum(g.endswith("(adapter)") for g in fsdp["groups"]) >= 4  # adapters: own groups in frozen bases
    torch.testing.assert_close(torch.tensor(fsdp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert set(fsdp["grads"]) == set(single["grads"])
    for name, grad in single["grads"].items():  # lora_A's first gradient is exactly 0 (lora_B starts at 0)
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(fsdp["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)
        torch.testing.assert_close(fsdp["params"][name], single["params"][name], rtol=1e-4, atol=1e-5, msg=name)


def qwen2_audio(cfg: dict) -> dict:
    """``cfg`` with a trainable Qwen2-Audio tower as its audio branch (its forward reads ``embed_positions.weight``
    without calling the module: FSDP2 keeps it replicated)."""
    cfg["model"]["encoders"]["audio"] |= {"config": dict(TINY_QWEN2_AUDIO)}
    return cfg


def test_fsdp2_dp_shard2_with_cp2(tmp_path):
    """With a trainable Qwen2-Audio tower: its position table is replicated, its gradient summed over the ranks."""
    attention = {"mask": "bidirectional_items", "block_size": 16}
    cfg = qwen2_audio(job(tmp_path, False))
    single = run(cfg | {"attention": attention}, tmp_path, "single", 1)
    both = qwen2_audio(job(tmp_path, False, dp_shard=2, cp=2))
    fsdp_cp = run(both | {"attention": attention}, tmp_path, "fsdp_cp", 4)
    assert fsdp_cp["sharded"] and fsdp_cp["dp"] == 2 and fsdp_cp["world"] == 4
    positions = "encoders.audio.encoder.embed_positions.weight"
    assert single["grads"][positions].abs().max() > 0 and fsdp_cp["replicated"] == 1
    assert_equal_runs(single, fsdp_cp)  # CP's sum over the shards' local pieces, FSDP2's over dp_shard
