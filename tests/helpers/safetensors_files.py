"""Comparing exported checkpoints: a helper of the import/export tests of several families."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = ["assert_same_tensors"]


def assert_same_tensors(a: Path, b: Path) -> None:
    """The ``model.safetensors`` of folders ``a`` and ``b`` hold the same names with bit-identical tensors (dtype and
    values)."""
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(left) == sorted(right)
    for key in left:
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key
