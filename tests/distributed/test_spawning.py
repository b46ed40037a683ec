"""``free_port`` (tests/distributed/spawning.py): the port it returns stays reserved against the kernel's automatic
port choices (another test's gloo listener or ``TCPStore`` on port 0) until the rendezvous binds it, which it can.
``spawn_and_exit_codes``: workers killed on purpose give their exit codes, a worker's exception fails the test."""

from __future__ import annotations

import datetime
import os
import signal
import socket

import pytest
import torch.distributed as dist

from tests.distributed.spawning import free_port, spawn_and_exit_codes


def test_a_free_port_is_never_chosen_by_bind_zero_yet_a_store_binds_it():
    port = free_port()
    others = [socket.socket() for _ in range(500)]  # a released port was taken by one of 500 in about 1 run of 20
    try:
        for s in others:
            s.bind(("127.0.0.1", 0))
        assert port not in {s.getsockname()[1] for s in others}
    finally:
        for s in others:
            s.close()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    store.set("key", "value")
    assert (store.port, store.get("key")) == (port, b"value")
    assert free_port() != port


def _killed_or_raising(rank: int, action: str) -> None:
    """Rank 1 SIGKILLs itself or raises (``action``); the others return."""
    if rank == 1 and action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and action == "raise":
        raise RuntimeError("worker 1 gave up")


def test_workers_killed_on_purpose_give_their_exit_codes_and_a_raising_one_fails():
    assert spawn_and_exit_codes(_killed_or_raising, ("kill",), 3, 60, "kill test") == [0, -9, 0]
    with pytest.raises(pytest.fail.Exception, match="worker 1 raised:(.|\n)*worker 1 gave up"):
        spawn_and_exit_codes(_killed_or_raising, ("raise",), 2, 60, "raise test")
