"""Helpers of several test modules, taken from tests/distributed/test_tensor_parallel_training.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import torch


def assert_same(ref: dict, other: dict, frozen: bool) -> None:
    """Equal losses (rel 1e-5), first-step gradients (rel 1e-5 of each tensor's scale) and final parameters
    wherever the gradient is not zero in exact arithmetic (key biases: ~1e-10 of noise that AdamW amplifies)."""
    torch.testing.assert_close(torch.tensor(other["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert set(ref["grads"]) == set(other["grads"]) and len(ref["grads"]) > 10
    assert frozen == (not any(".encoder." in n for n in ref["grads"]))
    for name, grad in ref["grads"].items():
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(other["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)
    compared = 0
    for name, value in ref["params"].items():
        if name not in other["params"]:  # a pipeline prunes modules on no unit's path (an unused post-norm)
            assert name not in ref["grads"], name
        elif name not in ref["grads"] or ref["grads"][name].abs().max() > 1e-6:
            torch.testing.assert_close(other["params"][name], value, rtol=1e-5, atol=2e-6, msg=name)
            compared += 1
    assert compared > 0.75 * len(ref["params"])
