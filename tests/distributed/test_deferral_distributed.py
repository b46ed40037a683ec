"""Deferral under DP=2 and CP=2 (gloo): hierarchical assignment with deferred LLM work (detached-leaf
re-injection of buffered encoder outputs, trainable encoders) equals one process on the same global batches."""

from __future__ import annotations

import json

import torch

from tests.helpers.jobs import tiny_config_dict, write_jsonl
from tests.distributed.spawning import run_main
from tests.helpers.data_parallel import assert_same_training
from tests.helpers.deferral import deferral_records


def run(cfg: dict, tmp_path, name: str, nproc: int) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{name}")
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}.pt"
    run_main("tests.distributed.deferral_worker", [str(cfg_path), str(out)], nproc, 300,
             f"{name} on {nproc} process(es)")
    return torch.load(out)


def test_deferral_with_dp2_and_cp2_equals_single_process(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", deferral_records())
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1,
                                  "microbatch_policy": "hierarchical"},
                           attention={"mask": "bidirectional_items", "block_size": 16},
                           parallel={"timeout_s": 60})
    single = run(cfg, tmp_path, "single", 1)
    dp = run(cfg, tmp_path, "dp", 2)
    cfg["parallel"]["cp"] = 2
    cp = run(cfg, tmp_path, "cp", 2)
    assert (single["world"], dp["world"], cp["world"]) == (1, 2, 2)
    assert (single["dp"], dp["dp"], cp["dp"]) == (1, 2, 1)
    for res in (single, dp, cp):  # the plans defer, so the buffered encoder-output path runs on every setup
        assert len(res["deferred"]) >= 1 and res["buffered"] > 0
    assert cp["deferred"] == single["deferred"]  # CP ranks share one DP replica: the single-process plan
    assert any(n.startswith("encoders.vision.encoder") for n in single["grads"])  # encoders train
    for other in (dp, cp):
        torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
        assert_same_training(single, other)
