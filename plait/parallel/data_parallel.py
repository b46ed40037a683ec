"""Data parallelism over the ``dp`` (and ``cp``) ranks: a DDP wrapper that makes every rank start from rank 0's
parameters, and :func:`sum_gradients`, the one gradient all-reduce both trainers call after their last
backward (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.parallel.mesh import DistInfo

__all__ = ["apply_data_parallel", "unwrap", "sum_gradients", "BUCKET_ELEMENTS"]

BUCKET_ELEMENTS = 1 << 24
"""Elements per all-reduce bucket of :func:`sum_gradients` (bounds its temporary flat buffer)."""


def sum_gradients(params: Sequence[nn.Parameter], group: Any = None, device: torch.device | str = "cpu",
                  bucket_elements: int = BUCKET_ELEMENTS) -> None:
    """Sum ``.grad`` of ``params`` over the ranks of ``group`` (default: all ranks), in place.

    A parameter without a gradient on every rank keeps ``grad=None`` (as in one process: the optimizer skips
    it); one with a gradient on some rank gets the sum (zeros where it was unused). One all-reduce of a
    per-parameter flag (int32 ``[len(params)]`` on ``device``), then one per bucket: a run of parameters of one
    gradient dtype and device of at most ``bucket_elements`` elements (a larger parameter alone), flattened.
    Collective over ``group``: every rank passes the same parameters in the same order.
    """
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, group=group)
    used = [p for p, n in zip(params, present.tolist()) if n > 0]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets(used, bucket_elements):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # type: ignore[union-attr]
        dist.all_reduce(flat, group=group)
        for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p))  # type: ignore[union-attr]


def _buckets(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into runs of one gradient dtype/device and at most ``limit`` elements."""
    out: list[list[nn.Parameter]] = []
    size, key = 0, None
    for p in params:
        k = (p.grad.dtype, p.grad.device)  # type: ignore[union-attr]
        if not out or k != key or size + p.numel() > limit:
            out.append([])
            size, key = 0, k
        out[-1].append(p)
        size += p.numel()
    return out


def apply_data_parallel(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap ``model`` in DDP when there is more than one rank; otherwise return it unchanged.

    The trainer's forward passes bypass the wrapper (deferred encoder backwards run after DDP's reducer
    would have fired; gradients are summed by :func:`sum_gradients`): what it provides is the broadcast of
    rank 0's parameters and buffers at construction. ``find_unused_parameters=True`` keeps a forward through the
    wrapper valid when a rank's share holds no item of some modality.
    """
    if info.world_size == 1:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
