"""bench/goodput.py's goodput model on tiny inputs worked out by hand: the ETTR without failures is the checkpoint
stall's complement, and one failure costs plait and checkpoint-restart the sum of their stated parts."""

import math

import pytest

from bench.goodput import LLAMA3_RATE, BUCKETS, Cluster, Recovery, Run, Workload, failure_events, sim_plait, \
    sim_restart
from bench.resilience import Costs

NODE_MTBF_S = 40.5
"""One node of 8 GPUs failing every 40.5 s: with a 1 s write, Young's interval sqrt(2 * 1 * 40.5) = 9 s."""
ONE_NODE = Cluster(gpus=8, per_gpu_rate_h=3600 / (8 * NODE_MTBF_S))
COSTS = Costs("test", 0.0, 0.0, copy_Bps=1e9, restart_s=5.0, ckpt_Bps=1e9)


def _work(**kw) -> Workload:
    base = dict(iteration_s=1.0, state_bytes=8e9, fail_copy_bytes=0.0, rejoin_copy_bytes=0.0, node_share=0.0,
                replica_gpus=8, plan_gpus=8)
    return Workload(**{**base, **kw})


def _accounted(run: Run) -> float:
    return run.productive + sum(run.lost[b] for b in BUCKETS)


def test_llama3_rate_per_gpu_hour():
    assert LLAMA3_RATE == pytest.approx(419 / 21_233_664)  # 54 days * 24 h * 16384 GPUs
    assert Cluster(16384, LLAMA3_RATE).failures_per_day == pytest.approx(419 / 54)


def test_no_failure_ettr_is_the_checkpoint_stall_complement():
    # state 8 GB over 8 GPUs at 1 GB/s: a 1 s write after every 9 one-second steps; 100 s = 10 cycles
    run = sim_restart(ONE_NODE, _work(), COSTS, [], 100.0)
    assert run.ettr == pytest.approx(1 - 1 / 10)
    assert run.lost["checkpoint writes"] == pytest.approx(10.0)
    assert _accounted(run) == pytest.approx(run.t) == pytest.approx(100.0)


def test_one_failure_costs_restart_the_work_since_the_checkpoint_and_the_restart():
    # t 25.5: 9 steps, write, 9 steps, write, 5 steps, half a step -> 5.5 s rework; restart 5 s + 8 GB / 8 / 1 GB/s
    run = sim_restart(ONE_NODE, _work(), COSTS, [(25.5, 0)], 31.5)
    assert run.lost["rework"] == pytest.approx(5.5)
    assert run.lost["restarts"] == pytest.approx(6.0)
    assert run.lost["checkpoint writes"] == pytest.approx(2.0)
    assert run.productive == pytest.approx(18.0)
    assert run.ettr == pytest.approx(18.0 / 31.5)


def test_one_failure_costs_plait_its_recovery_copies_replay_and_degraded_steps():
    two_nodes = Cluster(gpus=16, per_gpu_rate_h=1e-9)  # checkpoints too rare to matter
    work = _work(state_bytes=0.0, fail_copy_bytes=4e9, rejoin_copy_bytes=2e9, node_share=0.5, plan_gpus=16)
    rec = Recovery(detect_s=1.0, agree_s=2.0, reform_s=3.0, source="by hand")
    run = sim_plait(two_nodes, work, rec, COSTS, [(10.5, 1)], 200.0, spare_s=100.0)
    # 10 steps, half a step replayed, 1 + 2 + 3 + 4 s stalled (t 20.5); 100 steps at half throughput until the
    # rejoin (t 120.5), 3 s re-forming + 2 s copies; 74.5 s of steps to t 200
    expected = {"replay": 0.5, "detection": 1.0, "agreement": 2.0, "re-forming": 6.0, "copies": 6.0,
                "degraded": 50.0, "restarts": 0.0, "rework": 0.0}
    assert {b: run.lost[b] for b in expected} == pytest.approx(expected)
    assert run.productive == pytest.approx(10 + 50 + 74.5)
    assert run.ettr == pytest.approx(134.5 / 200)
    assert _accounted(run) == pytest.approx(200.0)


def test_failure_events_are_poisson_at_the_cluster_rate():
    cluster = Cluster(gpus=1024, per_gpu_rate_h=LLAMA3_RATE)
    events = failure_events(cluster, 4000, seed=1)
    assert len(events) == 4000 and all(0 <= node < 128 for _, node in events)
    assert events[-1][0] / 4000 == pytest.approx(cluster.mtbf_s, rel=0.05)
    assert math.isclose(cluster.mtbf_s, 3600 / (1024 * LLAMA3_RATE))
