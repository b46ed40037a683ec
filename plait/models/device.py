"""The torch device a job, a profile or a generation runs on, from its ``device`` setting."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str, local_rank: int | None = None) -> torch.device:
    """``"auto"``: a CUDA device when there is one, else the CPU; anything else as ``torch.device``. With
    ``local_rank`` (a process of a job started by ``torchrun``), a CUDA device is ``cuda:<local_rank>``, made the
    process's current device.

    Raises:
        ValueError: for an unknown device string, or a CUDA device on a machine without one.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device here (use cpu or auto)")
    if dev.type == "cuda" and local_rank is not None:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return dev
