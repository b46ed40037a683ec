"""Helpers of several test modules, taken from tests/distributed/test_pipeline_deferral.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json

import torch

from tests.distributed import pipeline_deferral_worker as w
from tests.distributed.spawning import run_main


def deferral_train(cfg: dict, tmp_path, name: str, nproc: int) -> dict:
    """Run ``trainer_main`` on ``cfg`` (in this process, or on ``nproc`` > 1 ranks started with torchrun's variables);
    the ranks' outputs
    merged (gradients and parameters by name: each rank holds its own stage's)."""
    cfg = json.loads(json.dumps(cfg))
    cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{name}")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    if nproc == 1:
        w.trainer_main(str(path), str(tmp_path / name))
    else:
        run_main("tests.distributed.pipeline_deferral_worker", [str(path), str(tmp_path / name)], nproc, 300,
                 f"{name} on {nproc} processes", function="trainer_main")
    parts = [torch.load(tmp_path / f"{name}.{r}.pt") for r in range(nproc)]
    merged = dict(parts[0], grads={}, params={})
    for part in parts:
        assert part["losses"] == parts[0]["losses"] and part["buffered"] == parts[0]["buffered"]
        merged["grads"].update(part["grads"])
        merged["params"].update(part["params"])
    return merged
