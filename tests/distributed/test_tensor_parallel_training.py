"""Tensor parallelism in the trainers (gloo; ranks started with torchrun's variables by ``spawning.run_main``)
equals one process on the same global batches: TP=2 with frozen encoders + trainable projectors and with
everything trainable, CP=2 x TP=2 (plait attention on the local heads and local tokens), gradients clipped by the
true global norm; losses, first-step gradients (full tensors) and final parameters after AdamW steps."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.jobs import ROOT, demo_records, tiny_config_dict, write_jsonl
from tests.distributed.spawning import run_main, shared_reference
from tests.helpers.tensor_parallel_training import assert_same

WORKER = ROOT / "tests" / "distributed" / "tp_train_worker.py"


def run(cfg: dict, tmp_path, name: str, nproc: int, resume: bool = False) -> dict:
    """Train ``cfg`` on ``nproc`` processes started like torchrun's (``resume``: continue the newest checkpoint of
    its run folder)."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}.pt"
    argv = [str(path), str(out)] + (["resume"] if resume else [])
    run_main("tests.distributed.tp_train_worker", argv, nproc, 300, f"{name} on {nproc} process(es)")
    return torch.load(out)


def reference(cfg: dict, tmp_path, name: str) -> dict:
    """The single-process run of ``cfg``, trained once per session for all the tests comparing against that job."""
    return shared_reference(str(WORKER), cfg, lambda: run(cfg, tmp_path, name, 1))


def job(tmp_path, frozen: bool, **sections) -> dict:
    records = (demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("image_digit",), limit=1)
               + demo_records("train", ("text",), limit=1))
    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1,
                                  "grad_clip": 0.05},
                           attention={"mask": "bidirectional_items", "block_size": 16},
                           parallel={"timeout_s": 60}, **sections)
    for enc in cfg["model"]["encoders"].values():
        enc["freeze"] = frozen
    return cfg


def test_tp2_and_cp2_x_tp2_equal_single_process(tmp_path):
    """TP=2 and CP=2 x TP=2 (4 processes) in both freezing modes. With frozen encoders the runs validate after
    their last step too (loss and greedy answers through the TP model)."""
    for frozen in (True, False):
        cfg = job(tmp_path, frozen)
        if frozen:
            cfg["data"]["val"] = str(write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=3)))
            cfg["train"]["max_new_tokens"] = 3
        cfg["metrics"]["run_dir"] = str(tmp_path / f"run_single{frozen}")
        single = reference(cfg, tmp_path, f"single{frozen}")
        layouts = {"tp2": {"tp": 2}, "cp2tp2": {"tp": 2, "cp": 2}}
        for name, degrees in layouts.items():
            cfg["parallel"].update(degrees)
            cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{name}{frozen}")
            other = run(cfg, tmp_path, f"{name}{frozen}", 2 * degrees.get("cp", 1))
            assert other["world"] == 2 * degrees.get("cp", 1)
            assert any(n.startswith("language_model.") for n in other["sharded"])
            assert_same(single, other, frozen)
            exported = other["exported"]  # final/'s whole model equals the trained split one
            assert set(exported) == set(other["params"])
            for n, value in other["params"].items():
                torch.testing.assert_close(exported[n], value, rtol=0, atol=0, msg=n)
            if frozen:
                assert other["eval"]["samples"] == single["eval"]["samples"] == 3
                assert other["eval"]["exact"] == single["eval"]["exact"]
                assert abs(other["eval"]["loss"] - single["eval"]["loss"]) <= 1e-5 * single["eval"]["loss"]


def test_resume_across_tp_changes_is_exact(tmp_path):
    """One process (step 1) -> TP=2 (step 2) -> one process (step 3): the DCP checkpoints reshard the DTensor
    parameters and AdamW state; losses and final parameters equal an uninterrupted single-process run (constant
    LR, so the extended schedule is the reference's)."""
    cfg = job(tmp_path, frozen=True)
    cfg["train"].update(steps=3, min_lr_ratio=1.0)
    cfg["checkpoint"] = {"every": 1, "keep": 3}
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_ref")
    ref = run(cfg, tmp_path, "ref", 1)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_chain")
    links = [(1, 1, False), (2, 2, True), (3, 1, True)]  # (steps, tp, resume)
    losses = []
    for steps, tp, resume in links:
        cfg["train"]["steps"], cfg["parallel"]["tp"] = steps, tp
        got = run(cfg, tmp_path, f"chain{steps}", tp, resume=resume)
        losses += got["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, value in ref["params"].items():
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-encoders", "all-trainable"])
def test_pp2_x_tp2_equals_single_process(tmp_path, frozen):
    """PP=2 (encoders on stage 0, the LLM on stage 1, 1F1B) x TP=2, 4 processes: each pipeline rank splits only its
    own units."""
    cfg = job(tmp_path, frozen=frozen)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_single")
    single = reference(cfg, tmp_path, "single")
    cfg["parallel"].update(tp=2, pp={"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"})
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_pp_tp")
    other = run(cfg, tmp_path, "pp_tp", 4)
    assert any(n.startswith("language_model.") for n in other["sharded"])
    assert any(n.startswith("encoders.vision.encoder.") for n in other["sharded"])
    assert any(n.startswith("encoders.audio.encoder.") for n in other["sharded"])
    assert_same(single, other, frozen=frozen)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-encoders", "all-trainable"])
def test_tp2_x_dp_shard2_equals_single_process(tmp_path, frozen):
    """TP=2 x FSDP2 dp_shard=2 (4 processes, a 2-D layout: fully_shard over the TP-split DTensors): each of the 2
    shard ranks trains its own half of the batch."""
    cfg = job(tmp_path, frozen=frozen)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_single")
    single = reference(cfg, tmp_path, "single")
    cfg["parallel"].update(tp=2, dp_shard=2)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_tp_fsdp")
    other = run(cfg, tmp_path, "tp_fsdp", 4)
    assert any(n.startswith("language_model.") for n in other["sharded"])
    assert_same(single, other, frozen=frozen)
