"""Joining the job: this process's rank, world size and device (the rank layout, meshes and groups:
:mod:`plait.parallel.dims`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.models.device import resolve_device

__all__ = ["DistInfo", "init_distributed"]


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
