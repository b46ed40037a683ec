"""Failure detection and in-place re-forming of the gloo process group (plait.parallel.membership): 4 processes,
one SIGKILLed (then rank 0 of the re-formed group), the survivors agree and all-reduce again, never hanging."""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist

from tests.distributed.membership_worker import VICTIMS, worker
from tests.distributed.spawning import free_port, spawn_and_exit_codes

LIMIT_S = 120  # a hang guard: about 25 s on an idle 2-core machine


def test_survivors_of_sigkilled_workers_reform_the_group_and_all_reduce_again():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    codes = spawn_and_exit_codes(worker, (4, port), 4, LIMIT_S, "membership re-forming on 4 processes")
    assert [codes[w] for w in VICTIMS] == [-9, -9]
    survivors = [w for w in range(4) if w not in VICTIMS]
    assert [codes[w] for w in survivors] == [0, 0]
    for w in survivors:
        seen = json.loads(store.get(f"result/{w}"))
        assert seen["sums"] == [4, 3, 2]  # every generation's all-reduce over exactly its members
        assert seen["left"] == [[2], [0]]
        assert seen["ranks"] == {1: [1, 1, 0], 3: [3, 2, 1]}[w]  # ranks renumbered over the survivors
        assert len(seen["recovery_s"]) == 2 and all(s > 0 for s in seen["recovery_s"]), seen["recovery_s"]
        print(f"worker {w}: recovery (failure seen -> first all-reduce of the new group) "
              + ", ".join(f"{s:.2f} s" for s in seen["recovery_s"]))
