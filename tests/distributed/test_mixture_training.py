"""A data mixture under DP=2 (gloo, two spawned processes): both ranks draw the same mixture batches without
communication and train the losses one process trains on the same JSONL + Parquet mixture."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait
from tests.helpers.mixture import mixture_job


def _worker(rank: int, world: int, port: int, cfg_dict: dict, folder: str) -> None:
    from plait.config.loader import config_from_dict
    from plait.parallel.process_group import DistInfo
    from plait.train.trainer import Trainer

    with gloo_group(rank, world, port, timeout_s=60):
        trainer = Trainer.build(config_from_dict(cfg_dict), DistInfo(rank, world, rank, torch.device("cpu")))
        batches = [trainer.loader.epoch_order(e).tolist() for e in (0, 1)]
        losses = trainer.fit()["losses"]
        Path(folder, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "batches": batches}))


def test_dp2_mixture_trains_like_one_process(tmp_path):
    from plait.config.loader import config_from_dict
    from plait.train.metrics import read_metrics
    from plait.train.trainer import Trainer

    steps = 4
    single_cfg = mixture_job(tmp_path, "single", steps=steps, microbatch_size=2, eval_every=0, threads=1)
    single_cfg["data"]["sources"] = [{k: v for k, v in s.items() if k != "val"} for s in single_cfg["data"]["sources"]]
    single = Trainer.build(config_from_dict(single_cfg))
    order = [single.loader.epoch_order(e).tolist() for e in (0, 1)]
    ref = single.fit()["losses"]
    dp_cfg = json.loads(json.dumps(single_cfg))
    dp_cfg["metrics"]["run_dir"] = str(tmp_path / "dp")
    dp_cfg["parallel"] = {"timeout_s": 60}
    spawn_and_wait(_worker, (2, free_port(), dp_cfg, str(tmp_path)), 2, 300, "DP=2 mixture training")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["batches"] == got[1]["batches"] == order
    assert got[0]["losses"] == got[1]["losses"] and len(got[0]["losses"]) == steps
    torch.testing.assert_close(torch.tensor(got[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)
    counts = [r["sources"] for r in read_metrics(tmp_path / "dp" / "metrics.jsonl") if "loss" in r]
    assert counts == [r["sources"] for r in read_metrics(tmp_path / "single" / "metrics.jsonl") if "loss" in r]
    assert counts == [{"text": 6, "images": 2}] * 3 + [counts[3]] and sum(counts[3].values()) == 8
