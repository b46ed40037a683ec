"""The run folder's lock in a job of 2 gloo ranks (``hold_run_lock``): rank 0 alone takes it, and its refusal
reaches every rank (a broadcast), so no rank is left waiting in the job's first collective. No training: the lock
is held or refused around a barrier (a few seconds, the workers forked from the preloaded server)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from plait.train.run_lock import LOCK_NAME, hold_run_lock
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait


def _worker(rank: int, world: int, port: int, free: str, busy: str) -> None:
    with gloo_group(rank, world, port, timeout_s=60):
        with hold_run_lock(free, rank == 0, world):  # taken by rank 0 for the job, seen by every rank
            dist.barrier()
            assert json.loads((Path(free) / LOCK_NAME).read_text())["pid"] != 0
            dist.barrier()
        dist.barrier()
        assert not (Path(free) / LOCK_NAME).exists()  # given back by rank 0 on its way out
        try:
            with hold_run_lock(busy, rank == 0, world):
                raise AssertionError(f"rank {rank} entered a folder another host's run holds")
        except ValueError as exc:
            assert str(exc).startswith(f"{busy} is in use by a plait run on host elsewhere.example: process 7")
            assert exc.same_on_every_rank  # printed once by the command line, from rank 0
        dist.barrier()  # every rank got here: none waits on a refused rank 0


def test_rank0_takes_the_lock_and_its_refusal_reaches_every_rank(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / LOCK_NAME).write_text(json.dumps({"host": "elsewhere.example", "pid": 7}))
    spawn_and_wait(_worker, (2, free_port(), str(tmp_path / "free"), str(busy)), 2, 120, "run lock on 2 ranks")
    assert json.loads((busy / LOCK_NAME).read_text())["pid"] == 7  # another host's lock is left alone
