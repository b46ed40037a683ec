"""Workers of tests/distributed/test_membership.py: 4 workers all-reduce; worker 2 is SIGKILLed, the survivors
re-form their group and all-reduce again; then worker 0 (rank 0 of the re-formed group) is SIGKILLed and the
last two do it once more. Each survivor writes what it saw to the parent's store."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from plait.parallel.membership import Membership

VICTIMS = (2, 0)  # worker ids killed, one per generation (0 is rank 0 of generation 1)
TIMEOUT_S = 8.0
DEAD_AFTER_S = 6.0
"""A member is dead when its heartbeat is this old (a SIGKILLed worker's stops at once). Not the default 1.5 s: on a
loaded 2-core machine (load average 4) a live worker's heartbeat thread was starved that long, and the survivors
took it for dead (NoQuorumError)."""


def _sum(m: Membership) -> int:
    """All-reduce a one on every member: the member count."""
    t = torch.ones(())
    dist.all_reduce(t)
    return int(t)


def worker(wid: int, world: int, port: int) -> None:
    """One worker (``wid`` = its rank in generation 0)."""
    torch.set_num_threads(1)
    m = Membership("127.0.0.1", port, wid, world, timeout_s=TIMEOUT_S, dead_after_s=DEAD_AFTER_S,
                   min_members=2)
    m.join()
    seen = {"sums": [_sum(m)], "left": [], "ranks": [m.rank], "recovery_s": []}
    for victim in VICTIMS:
        if wid == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            _sum(m)
            failed = False
        except RuntimeError:  # gloo: connection closed by the dead peer, or the collective timeout
            failed = True
        assert failed, f"worker {wid}: the all-reduce succeeded without worker {victim}"
        seen["left"].append(list(m.reform()))
        seen["sums"].append(_sum(m))
        seen["recovery_s"].append(time.monotonic() - start)
        seen["ranks"].append(m.rank)
    m.close()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    store.set(f"result/{wid}", json.dumps(seen))
