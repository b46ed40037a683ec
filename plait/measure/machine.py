"""What ``parallel.plan = "auto"`` needs to know about the machine a job runs on: the memory one pipeline rank
may fill and the stage-to-stage link (``plait.measure.link``).

- :func:`device_memory_bytes`: a CUDA device's total memory (``torch.cuda.get_device_properties``); on CPU the
  host's physical RAM (``os.sysconf``: pages x page size) divided by the processes of the job on this host
  (``LOCAL_WORLD_SIZE``, set by ``torchrun``; 1 without it).
- :func:`memory_cap`: that times ``MEMORY_FRACTION``.
- :func:`auto_plan_inputs` (collective): the smallest cap over all ranks (a plan must fit every device, and
  every rank must search with the same numbers to agree on the plan) and the link (:func:`link.job_link`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.measure.link import job_link
from plait.planner.pipeline.types import P2PModel

__all__ = ["MEMORY_FRACTION", "AutoPlanInputs", "auto_plan_inputs", "device_memory_bytes", "memory_cap"]

MEMORY_FRACTION = 0.9
"""Fraction of a device's memory a plan may fill (the rest: CUDA context, allocator fragmentation and
workspaces on a GPU; the OS and other programs on a CPU); ``plait.commands.plan.command.plan_command``'s
``memory_fraction`` has the same default."""

_GIB = 2**30


def device_memory_bytes(device: torch.device | str) -> tuple[int, str]:
    """Bytes of memory one process of the job has on ``device``, and where the number comes from.

    CUDA: the device's ``total_memory``. CPU: ``SC_PHYS_PAGES * SC_PAGE_SIZE`` (physical RAM) floor-divided by
    ``LOCAL_WORLD_SIZE`` (processes on this host; 1 when unset).

    Raises:
        ValueError: on ``LOCAL_WORLD_SIZE`` that is not an integer >= 1, or a device type other than cuda/cpu.
    """
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name} {props.total_memory / _GIB:.1f} GiB"
    if device.type != "cpu":
        raise ValueError(f"device memory of a {device.type!r} device is not known; use cuda or cpu")
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local = int(raw)
    except ValueError:
        local = 0
    if local < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer >= 1, got {raw!r}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // local, f"RAM {ram / _GIB:.1f} GiB / {local} process(es) on this host"


def memory_cap(device: torch.device | str, fraction: float = MEMORY_FRACTION) -> tuple[float, str]:
    """``fraction`` x :func:`device_memory_bytes` (bytes) and a description of it.

    Raises:
        ValueError: on a ``fraction`` outside (0, 1], and as :func:`device_memory_bytes`.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    total, source = device_memory_bytes(device)
    cap = fraction * total
    return cap, f"{cap / _GIB:.1f} GiB ({100 * fraction:.0f}% of {source})"


@dataclass(frozen=True)
class AutoPlanInputs:
    """Machine facts an auto plan is searched with.

    Attributes:
        memory_cap_bytes: bytes one pipeline rank may fill (smallest over the ranks).
        p2p: the stage-to-stage link.
        memory_source: how the cap was obtained; link_source: how the link was obtained.
    """

    memory_cap_bytes: float
    p2p: P2PModel
    memory_source: str
    link_source: str

    def describe(self) -> str:
        """One line: ``memory cap ... per rank; link ...``."""
        return f"memory cap {self.memory_source} per rank; link {self.link_source}"


def auto_plan_inputs(device: torch.device | str, nbytes: int, fraction: float = MEMORY_FRACTION) -> AutoPlanInputs:
    """Memory cap and link for ``parallel.plan = "auto"``; collective when a process group of more than one rank
    is initialised (every rank calls it with the same ``nbytes``; all get the same result).

    Args:
        device: this rank's device.
        nbytes: the largest message a stage sends to its successor per microbatch (bytes), for the link fit.
        fraction: see :func:`memory_cap`.

    Raises:
        ValueError: as :func:`memory_cap` and ``link.job_link``.
    """
    cap, source = memory_cap(device, fraction)
    if dist.is_initialized() and dist.get_world_size() > 1:
        caps: list = [None] * dist.get_world_size()
        dist.all_gather_object(caps, cap)
        rank = min(range(len(caps)), key=caps.__getitem__)
        if caps[rank] < cap:
            cap, source = caps[rank], f"{caps[rank] / _GIB:.1f} GiB (rank {rank}'s, the smallest over the ranks)"
    p2p, link = job_link(torch.device(device), nbytes)
    return AutoPlanInputs(float(cap), p2p, source, link)
