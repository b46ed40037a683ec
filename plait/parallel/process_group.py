"""Joining the job: this process's rank, world size and device (the rank layout, meshes and groups:
:mod:`plait.parallel.dims`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.models.device import resolve_device

__all__ = ["DistInfo", "broadcast_from_main", "init_distributed", "max_over_ranks"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: global rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join the process group started by ``torchrun`` (``WORLD_SIZE`` > 1), or run as a single process.

    The device is ``resolve_device(device, LOCAL_RANK)``; the backend is NCCL on GPU and gloo on CPU unless given.

    Raises:
        ValueError: for NCCL on a CPU device, and as ``resolve_device``.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("parallel.backend='nccl' needs CUDA devices; use gloo on CPU")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, dev)


def broadcast_from_main(value: Any, info: DistInfo, wait_s: float) -> Any:
    """Rank 0's ``value`` (any picklable object) on every rank; ``value`` itself in a single process. Sent in a gloo
    group of its own whose timeout is ``wait_s`` seconds, not the job's ``parallel.timeout_s``, so the other ranks
    may wait while rank 0 works alone for minutes; a rank that dies ends the wait at once (its connections close).
    """
    box = [value]
    if info.world_size > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        finally:
            dist.destroy_process_group(group)
    return box[0]


def max_over_ranks(value: int, info: DistInfo) -> int:
    """The largest of every rank's ``value`` (an all-reduce of one integer over the job's default group, on
    ``info.device``: NCCL needs a CUDA tensor); ``value`` itself in a single process. Every rank must call it at
    the same point of the job."""
    if info.world_size == 1 or not dist.is_initialized():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())
