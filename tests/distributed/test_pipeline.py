"""Pipeline parallelism on 2 and 4 gloo processes equals one process on the same global batches (fp32).

Each spawned job runs many cases (tests/distributed/pipeline_worker.py): both layouts, GPipe and 1F1B (one
with split backward), everything trainable / frozen encoders + trainable projectors + frozen LLM / frozen
encoders and projectors + trainable LLM, tied embeddings split across ranks, a text-only microbatch between
image microbatches, a step without any image, PP 2 x DP 2 with a replica that never sees an image, and PP 4.
Per step: loss, every trainable parameter's gradient (and the clipped norm) equal the single-process
reference; frozen-prefix stages keep no activation and run no backward.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp

from tests.distributed.pipeline_worker import worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, limit_s: float) -> None:
    context = mp.spawn(worker, args=(world, _free_port()), nprocs=world, join=False)
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"pipeline test with {world} processes timed out after {limit_s} s")


def test_pipeline_on_two_ranks_matches_single_process():
    _run(2, 240)


def test_pp2_x_dp2_and_pp4_match_single_process():
    _run(4, 240)
