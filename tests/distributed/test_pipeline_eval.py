"""Evaluation through the job's own layout (issue 12, item 3): PP=2, PP=2 x DP=2, DP=2, CP=2 and PP=2 x CP=2 jobs
(gloo; ranks started with torchrun's variables) report the validation loss of one process (1e-5), per task and
overall, and the same greedy answers (hence the same exact match and pluggable metrics), with no rank holding a
materialised parameter outside its stages while and after it evaluates (checked in ``eval_worker.py``: every live
non-meta ``nn.Parameter`` of the process is one of its trainer's, at the forward-only pipeline passes and after
``fit``)."""

from __future__ import annotations


import pytest

from tests.helpers.pipeline_eval import job, reference, run


CASES = {  # name: (processes, parallel section)
    "pp2": (2, {"pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}}),
    "pp2-dp2": (4, {"dp": 2, "pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}}),
    "dp2": (2, {"dp": 2}),
    "cp2": (2, {"cp": 2}),
    "pp2-cp2": (4, {"cp": 2, "pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}}),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return reference(tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("case", list(CASES))
def test_layout_evaluates_like_one_process_without_foreign_parameters(tmp_path, single, case):
    nproc, parallel = CASES[case]
    got = run(job(tmp_path, case, parallel), tmp_path, case, nproc)
    ref, rep = single["report"], got["report"]
    assert got["world"] == nproc and rep.samples == ref.samples == 7
    assert rep.loss_overall == pytest.approx(ref.loss_overall, rel=1e-5)
    assert set(rep.loss) == set(ref.loss) == {"audio_transcribe", "image_digit"}
    for task, loss in ref.loss.items():
        assert rep.loss[task] == pytest.approx(loss, rel=1e-5)
    assert [(p["id"], p["prediction"]) for p in got["predictions"]] == [
        (p["id"], p["prediction"]) for p in single["predictions"]]
    assert rep.exact_match == ref.exact_match == got["eval"]
    assert rep.exact_match_overall == ref.exact_match_overall
    assert rep.metrics == pytest.approx(ref.metrics)
    assert {"first_char_match", "pred_chars", "ref_chars", "first_char_match/image_digit"} <= set(rep.metrics)
    if case.startswith("pp"):
        assert got["forward_calls"] > 0  # evaluated through the pipeline (checked at its passes)
        assert got["params"] < single["params"]  # rank 0 holds its stage only


def test_single_process_report_is_consistent_with_its_predictions_file(single):
    ref, preds = single["report"], single["predictions"]
    assert [set(p) for p in preds] == [{"id", "task", "prompt", "prediction", "reference"}] * 7
    for task, em in ref.exact_match.items():
        mine = [p for p in preds if p["task"] == task]
        assert em == sum(p["prediction"].strip() == p["reference"].strip() for p in mine) / len(mine)
    assert ref.metrics["ref_chars"] == pytest.approx(sum(len(p["reference"]) for p in preds) / 7)
    assert ref.loss_overall > 0 and all(v > 0 for v in ref.loss.values())
