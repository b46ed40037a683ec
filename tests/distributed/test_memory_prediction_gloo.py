"""The planner's per-rank memory (``planner.sharding.rank_memory``) within 15% of ``bench/memory.py``'s bytes measured
from real storages under torchrun (gloo): tensor parallelism and FSDP2 over 2 ranks (issue 14, acceptance); under
FSDP2 also the unsharded gradients kept between 2 microbatches per rank (``parallel.fsdp_reduce``) and the gathered
parameters kept from forward to backward (``parallel.fsdp_reshard = "after_backward"``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.memory import KEPT, KINDS, job_config, predicted, predicted_kept_parameters, predicted_unsharded_gradients, \
    run_column
from bench.plan_holds import small_train_set
from plait.train.trainer import Trainer
from tests.helpers.jobs import ROOT


@pytest.mark.parametrize("label", ["TP 2", "FSDP2 2"])
def test_planner_within_15_percent_of_measured_per_rank(label):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train = small_train_set(ROOT / "data" / "demo" / "train.jsonl", 8, folder)
        got = run_column("demo", label, "none", 4, folder, train)
        assert isinstance(got, dict), got
        one = Trainer.build(job_config("demo", 1, 1, "none", 4, str(train), str(folder / "one")))
        pred = predicted(one, label, got["rank_llm_tokens"])
        unsharded = predicted_unsharded_gradients(one, label, got["rank_llm_tokens"][0])
        kept = predicted_kept_parameters(one, label, got["rank_llm_tokens"][0])
    if label == "FSDP2 2":  # 2 microbatches per rank: fsdp_reduce "step" keeps every unsharded gradient, "microbatch"
        assert got["accumulated_gradients"] == pytest.approx(unsharded, rel=0.15)  # none between microbatches
        assert got["accumulated_gradients"] > 1.5 * got["gradients"] and got["reduced_gradients"] == 0
        # parallel.fsdp_reshard = "after_backward": every trainable unit's gathered parameters at the forward's end
        assert got[KEPT] == pytest.approx(kept, rel=0.15) and got[KEPT] > 1.5 * got["gradients"]  # whole vs shards
    else:
        assert got[KEPT] == kept == 0
    for kind in KINDS:
        assert pred[kind] == pytest.approx(got[kind], rel=0.15), kind
    assert sum(pred.values()) == pytest.approx(sum(got[k] for k in KINDS), rel=0.15)
