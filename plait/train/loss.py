"""The loss of every plait training path (non-pipeline trainer, pipeline runtime via its ``loss_fn``, profiler)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.data.processing import IGNORE

__all__ = ["token_loss_sum", "zero_loss"]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32) over positions whose label is not -100.

    Args:
        logits: ``[B, N, V]``; labels: ``[B, N]`` already shifted (label t is the target of position t).
    Returns:
        a scalar; 0 (with a graph) when there is no target.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def zero_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token loss sum times 0: a DP replica without samples joins the gradient sum with zeros."""
    return token_loss_sum(logits, labels) * 0.0
