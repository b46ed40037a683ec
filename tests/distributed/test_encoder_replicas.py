"""An encoder branch with its own data-parallel degree inside a pipeline (replicated encoder stages) equals one
process on the same global batches (fp32, loss and every gradient within rtol 1e-5, the clipped norm too), on 4 gloo
processes (tests/distributed/pipeline_worker.py, ``CASES_REPLICAS``): vision on 2 replica ranks of its own feeding a
2-stage LLM (trainable everything; a 2-stage vision branch under zero-bubble; frozen towers with trainable
projectors), and vision's 2 replicas on the LLM ranks of PP 2 (in the bubbles) with DP 2, where each replicated
stage's gradients are summed over its replicas x DP copies; and vision's stage as a tensor-parallel group of 2
(``encoder_tp``) on ranks 0 and 1 feeding the same 2-stage LLM (trainable everything with clipping; frozen tower with
a split trainable projector), each compared over 3 optimizer steps with SGD (TP sums products in another order, which
AdamW's first steps would amplify from rounding to whole steps)."""

from __future__ import annotations

from tests.distributed.pipeline_worker import replica_worker
from tests.distributed.spawning import free_port, spawn_and_wait


def test_replicated_encoder_stages_match_single_process():
    spawn_and_wait(replica_worker, (4, free_port()), 4, 240, "replicated encoder stages on 4 processes")
