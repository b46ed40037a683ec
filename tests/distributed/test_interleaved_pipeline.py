"""Interleaved 1F1B (``schedules.interleaved_1f1b``) on 2 gloo processes equals one process (fp32): each rank
holds 2 LLM stages, rank 0 also the encoder stage(s); colocated and encoder-parallel layouts, frozen encoders +
trainable projectors + frozen LLM, everything trainable, trainable LLM only with a split backward, 3-5
microbatches (microbatch counts that are not multiples of the rank count, a wider microbatch group)."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp

from tests.distributed.interleaved_worker import worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_interleaved_pipeline_on_two_ranks_matches_single_process():
    context = mp.spawn(worker, args=(2, _free_port()), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail("interleaved pipeline test timed out after 240 s")
