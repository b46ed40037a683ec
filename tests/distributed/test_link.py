"""The auto-plan machine facts on gloo processes: the link measured by ranks 0 and 1 (``plait.measure.link``)
and the memory cap reach every rank identically (the plan search must see the same numbers everywhere)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait

NBYTES = 1 << 20


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    """One rank: join the group, take the auto-plan inputs, write them. Rank ``r`` claims ``r + 1`` processes on
    its host, so the ranks' own caps differ and the agreed one is the last rank's."""
    from plait.measure.machine import auto_plan_inputs, device_memory_bytes

    os.environ["LOCAL_WORLD_SIZE"] = str(rank + 1)
    with gloo_group(rank, world, port, timeout_s=60):
        inputs = auto_plan_inputs("cpu", NBYTES)
        own = device_memory_bytes("cpu")[0]
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"p2p": inputs.p2p.to_dict(), "cap": inputs.memory_cap_bytes, "own": own, "link": inputs.link_source}))


def _run(world: int, folder: Path, limit_s: float = 60.0) -> list[dict]:
    spawn_and_wait(_worker, (world, free_port(), str(folder)), world, limit_s,
                   f"link measurement on {world} processes")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank_zeros_link_and_the_smallest_cap(world, tmp_path):
    ranks = _run(world, tmp_path)
    first = ranks[0]["p2p"]
    assert all(r["p2p"] == first for r in ranks)
    assert first["send_overhead_s"] > 0 and first["recv_overhead_s"] > 0  # packing / unpacking 1 MiB costs time
    assert first["latency_s"] >= 0 and (first["bandwidth_Bps"] is None or first["bandwidth_Bps"] > 0)
    assert f"measured: gloo ping-pong of ranks 0 and 1, {NBYTES} B message" in ranks[0]["link"]
    smallest = min(r["own"] for r in ranks)
    assert smallest == ranks[-1]["own"] < ranks[0]["own"]  # rank r shares the host with r + 1 processes
    assert all(r["cap"] == pytest.approx(0.9 * smallest) for r in ranks)
