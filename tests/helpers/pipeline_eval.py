"""Helpers of several test modules, taken from tests/distributed/test_pipeline_eval.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json

from tests.helpers.jobs import ROOT, demo_records, tiny_config_dict, write_jsonl
from tests.distributed.spawning import run_main, shared_reference


WORKER = ROOT / "tests" / "distributed" / "eval_worker.py"
METRICS = ["tests.unit.train.eval_metric_fns:first_char_match", "tests.unit.train.eval_metric_fns:answer_lengths"]


def job(tmp_path, name: str, parallel: dict) -> dict:
    records = (demo_records("train", ("image_digit",), limit=3) + demo_records("train", ("audio_transcribe",), limit=2)
               + demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("text",), limit=1))
    train = write_jsonl(tmp_path / "train.jsonl", records)
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=7))  # 7: uneven over 2 replicas
    cfg = tiny_config_dict(str(train), str(val), str(tmp_path / name), data={"shuffle": False, "num_workers": 0},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1,
                                  "max_new_tokens": 4, "eval_batch_size": 2, "eval_metrics": METRICS},
                           attention={"block_size": 8}, parallel={"timeout_s": 60, **parallel})
    return cfg


def run(cfg: dict, tmp_path, name: str, nproc: int) -> dict:
    import torch

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}.pt"
    run_main("tests.distributed.eval_worker", [str(path), str(out)], nproc, 300, f"{name} on {nproc} process(es)")
    return torch.load(out, weights_only=False)


def reference(tmp_path) -> dict:
    """One process's training and evaluation of the job (in ``tmp_path``), run once per session for every test
    comparing a layout against it (here and in ``test_parallel_gaps.py``)."""
    cfg = job(tmp_path, "single", {})
    return shared_reference(str(WORKER), cfg, lambda: run(cfg, tmp_path, "single", 1))
