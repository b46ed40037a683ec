"""What the multi-process tests share: a free TCP port, a gloo process group for a spawned worker, and spawning
workers with a deadline (a hung collective fails the test instead of hanging the suite)."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float = 90) -> Iterator[None]:
    """Inside a spawned worker: one intra-op thread, the default gloo process group of ``world`` ranks on
    ``127.0.0.1:port`` (collectives time out after ``timeout_s`` seconds), destroyed on exit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def spawn_and_wait(fn: Callable[..., None], args: tuple, nprocs: int, limit_s: float, what: str) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(rank, *args)``), failing the test when a worker
    fails (its exception is raised) or when they have not all finished after ``limit_s`` seconds (killed)."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"{what} timed out after {limit_s} s")
