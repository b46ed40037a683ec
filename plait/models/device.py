"""The torch device a job, a profile or a generation runs on, from its ``device`` setting, and its CPU threads."""

from __future__ import annotations

import logging
import math
import os

import torch

__all__ = ["resolve_device", "choose_cpu_threads", "host_cpu_threads", "apply_cpu_threads"]

logger = logging.getLogger(__name__)


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


def choose_cpu_threads(requested: int, omp_num_threads: str | None, cores: int, load: float,
                       local_processes: int) -> tuple[int, str]:
    """torch's intra-op threads for one process and why: ``requested`` (``train.threads`` / ``--threads``) when > 0;
    else ``OMP_NUM_THREADS`` when set (``torchrun`` sets it to 1 per worker unless the user did); else this process's
    share of the cores no other work keeps busy: ``(cores - load) / local_processes`` rounded, at least 1, at most
    ``cores // local_processes``. ``load`` is the 1-minute load average before the job starts (runnable processes:
    other work). torch's own default, one thread per core, oversubscribes a shared CPU: a job beside one busy
    process trained 8-80x slower with 2 threads than with 1 on 2 cores (OpenMP threads spin-waiting for a core).

    Args:
        requested: threads asked for, 0 for the automatic choice.
        omp_num_threads: the ``OMP_NUM_THREADS`` environment variable, or None.
        cores: cores this process may run on (``os.sched_getaffinity``).
        load: 1-minute load average (``os.getloadavg()[0]``).
        local_processes: the job's processes on this host (``LOCAL_WORLD_SIZE``).

    Raises:
        ValueError: for ``requested`` < 0, ``cores`` or ``local_processes`` < 1, or an ``OMP_NUM_THREADS`` that is
            not a positive integer.
    """
    if requested < 0 or cores < 1 or local_processes < 1:
        raise ValueError(f"threads must be >= 0 and cores, processes >= 1; got {requested}, {cores}, "
                         f"{local_processes}")
    if requested:
        return requested, "as set"
    if omp_num_threads:
        if not omp_num_threads.strip().isdigit() or int(omp_num_threads) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp_num_threads!r}: a positive integer expected")
        return int(omp_num_threads), "OMP_NUM_THREADS"
    share = max(1, cores // local_processes)
    free = max(0.0, cores - max(0.0, load))
    threads = max(1, min(share, math.floor(free / local_processes + 0.5)))
    return threads, (f"auto: {cores} cores, load {load:.1f} from other work, {local_processes} process"
                     f"{'es' if local_processes > 1 else ''} of the job on this host")


def host_cpu_threads(requested: int, local_processes: int) -> tuple[int, str]:
    """:func:`choose_cpu_threads` on this host: the cores this process may run on, the 1-minute load average and
    ``OMP_NUM_THREADS``, for a job of ``local_processes`` processes here. Returns ``(threads, why)``.

    Raises:
        ValueError: as :func:`choose_cpu_threads`.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return choose_cpu_threads(requested, os.environ.get("OMP_NUM_THREADS"), cores, load, local_processes)


def apply_cpu_threads(requested: int, what: str = "train.threads", local_processes: int | None = None) -> int:
    """Set torch's intra-op threads by :func:`host_cpu_threads` for ``local_processes`` processes on this host
    (default: the ``LOCAL_WORLD_SIZE`` torchrun sets, else 1), and log the choice naming ``what`` to override it;
    returns the threads."""
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads, why = host_cpu_threads(requested, local_processes)
    torch.set_num_threads(threads)
    if why != "as set":
        logger.info("CPU intra-op threads: %d (%s; set %s to choose)", threads, why, what)
    return threads
