"""Failure detection and in-place re-forming of the gloo process group (plait.parallel.membership): 4 processes,
one SIGKILLed (then rank 0 of the re-formed group), the survivors agree and all-reduce again, never hanging."""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.membership_worker import VICTIMS, worker
from tests.distributed.spawning import free_port

LIMIT_S = 180  # a hang guard: about 25 s on an idle 2-core machine


def test_survivors_of_sigkilled_workers_reform_the_group_and_all_reduce_again():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(w, 4, port)) for w in range(4)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + LIMIT_S
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].kill()
    assert not hung, f"workers {hung} still running after {LIMIT_S} s"
    assert [procs[w].exitcode for w in VICTIMS] == [-9, -9]
    survivors = [w for w in range(4) if w not in VICTIMS]
    assert [procs[w].exitcode for w in survivors] == [0, 0]
    for w in survivors:
        seen = json.loads(store.get(f"result/{w}"))
        assert seen["sums"] == [4, 3, 2]  # every generation's all-reduce over exactly its members
        assert seen["left"] == [[2], [0]]
        assert seen["ranks"] == {1: [1, 1, 0], 3: [3, 2, 1]}[w]  # ranks renumbered over the survivors
        assert all(0 < s < 15 for s in seen["recovery_s"]), seen["recovery_s"]
        print(f"worker {w}: recovery (failure seen -> first all-reduce of the new group) "
              + ", ".join(f"{s:.2f} s" for s in seen["recovery_s"]))
