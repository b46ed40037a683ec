"""Projectors: map encoder features into the LLM's embedding space."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

__all__ = ["PROJECTOR_KINDS", "Projector", "build_projector"]

PROJECTOR_KINDS = ("linear", "mlp", "gemma3")
"""The projector kinds of :class:`Projector`."""


class _Gemma3Norm(Gemma3RMSNorm):
    """transformers' ``Gemma3RMSNorm`` (``x * (1 + weight)``) with ``reset_parameters`` (weight 0, its init), so a
    projector materialised from the meta device (:mod:`plait.models.init`) is initialised as Hugging Face's."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class Projector(nn.Module):
    """``linear``: one Linear; ``mlp``: Linear -> GELU -> Linear (the LLaVA-1.5 projector); ``gemma3``: Gemma 3's
    ``mm_soft_emb_norm`` (transformers' ``Gemma3RMSNorm`` over the ``in_dim`` features, epsilon ``norm_eps``) ->
    Linear without bias (its ``mm_input_projection_weight``, stored transposed as ``linear_1.weight``
    ``[out_dim, in_dim]``); the average pooling of Gemma 3's projector is the branch's ``downsample``.

    Input ``[..., in_dim]``, output ``[..., out_dim]``; input ``[..., in_dim + e]`` (a DeepStack branch's rows,
    :mod:`plait.models.deepstack`: the merged feature, then features added inside the LLM) gives
    ``[..., out_dim + e]``, the first ``in_dim`` values projected and the other ``e`` passed through unchanged. Features of another dtype than the projector's weights (a
    tower kept in bf16 before an fp32 projector) are cast to the weights' dtype, unless autocast chooses the
    matmul dtype.

    Raises:
        ValueError: for a kind not in :data:`PROJECTOR_KINDS`.
    """

    def __init__(self, in_dim: int, out_dim: int, kind: str = "mlp", norm_eps: float = 1e-6) -> None:
        super().__init__()
        if kind not in PROJECTOR_KINDS:
            raise ValueError(f"projector kind must be one of {', '.join(PROJECTOR_KINDS)}, got {kind!r}")
        self.kind = kind
        if kind == "gemma3":
            self.norm = _Gemma3Norm(in_dim, eps=norm_eps)
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=kind != "gemma3")
        if kind == "mlp":
            self.act = nn.GELU()
            self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        width = self.linear_1.in_features
        if features.shape[-1] > width:  # DeepStack rows: project the merged feature, pass the others through
            rest = features[..., width:]
            head = self.forward(features[..., :width])
            return torch.cat([head, rest.to(head.dtype)], dim=-1)
        dtype = self.linear_1.weight.dtype
        if features.dtype != dtype and not torch.is_autocast_enabled(features.device.type):
            features = features.to(dtype)
        if self.kind == "gemma3":
            features = self.norm(features)
        hidden = self.linear_1(features)
        if self.kind == "mlp":
            hidden = self.linear_2(self.act(hidden))
        return hidden


def build_projector(kind: str, in_dim: int, out_dim: int, norm_eps: float = 1e-6) -> Projector:
    """A fresh projector of ``kind`` (:data:`PROJECTOR_KINDS`) from ``in_dim`` to ``out_dim`` features
    (``norm_eps``: the ``gemma3`` kind's RMSNorm epsilon, the tower's ``layer_norm_eps``).

    Raises:
        ValueError: for another ``kind`` or non-positive sizes.
    """
    if in_dim <= 0 or out_dim <= 0:
        raise ValueError(f"projector sizes must be positive, got {in_dim} -> {out_dim}")
    return Projector(in_dim, out_dim, kind, norm_eps)
