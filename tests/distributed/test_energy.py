"""Energy plans in the pipeline runtime on gloo (tests/distributed/energy_worker.py): PP=2 with a recording
frequency controller records exactly the planned frequency before each action and trains bit-identically to a
run without it; DP=2 x PP=2 with an injected slow replica switches the other replica to the frontier point at the
straggler's time and back when it recovers."""

from __future__ import annotations

import json

from tests.distributed.energy_worker import SLOW_STEPS, STEPS, worker_identical, worker_straggler
from tests.distributed.spawning import free_port, spawn_and_wait


def test_pp2_energy_plan_records_planned_frequencies_and_trains_identically():
    spawn_and_wait(worker_identical, (2, free_port()), 2, 180, "PP=2 energy plan test")


def test_dp2_straggler_switches_the_other_replica_and_back(tmp_path):
    out = tmp_path / "straggler.json"
    spawn_and_wait(worker_straggler, (4, free_port(), str(out)), 4, 240, "DP=2 x PP=2 straggler test")
    rows = {(r["dp"], r["pp"]): r for r in json.loads(out.read_text())}
    first_slow, patience = SLOW_STEPS[0], 2
    for pp in (0, 1):
        assert rows[(1, pp)]["points"] == [0] * STEPS, rows  # the straggler itself always runs the fastest point
        points = rows[(0, pp)]["points"]
        switch = first_slow + patience  # slow steps 2 and 3 seen: step 4 runs the slower point
        end_slow = SLOW_STEPS[-1] + 1  # the first step the straggler is fast again
        # straggler at >= 5x: the least-energy point within T* x slowdown, the slowest one (index 2)
        assert points[:end_slow] == [0] * switch + [2] * (end_slow - switch), rows
        back = next((i for i in range(end_slow, STEPS) if points[i] == 0), STEPS)
        assert end_slow + patience <= back < STEPS and points[-1] == 0, rows  # back at T* after `patience` fast steps
        # (later steps may wobble on a loaded machine: only the first return and the last step are asserted)
        assert rows[(0, pp)]["history"][switch - 1][0] == 1  # replica 1 was named the straggler
