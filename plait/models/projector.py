"""Projectors: map encoder features into the LLM's embedding space."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Projector", "build_projector"]


class Projector(nn.Module):
    """``linear``: one Linear; ``mlp``: Linear -> GELU -> Linear (the LLaVA-1.5 projector).

    Input ``[..., in_dim]``, output ``[..., out_dim]``. Features of another dtype than the projector's weights (a
    tower kept in bf16 before an fp32 projector) are cast to the weights' dtype, unless autocast chooses the
    matmul dtype.
    """

    def __init__(self, in_dim: int, out_dim: int, kind: str = "mlp") -> None:
        super().__init__()
        if kind not in ("linear", "mlp"):
            raise ValueError(f"projector kind must be 'linear' or 'mlp', got {kind!r}")
        self.kind = kind
        self.linear_1 = nn.Linear(in_dim, out_dim)
        if kind == "mlp":
            self.act = nn.GELU()
            self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        dtype = self.linear_1.weight.dtype
        if features.dtype != dtype and not torch.is_autocast_enabled(features.device.type):
            features = features.to(dtype)
        hidden = self.linear_1(features)
        if self.kind == "mlp":
            hidden = self.linear_2(self.act(hidden))
        return hidden


def build_projector(kind: str, in_dim: int, out_dim: int) -> Projector:
    """A fresh projector of ``kind`` (``"linear"`` or ``"mlp"``) from ``in_dim`` to ``out_dim`` features.

    Raises:
        ValueError: for another ``kind`` or non-positive sizes.
    """
    if in_dim <= 0 or out_dim <= 0:
        raise ValueError(f"projector sizes must be positive, got {in_dim} -> {out_dim}")
    return Projector(in_dim, out_dim, kind)
