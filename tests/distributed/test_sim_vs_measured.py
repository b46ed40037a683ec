"""The simulator against the measured iteration of the demo model on CPU: 2-stage plans on 2 gloo processes
(encoder_parallel and encoders_colocated, encoders on rank 0 and the LLM on rank 1, 1F1B; median over steps;
one intra-op thread per process). See bench/sim_vs_measured.py for the method.

Issue 4 asks for 15% on the iteration time. Three things brought the prediction there (the history is in
bench/sim_vs_measured.py and plait/parallel/pipeline/transport.py): the gloo transport posts its receives ahead of
time (a receive posted after the send waited 5-10 ms for the sender's gloo thread); the simulator charges each
cross-rank message its host time on both ends (LogP's overhead, measured by the bench with the runtime's own
packing); and the bench profiles between the measured steps, in rounds, so that the host's speed drifting
(this is a shared virtual machine) reaches profile and measurement alike. Seven bench runs on an idle machine
then gave predicted / measured ratios of 0.905-1.066 for both layouts.

One measurement can still land outside when the host slows down during part of it, so the test measures once
more before it fails (both attempts' ratios are in the failure message).

The profile is taken with the profiler's CPU-time clock (``clock="thread"``, one thread per process), so it
does not depend on other processes sharing the cores. Two checks:

- work per rank: each rank's main-thread CPU time per step (median) is within 25% of the simulated busy
  time of that rank (40% when the cores are shared: CPU time then still varies with cache and memory
  bandwidth contention, which only catches gross errors);
- iteration time (wall clock): only meaningful when the cores are not shared with other work, so the test
  measures how much CPU this process gets (wall / CPU time of a fixed single-thread loop) before and after,
  and skips this assertion (not the others) when that ratio shows the cores are shared.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.sim_vs_measured import LAYOUTS, compare
from plait.planner.pipeline.schedules import build_schedule

CONTENDED = 1.25  # wall / CPU time above which the cores are shared with other processes
STEPS = 12  # measured pipeline steps per layout (4 rounds of 3, a profile before each round)


def _contention() -> float:
    """Wall time / CPU time of a fixed single-thread matmul loop (about 1.0 on an idle machine)."""
    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(400):
        a @ a
    return (time.perf_counter() - wall) / max(1e-9, time.thread_time() - cpu)


def _check_structure(results, tmp_path, quiet: bool) -> None:
    """Both timelines follow the schedule's order; files written; each rank's work within 25% (40%)."""
    assert [c.layout for c in results] == list(LAYOUTS)
    for c in results:
        schedule = build_schedule(c.prediction_plan, "1f1b", 4)
        for rank, actions in enumerate(schedule.actions):
            expected = [(a.kind, a.stage, a.microbatch) for a in actions]
            for events in (c.prediction.events, c.measured_events):
                mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start_s)
                assert [(e.kind, e.stage, e.microbatch) for e in mine] == expected, (c.layout, rank)
        assert len(c.measured_steps_s) == STEPS and (tmp_path / f"{c.layout}.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / f"{c.layout}.json").is_file()
        assert c.p2p.send_overhead_s > 0 and c.p2p.recv_overhead_s > 0
        for rank, cpu in enumerate(c.measured_cpu_s):
            busy = c.prediction.busy_s[rank]
            assert abs(busy / cpu - 1) <= (0.25 if quiet else 0.4), \
                f"{c.layout} rank {rank}: predicted busy {busy:.4f} s, main-thread CPU {cpu:.4f} s per step"


def test_simulator_predicts_the_measured_pipeline_iteration_within_15_percent(tmp_path):
    reports = []
    for attempt in (1, 2):
        before = _contention()
        results, _ = compare(steps=STEPS, rounds=4, microbatches=4, microbatch_size=4, repeats=3, clock="thread",
                             out_dir=tmp_path / str(attempt))
        after = _contention()
        quiet = max(before, after) <= CONTENDED
        _check_structure(results, tmp_path / str(attempt), quiet)
        reports.append("; ".join(
            f"{c.layout}: predicted {1e3 * c.predicted_s:.0f} ms, measured {1e3 * c.measured_s:.0f} ms "
            f"(ratio {c.ratio:.3f})" for c in results))
        if not quiet:
            pytest.skip(f"CPU shared with other processes (wall/CPU {before:.2f} before, {after:.2f} after): "
                        f"{reports[-1]}")
        if all(abs(c.ratio - 1) <= 0.15 for c in results):
            return
    pytest.fail("predicted / measured iteration outside 15% twice: " + " | ".join(reports))
