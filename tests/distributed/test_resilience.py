"""Surviving a SIGKILLed worker in place: heterogeneous pipelines, membership re-forming, reconfiguration with
state copied from the surviving replica, the interrupted step replayed; losses, gradients and final parameters
equal one process (tests/distributed/resilience_worker.py)."""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.resilience_worker import STEPS, VICTIM, worker
from tests.distributed.spawning import free_port

LIMIT_S = 120


def test_killed_worker_is_survived_by_reconfiguring_and_replaying_the_step():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(w, 3, port)) for w in range(3)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + LIMIT_S
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].kill()
    assert not hung, f"workers {hung} still running after {LIMIT_S} s"
    assert [p.exitcode for p in procs] == [0 if w != VICTIM else -9 for w in range(3)]
    results = {w: json.loads(store.get(f"result/{w}")) for w in (0, 2)}
    for w, seen in results.items():
        assert len(seen["losses"]) == len(STEPS)  # every step committed once (losses checked in the worker)
        assert seen["pipelines"] == [[[0], [2]]]  # pipeline 0 shrank to the 1-rank template on worker 0
        (copies,) = seen["copies"]  # one reconfiguration: every copy from worker 2 (the surviving replica) to 0
        assert copies and all(src == 2 and dst == 0 for _, src, dst in copies)
        assert len(seen["recovery_s"]) == 1 and 0 < seen["recovery_s"][0] < 15
        print(f"worker {w}: recovery (failure seen -> replayed step done) {seen['recovery_s'][0]:.2f} s, "
              f"{len(copies)} units copied to worker 0")
    assert results[0]["losses"] == results[2]["losses"]
