"""Layouts the FSDP2 / TP / evaluation tests did not cover yet, each equal to one process (gloo, torchrun): HSDP 2x2
with frozen encoders and trainable projectors, TP=2 with deferral on (hierarchical plans defer encoder outputs to a
later LLM microbatch), and validation under PP=2 x TP=2 (loss per task and overall; that every answer is recorded
once is an expected failure until the pipeline trainer counts one TP rank per replica)."""

from __future__ import annotations

import pytest

from tests.helpers.jobs import demo_records
from tests.helpers.fsdp import assert_equal_runs, job, run
from tests.helpers.pipeline_eval import job as eval_job
from tests.helpers.pipeline_eval import reference as eval_reference
from tests.helpers.pipeline_eval import run as eval_run
from tests.helpers.tensor_parallel_training import assert_same as assert_same_tp


def test_hsdp_2x2_frozen_encoders_trainable_projectors(tmp_path):
    images = demo_records("train", ("image_digit",), limit=3)
    others = demo_records("train", ("audio_transcribe",), limit=3) + demo_records("train", ("text",), limit=2)
    records = images + others
    policy = {"microbatch_policy": "arrival"}
    single = run(job(tmp_path, True, records, policy), tmp_path, "single", 1)
    hsdp = run(job(tmp_path, True, records, policy, dp=2, dp_shard=2), tmp_path, "hsdp", 4)
    assert hsdp["sharded"] and hsdp["dp"] == 4 and hsdp["world"] == 4
    assert min(hsdp["images_per_rank"]) == 0 < max(hsdp["images_per_rank"])  # a rank with no image in its share
    assert not any(".encoder." in n for n in single["grads"])  # frozen encoders: no gradient, not sharded
    assert any("projector" in g for g in hsdp["groups"]) and not any(".encoder." in g for g in hsdp["groups"])
    assert_equal_runs(single, hsdp)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-encoders", "all-trainable"])
def test_tp2_with_deferral_equals_one_process(tmp_path, frozen):
    single = run(job(tmp_path, frozen), tmp_path, "single", 1)
    tp = run(job(tmp_path, frozen, tp=2), tmp_path, "tp", 2)
    assert tp["world"] == 2 and tp["dp"] == 1 and not tp["sharded"]
    assert len(tp["deferred"]) >= 1 and tp["deferred"] == single["deferred"]  # the same plan, deferring
    assert_same_tp(single, tp, frozen)  # losses, gradients; parameters at the TP tests' atol (AdamW amplifies noise)


@pytest.fixture(scope="module")
def pp2_tp2_eval(tmp_path_factory) -> tuple[dict, dict]:
    """One process's and PP=2 x TP=2's (4 processes) evaluation after training (``eval_worker.py``)."""
    tmp = tmp_path_factory.mktemp("pp2_tp2_eval")
    single = eval_reference(tmp)  # one run for this module and test_pipeline_eval.py
    parallel = {"tp": 2, "pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}}
    return single, eval_run(eval_job(tmp, "pp2-tp2", parallel), tmp, "pp2-tp2", 4)


def test_validation_loss_under_pp2_x_tp2_equals_one_process(pp2_tp2_eval):
    single, got = pp2_tp2_eval
    ref, rep = single["report"], got["report"]
    assert got["world"] == 4 and got["forward_calls"] > 0  # evaluated through the pipeline
    assert rep.loss_overall == pytest.approx(ref.loss_overall, rel=1e-5)
    assert set(rep.loss) == set(ref.loss) == {"audio_transcribe", "image_digit"}
    for task, loss in ref.loss.items():
        assert rep.loss[task] == pytest.approx(loss, rel=1e-5)
    assert rep.exact_match == ref.exact_match and rep.metrics == pytest.approx(ref.metrics)


def test_validation_under_pp2_x_tp2_records_each_answer_once(pp2_tp2_eval):
    single, got = pp2_tp2_eval
    assert got["report"].samples == single["report"].samples == 7
    assert [(p["id"], p["prediction"]) for p in got["predictions"]] == [
        (p["id"], p["prediction"]) for p in single["predictions"]]
