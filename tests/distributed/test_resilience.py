"""Surviving SIGKILLed workers in place (rank 0, then the other pipeline's only rank): heterogeneous pipelines, membership re-forming, reconfiguration with
state copied from the surviving replica, the interrupted step replayed; losses, gradients and final parameters
equal one process (tests/distributed/resilience_worker.py)."""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist

from tests.distributed.resilience_worker import STEPS, VICTIMS, worker
from tests.distributed.spawning import free_port, spawn_and_exit_codes

LIMIT_S = 180  # a hang guard: about 40 s on an idle 2-core machine


def test_killed_worker_is_survived_by_reconfiguring_and_replaying_the_step():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    codes = spawn_and_exit_codes(worker, (3, port), 3, LIMIT_S, "resilient workers on 3 processes")
    assert codes == [-9 if w in VICTIMS else 0 for w in range(3)]
    seen = json.loads(store.get("result/1"))
    assert len(seen["losses"]) == len(STEPS)  # every step committed once (losses checked in the worker)
    # rank 0 killed: pipeline 0 shrank to worker 1; then pipeline 1 (worker 2) lost its only rank
    assert seen["pipelines"] == [[[1], [2]], [[1]]]
    copies = seen["copies"]
    assert copies[0] and all(src == 2 and dst == 1 for _, src, dst in copies[0]) and copies[1] == []
    assert len(seen["recovery_s"]) == 2 and all(s > 0 for s in seen["recovery_s"])
    print("recovery (failure seen -> replayed step done): "
          + ", ".join(f"{s:.2f} s" for s in seen["recovery_s"]) + f"; {len(copies[0])} units copied to worker 1")
