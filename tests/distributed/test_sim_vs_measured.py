"""The simulator beside the measured iteration of the demo model on CPU: 2-stage plans on 2 gloo processes
(encoder_parallel and encoders_colocated, encoders on rank 0 and the LLM on rank 1, 1F1B; one intra-op thread per
process). bench/sim_vs_measured.py runs the same comparison and prints the timing targets (iteration within 15%,
each rank's work within 25%); this test checks what does not depend on the machine's speed: both timelines, the
predicted and the measured, hold exactly the schedule's actions in its order on every rank, every measured step is
recorded, the files are written and the link and per-rank work were measured."""

from __future__ import annotations

from bench.sim_vs_measured import LAYOUTS, compare
from plait.planner.pipeline.schedules import build_schedule

STEPS = 4  # measured pipeline steps per layout (2 rounds of 2, a profile before each round)


def test_simulated_and_measured_pipeline_iterations_follow_the_schedule(tmp_path):
    results, _ = compare(steps=STEPS, rounds=2, microbatches=4, microbatch_size=4, repeats=3, clock="thread",
                         out_dir=tmp_path)
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
        assert len(c.measured_cpu_s) == len(c.prediction.busy_s) == 2
        assert all(t > 0 for t in c.measured_cpu_s) and all(t > 0 for t in c.prediction.busy_s)
