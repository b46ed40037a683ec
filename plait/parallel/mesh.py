"""Joining the job: this process's rank, world size and device (the rank layout, meshes and groups:
:mod:`plait.parallel.dims`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "resolve_device"]


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


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` -> this process's CUDA device when CUDA is available, else CPU.

    Raises:
        ValueError: when ``"cuda"`` is asked for on a machine without CUDA.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join the process group started by ``torchrun`` (``WORLD_SIZE`` > 1), or run as a single process.

    The backend is NCCL on GPU and gloo on CPU unless given.

    Raises:
        ValueError: for NCCL on a CPU device.
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
