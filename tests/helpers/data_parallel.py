"""Helpers of several test modules, taken from tests/distributed/test_data_parallel.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json

import torch

from tests.distributed.spawning import run_main


def run(cfg: dict, tmp_path, name: str, nproc: int) -> dict:
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / f"{name}.pt"
    run_main("tests.distributed.dp_worker", [str(cfg_path), str(out)], nproc, 300, f"{name} on {nproc} process(es)")
    return torch.load(out)


def assert_same_training(ref: dict, other: dict) -> None:
    """Equal first-step gradients (rel 1e-5 of each tensor's scale) and final parameters wherever the
    gradient is not zero in exact arithmetic (key biases get ~1e-10 rounding noise that AdamW amplifies)."""
    assert_same_gradients_and_parameters(ref, other, min_grads=20)


def assert_same_gradients_and_parameters(ref: dict, other: dict, min_grads: int) -> None:
    """``other``'s gradients equal ``ref``'s (rel 1e-5 of each tensor's scale; more than ``min_grads`` of them,
    same names) and its parameters too wherever the gradient is not zero in exact arithmetic (over 80% of them)."""
    assert set(ref["grads"]) == set(other["grads"]) and len(ref["grads"]) > min_grads
    for name, grad in ref["grads"].items():
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(other["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)
    compared = 0
    for name, value in ref["params"].items():
        if name in ref["grads"] and ref["grads"][name].abs().max() > 1e-6:
            torch.testing.assert_close(other["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
            compared += 1
    assert compared > 0.8 * len(ref["grads"])
