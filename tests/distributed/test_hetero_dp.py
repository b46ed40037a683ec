"""Heterogeneous data parallelism (pipelines with different stage counts as replicas, per-unit gradient groups)
equals one process: losses, gradients, clipped norm and final AdamW parameters (tests/distributed/hetero_dp_worker.py)."""

from __future__ import annotations

from tests.distributed.hetero_dp_worker import worker
from tests.distributed.spawning import free_port, spawn_and_wait


def test_two_pipelines_with_different_stage_counts_match_one_process():
    spawn_and_wait(worker, (3, free_port()), 3, 300, "heterogeneous DP test with 3 processes")
