"""A bad ``train.eval_metrics`` entry is refused before step 1 (it was found at the first validation, after the steps
since the last checkpoint were trained), and a metric that raises is named in one line."""

from __future__ import annotations

import pytest

from plait.train.evaluation import _metric_values
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records


def test_an_unimportable_metric_is_refused_before_step_one(tiny_job, tmp_path):
    recs = demo_records("train", ("text",), limit=4)
    cfg = tiny_job(recs, recs[:2], train={"steps": 3, "global_batch_size": 2, "eval_every": 2,
                                          "eval_metrics": ["nope.mod:bleu"]})
    trainer = Trainer.build(cfg)
    with pytest.raises(ValueError, match=r"train.eval_metrics\[0\] = 'nope.mod:bleu': cannot import 'nope.mod'"):
        trainer.fit()
    assert trainer.step == 0  # nothing trained, so nothing lost
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()


def test_a_metric_that_raises_is_named():
    def picky(preds, refs):
        raise KeyError("needs ids")

    with pytest.raises(ValueError, match=r"train.eval_metrics: picky\(predictions, references\) raised KeyError"):
        _metric_values("picky", picky, ["a"], ["b"])
    assert _metric_values("count", lambda p, r: len(p), ["a", "b"], ["a", "c"]) == {"count": 2.0}
