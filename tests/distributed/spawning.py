"""What the multi-process tests share: a free TCP port, a gloo process group for a spawned worker, spawning
workers with a deadline (a hung collective fails the test instead of hanging the suite), and single-process
reference runs computed once per pytest session for every test that compares against the same job."""

from __future__ import annotations

import copy
import datetime
import hashlib
import importlib
import json
import multiprocessing
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["PRELOAD", "START_METHOD", "free_port", "gloo_group", "job_key", "run_main", "shared_reference",
           "spawn_and_wait", "spawn_and_exit_codes"]


_HELD_PORTS: list[socket.socket] = []
"""The sockets :func:`free_port` bound, open until this process ends."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, reserved until this process ends: the socket that found it
    stays bound (``SO_REUSEADDR``, never listening), so the kernel hands the port to no other ``bind(0)`` or
    ``connect()`` on the machine (another test's gloo listener or ``TCPStore`` on port 0 could otherwise take it
    before the rendezvous binds it: ranks then meet a foreign store, gloo's "connection closed by peer"), while the
    ``TCPStore`` or gloo rendezvous given the port binds it as usual (torch sets ``SO_REUSEADDR`` too)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(s)
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


PRELOAD = ("plait.train.trainer", "plait.train.pipeline_trainer", "tests.distributed.fork_preload")
"""Modules the fork server imports once per pytest session; every worker forked from it starts with them loaded
(``fork_preload``, last: their objects frozen out of the workers' garbage collections)."""
START_METHOD = os.environ.get("PLAIT_TEST_START_METHOD", "forkserver")
"""How :func:`spawn_and_wait` starts workers: "forkserver" (default: forked from one server process that imported
:data:`PRELOAD`, a fraction of a second per worker instead of an interpreter start and the torch, transformers and
plait imports, about 5.7 CPU-s per worker) or "spawn" (a fresh interpreter per worker)."""


def _in_environment(rank: int, environ: dict, start_method: str, fn: Callable[..., None], *args) -> None:
    """A worker's entry: ``fn(rank, *args)`` under ``environ``, the test process's environment when the workers
    were started (a forked worker would otherwise inherit the fork server's, frozen when it started), with the
    test process's default start method for the processes it starts itself (DataLoader workers: "fork" on Linux,
    as under torchrun; a started worker's default is otherwise its own start method)."""
    os.environ.clear()
    os.environ.update(environ)
    multiprocessing.set_start_method(start_method, force=True)
    fn(rank, *args)


def _start(fn: Callable[..., None], args: tuple, nprocs: int) -> mp.ProcessContext:
    """``fn(rank, *args)`` started in ``nprocs`` processes by :data:`START_METHOD` under this process's environment."""
    if START_METHOD == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # no effect once the server runs
    environment = (dict(os.environ), multiprocessing.get_start_method())
    return mp.start_processes(_in_environment, args=(*environment, fn, *args), nprocs=nprocs, join=False,
                              start_method=START_METHOD)


def spawn_and_wait(fn: Callable[..., None], args: tuple, nprocs: int, limit_s: float, what: str) -> None:
    """``fn(rank, *args)`` in ``nprocs`` new processes (``torch.multiprocessing.start_processes`` by
    :data:`START_METHOD`, each under this process's environment), failing the test when a worker fails (its
    exception is raised) or when they have not all finished after ``limit_s`` seconds (killed)."""
    context = _start(fn, args, nprocs)
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"{what} timed out after {limit_s} s")


def spawn_and_exit_codes(fn: Callable[..., None], args: tuple, nprocs: int, limit_s: float, what: str) -> list[int]:
    """As :func:`spawn_and_wait` for workers that may die on purpose (SIGKILLed to test failure handling): each
    worker runs to its end, none is stopped when another dies; the exit codes by rank (``-9``: SIGKILLed). Fails
    the test, with the traceback, when a worker raised, or when some still run after ``limit_s`` seconds (all
    killed)."""
    context = _start(fn, args, nprocs)
    deadline = time.monotonic() + limit_s
    for proc in context.processes:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(context.processes) if proc.is_alive()]
    for proc in context.processes:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if hung:
        pytest.fail(f"{what} timed out after {limit_s} s: workers {hung} still running")
    for rank, path in enumerate(context.error_files):
        if os.path.isfile(path) and os.path.getsize(path):
            pytest.fail(f"{what}: worker {rank} raised:\n{pickle.loads(Path(path).read_bytes())}")
    return [proc.exitcode for proc in context.processes]


def _torchrun_rank(rank: int, world: int, port: int, module: str, function: str, argv: tuple[str, ...]) -> None:
    """One rank of :func:`run_main`: the environment torchrun gives its workers (one process: none), then
    ``module.function(*argv)``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    getattr(importlib.import_module(module), function)(*argv)


def run_main(module: str, argv: list[str], nprocs: int, limit_s: float, what: str, function: str = "main") -> None:
    """``module.function(*argv)`` (a worker script's entry, e.g. ``tests.distributed.tp_train_worker``) on ``nprocs``
    processes started by :func:`spawn_and_wait` with the variables ``torchrun --nproc_per_node=nprocs`` sets
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free port;
    none for one process, as ``python script.py``): the same job as under torchrun without its launcher and an
    interpreter start and imports per rank. A rank's exception fails the test with its traceback; ``limit_s``
    seconds in all."""
    spawn_and_wait(_torchrun_rank, (nprocs, free_port(), module, function, tuple(argv)), nprocs, limit_s, what)


T = TypeVar("T")
_REFERENCES: dict[str, object] = {}


def job_key(what: str, cfg: dict) -> str:
    """A key naming the run of job ``cfg`` (a config dict) by ``what`` (the worker or runner): ``metrics.run_dir``
    left out (where a run writes does not change what it computes) and every string naming an existing file
    replaced by the SHA-256 of its bytes (the same records written under two tests' tmp folders are one job)."""

    def normal(value):
        if isinstance(value, dict):
            return {k: normal(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [normal(v) for v in value]
        if isinstance(value, str) and "/" in value and Path(value).is_file():
            return "sha256:" + hashlib.sha256(Path(value).read_bytes()).hexdigest()
        return value

    job = {k: v for k, v in cfg.items() if k != "metrics"}
    job["metrics"] = {k: v for k, v in cfg.get("metrics", {}).items() if k != "run_dir"}
    return what + ":" + json.dumps(normal(job), sort_keys=True)


def shared_reference(what: str, cfg: dict, compute: Callable[[], T]) -> T:
    """``compute()``, a deterministic single-process reference run of job ``cfg`` by ``what``, run once per pytest
    session for each :func:`job_key`: every later test comparing against the same job gets a deep copy of the
    first result (tensors included) instead of another process start, model build and training. Use it only where
    the test reads the returned result alone, not the files the run wrote."""
    key = job_key(what, cfg)
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return copy.deepcopy(_REFERENCES[key])
