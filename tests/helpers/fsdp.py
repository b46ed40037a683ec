"""Helpers of several test modules, taken from tests/distributed/test_fsdp.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.jobs import ROOT, tiny_config_dict, write_jsonl
from tests.distributed.spawning import run_main
from tests.helpers.data_parallel import assert_same_training
from tests.helpers.deferral import deferral_records


WORKER = ROOT / "tests" / "distributed" / "fsdp_worker.py"
LIMIT_S = 240


def run(cfg: dict, tmp_path, name: str, nproc: int, worker=WORKER, **extra) -> dict:
    """Train ``cfg`` on ``nproc`` processes (``worker``'s ``main``, with torchrun's variables: ``run_main``) into
    run folder ``run_<name>``; returns what rank 0 wrote."""
    cfg = json.loads(json.dumps(cfg)) | extra
    cfg["metrics"]["run_dir"] = str(tmp_path / f"run_{name}")
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}.pt"
    run_main(f"tests.distributed.{Path(worker).stem}", [str(cfg_path), str(out)], nproc, LIMIT_S, name)
    return torch.load(out)


def job(tmp_path, frozen: bool, records: list[dict] | None = None, train: dict | None = None,
        **parallel) -> dict:
    """The deferral mix (hierarchical plans defer; or ``records``), 2 steps of a global batch of 8 in microbatches
    of 2, a checkpoint every step."""
    data = write_jsonl(tmp_path / "train.jsonl", records or deferral_records())
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1,
                                  "microbatch_policy": "hierarchical", **(train or {})},
                           parallel={"timeout_s": 60, **parallel}, checkpoint={"every": 1, "keep": 2})
    if frozen:
        for enc in cfg["model"]["encoders"].values():
            enc["freeze"] = True
    return cfg


def assert_equal_runs(single: dict, other: dict) -> None:
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_training(single, other)


def assert_same_params(ref: dict, other: dict) -> None:
    """Final parameters equal (rtol 1e-4 / atol 1e-5, as the resume-across-layouts test) wherever the reference's
    first gradient is not zero in exact arithmetic."""
    compared = 0
    for name, value in ref["params"].items():
        if name in ref["grads"] and ref["grads"][name].abs().max() > 1e-6:
            torch.testing.assert_close(other["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)
            compared += 1
    assert compared > 0.8 * len(ref["grads"])


def assert_untouched_without(single: dict, other: dict, steps: int) -> None:
    """After the workers' step on a global batch without audio (``step_without``): the audio branch kept no
    gradient in both runs, so AdamW neither decayed its parameters nor stepped its state (still at ``steps``, the
    steps that saw audio): parameters and state equal one process's."""
    ref, got = single["without"], other["without"]
    assert ref["grads"] == got["grads"] == [] and len(ref["params"]) > 5 and set(got["params"]) == set(ref["params"])
    assert {float(s["step"]) for s in ref["state"].values()} == {float(steps)}
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, state in ref["state"].items():
        assert set(got["state"][name]) == set(state), name
        for key, value in state.items():
            tol = 1e-5 * float(value.abs().max()) + 1e-12
            torch.testing.assert_close(got["state"][name][key], value, rtol=1e-5, atol=tol, msg=f"{name} {key}")
