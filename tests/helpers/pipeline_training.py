"""Helpers of several test modules, taken from tests/distributed/test_pipeline_training.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import subprocess

import torch

from plait.models.multimodal import MultimodalModel
from plait.planner.toml_text import toml_text
from plait.train.metrics import read_metrics
from tests.helpers.cli import plait_on_ranks
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl


STEPS, GLOBAL_BATCH, MICROBATCH = 3, 4, 2


def to_toml(data: dict) -> str:
    """Nested dicts as TOML dotted-key lines (``None`` values left out), without a final newline."""
    return toml_text(data).rstrip("\n")


def job_dict(tmp_path, run: str) -> dict:
    records = (demo_records("train", ("image_digit",), limit=3) + demo_records("train", ("audio_transcribe",), limit=2)
               + demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("text",), limit=1))
    train = write_jsonl(tmp_path / "train.jsonl", records)
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=4))
    job = tiny_config_dict(str(train), str(val), str(tmp_path / run),
                            train={"steps": STEPS, "global_batch_size": GLOBAL_BATCH, "microbatch_size": MICROBATCH,
                                   "threads": 1, "max_new_tokens": 4, "lr": 1e-3},
                            checkpoint={"every": 1, "keep": 5}, parallel={"timeout_s": 60})
    job["model"]["encoders"]["vision"]["lr_scale"] = 3.0  # an optimizer group with its own LR
    return job


def torchrun_train(job: dict, tmp_path, name: str, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``plait train`` of ``job`` (written to ``<tmp_path>/<name>.toml``) on ``nproc`` ranks started with torchrun's
    variables (``spawning.run_main``: forked from the session's fork server, no launcher, no interpreter start per
    rank); the ranks' exit codes (the largest), stdout and stderr (rank 0's first) as a finished process; fails the
    test with the output's tail when a rank exits non-zero (240 s limit)."""
    path = tmp_path / f"{name}.toml"
    path.write_text(to_toml(job) + "\n")
    proc = plait_on_ranks(nproc, "train", "--config", str(path), *extra, limit_s=240, logs=tmp_path / f"{name}.rank")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def losses_of(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def assert_run_equals(run_dir, ref_losses, ref_params, steps=(1, 2)) -> None:
    """The run in ``run_dir`` logged ``ref_losses`` at ``steps`` (rel 1e-5) and its ``final/`` holds exactly the
    parameters ``ref_params`` (name -> tensor; rel 1e-4, abs 1e-5)."""
    from plait.models.multimodal import MultimodalModel

    losses = losses_of(run_dir)
    torch.testing.assert_close(torch.tensor([losses[s] for s in steps]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    final = dict(MultimodalModel.from_pretrained(run_dir / "final", "eager").named_parameters())
    assert set(final) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5, msg=name)
