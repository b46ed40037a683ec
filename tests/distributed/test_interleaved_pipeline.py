"""Interleaved 1F1B (``schedules.interleaved_1f1b``) on 2 gloo processes equals one process (fp32): each rank
holds 2 LLM stages, rank 0 also the encoder stage(s); colocated and encoder-parallel layouts, frozen encoders +
trainable projectors + frozen LLM, everything trainable, trainable LLM only with a split backward, 3-5
microbatches (microbatch counts that are not multiples of the rank count, a wider microbatch group)."""

from __future__ import annotations

from tests.distributed.interleaved_worker import worker
from tests.distributed.spawning import free_port, spawn_and_wait


def test_interleaved_pipeline_on_two_ranks_matches_single_process():
    spawn_and_wait(worker, (2, free_port()), 2, 240, "interleaved pipeline test")
