"""Pipeline parallelism on 2 and 4 gloo processes equals one process on the same global batches (fp32).

Each spawned job runs many cases (tests/distributed/pipeline_worker.py): both layouts, GPipe, 1F1B (one
with split backward) and the zero-bubble ZB-H1 and ZB-H2 (PP 2 and PP 4), everything trainable / frozen encoders + trainable projectors + frozen LLM / frozen
encoders and projectors + trainable LLM, tied embeddings split across ranks, a text-only microbatch between
image microbatches, a step without any image, PP 2 x DP 2 with a replica that never sees an image, PP 4, and the
encoders in the LLM's bubbles (each encoder a stage on an LLM rank from the last, or both in one colocated stage)
on PP 2 and PP 4.
Per step: loss, every trainable parameter's gradient (and the clipped norm) equal the single-process
reference; frozen-prefix stages keep no activation and run no backward.
"""

from __future__ import annotations

from tests.distributed.pipeline_worker import worker
from tests.distributed.spawning import free_port, spawn_and_wait


def _run(world: int, limit_s: float) -> None:
    spawn_and_wait(worker, (world, free_port()), world, limit_s, f"pipeline test with {world} processes")


def test_pipeline_on_two_ranks_matches_single_process():
    _run(2, 240)


def test_pp2_x_dp2_and_pp4_match_single_process():
    _run(4, 240)
