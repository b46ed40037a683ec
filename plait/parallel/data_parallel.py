"""Data parallelism: DDP over the ``dp`` axis (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.parallel.mesh import DistInfo

__all__ = ["apply_data_parallel", "unwrap"]


def apply_data_parallel(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap ``model`` in DDP when there is more than one rank; otherwise return it unchanged.

    ``find_unused_parameters=True`` because a rank's share of a batch may hold no item of some modality
    (its encoder branch then does not run there); DDP still all-reduces zeros for it, so every rank ends
    with the same gradient, and parameters unused on every rank keep ``grad=None`` as in one process.
    Parameters that can never get a gradient (after the selected encoder layer) are frozen at build time.
    """
    if info.world_size == 1:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
