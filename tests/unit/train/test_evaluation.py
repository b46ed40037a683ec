"""plait.train.evaluation: the DP share of the validation set, the validation loss table, the marked-position
argmax and greedy decoding by repeated forward passes (equal to the KV-cache decoding of
plait.models.generation), scoring with pluggable metrics, the predictions file; and the single-process
Trainer's report against per-sample losses computed by hand."""

from __future__ import annotations

import json

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.data.collate import collate
from plait.data.processing import IGNORE
from plait.models.generation import greedy_token_ids, stop_token_ids
from plait.train.evaluation import (
    LossTable,
    Prediction,
    extend_batch,
    greedy_by_forward,
    load_metrics,
    next_token_ids,
    plan_eval_microbatches,
    score,
    teacher_forced_sample,
    with_last_marked,
    write_predictions,
)
from plait.train.loss import token_loss_sum
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl

METRICS = "tests.unit.train.eval_metric_fns"


def test_plan_eval_microbatches_shares_each_task_over_replicas_in_one_task_microbatches():
    tasks = ["b", "a", "b", "a", "a", "b", "c"]  # a: 1 3 4, b: 0 2 5, c: 6 -> order 1 3 4 0 2 5 6
    assert plan_eval_microbatches(tasks, 1, 0, 2) == [[1, 3], [4], [0, 2], [5], [6]]
    assert plan_eval_microbatches(tasks, 2, 0, 2) == [[1, 4], [2], [6]]  # order[0::2] = 1 4 2 6
    assert plan_eval_microbatches(tasks, 2, 1, 2) == [[3], [0, 5]]  # order[1::2] = 3 0 5
    assert plan_eval_microbatches(tasks, 8, 7, 2) == []
    with pytest.raises(ValueError, match="dp_rank"):
        plan_eval_microbatches(tasks, 2, 2, 2)


def test_eval_batch_size_defaults_to_the_microbatch_size_at_least_16():
    from plait.config.schema import TrainConfig
    from plait.train.evaluation import eval_batch_size

    assert eval_batch_size(TrainConfig(microbatch_size=4)) == 16
    assert eval_batch_size(TrainConfig(microbatch_size=32)) == 32
    assert eval_batch_size(TrainConfig(eval_batch_size=3)) == 3
    with pytest.raises(ValueError, match=r"train\.eval_batch_size must be >= 0"):
        eval_batch_size(TrainConfig(eval_batch_size=-1))


def test_loss_table_normalises_by_target_tokens_per_task_and_overall():
    table = LossTable(["x", "y", "x"])
    table.add("x", 6.0, 3)
    table.add("x", torch.tensor(2.0), 1)
    table.add("y", 3.0, 0)  # a loss part without targets (e.g. a CP rank that does not count)
    table.add("y", 0.0, 2)
    assert table.tasks == ["x", "y"]
    assert table.losses() == ({"x": 2.0, "y": 1.5}, 11.0 / 6)
    assert LossTable(["z"]).losses() == ({"z": 0.0}, 0.0)


def test_next_token_ids_reads_the_marked_position_and_minus_one_elsewhere():
    logits = torch.zeros(3, 2, 5)
    logits[0, 1, 4] = 1.0
    logits[1, 1, 2] = 1.0
    logits[1, 0, 3] = 9.0  # not marked: ignored
    labels = torch.full((3, 2), IGNORE)
    labels[:2, 1] = 0  # row 2's mark is on another CP rank
    assert next_token_ids(logits, labels).tolist() == [4, 2, -1]


def _left_batch():
    from plait.data.collate import Batch

    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    return Batch(ids, torch.full_like(ids, IGNORE), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                 torch.tensor([[0, 0, 1], [0, 1, 2]]), torch.tensor([[-1, 0, 0], [0, 0, 0]]),
                 torch.full_like(ids, -1), {}, ())


def test_extend_batch_appends_a_text_token_at_the_next_position_and_marks_it():
    grown = extend_batch(with_last_marked(_left_batch()), torch.tensor([3, 4]))
    assert grown.input_ids.tolist() == [[0, 5, 6, 3], [7, 8, 9, 4]]
    assert grown.attention_mask[:, -1].tolist() == [1, 1] and grown.position_ids[:, -1].tolist() == [2, 3]
    assert grown.document_ids[:, -1].tolist() == [0, 0] and grown.item_ids[:, -1].tolist() == [-1, -1]
    assert grown.labels.tolist() == [[IGNORE] * 3 + [0]] * 2


def test_greedy_by_forward_stops_rows_at_their_first_stop_token_then_pads():
    # a "model" whose next token is the last token + 1: row 0 (last 6) says 7 8 9, row 1 (last 9) says 10 (stop)
    def forward(batches):
        return [b.input_ids[:, -1] + 1 for b in batches]

    out = greedy_by_forward(forward, [_left_batch()], stop_ids=[10], max_new_tokens=6, pad_id=0)
    assert out[0].tolist() == [[7, 8, 9, 10], [10, 0, 0, 0]]  # ends when every row has stopped
    out = greedy_by_forward(forward, [_left_batch()], stop_ids=[99], max_new_tokens=2, pad_id=0)
    assert out[0].tolist() == [[7, 8], [10, 11]]
    with pytest.raises(ValueError, match="stop token"):
        greedy_by_forward(forward, [_left_batch()], [], 2, 0)


def test_load_metrics_resolves_function_paths_and_names_bad_entries():
    fns = load_metrics([f"{METRICS}:first_char_match", f"{METRICS}:answer_lengths"])
    assert list(fns) == ["first_char_match", "answer_lengths"]
    for bad, why in [("nocolon", "package.module:function"), ("no_such_module_xyz:f", "cannot import"),
                     (f"{METRICS}:missing", "has no function 'missing'")]:
        with pytest.raises(ValueError, match=r"train\.eval_metrics\[1\].*" + why):
            load_metrics([f"{METRICS}:first_char_match", bad])


def test_score_and_predictions_file(tmp_path):
    preds = [Prediction(2, "r2", "b", "p2", " seven ", "seven"), Prediction(0, "r0", "a", "p0", "one", "two"),
             Prediction(1, "r1", "a", "p1", "three", "three")]
    table = LossTable(["a", "b", "c"])
    table.add("a", 4.0, 2)
    fns = load_metrics([f"{METRICS}:first_char_match", f"{METRICS}:answer_lengths"])
    report = score(5, preds, table, fns, "x.jsonl")
    assert report.exact_match == {"a": 0.5, "b": 1.0, "c": 0.0} and report.exact_match_overall == 2 / 3
    assert report.loss == {"a": 2.0, "b": 0.0, "c": 0.0} and report.loss_overall == 2.0
    assert report.metrics == pytest.approx({"first_char_match": 1 / 3, "first_char_match/a": 0.5,
                                            "first_char_match/b": 0.0, "pred_chars": 15 / 3, "ref_chars": 13 / 3,
                                            "pred_chars/a": 4.0, "ref_chars/a": 4.0, "pred_chars/b": 7.0,
                                            "ref_chars/b": 5.0})
    assert report.record()["val_loss"] == 2.0 and report.record()["predictions"] == "x.jsonl"
    path = write_predictions(tmp_path, 5, preds)
    assert path == tmp_path / "predictions" / "step_5.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2"]
    assert rows[2] == {"id": "r2", "task": "b", "prompt": "p2", "prediction": " seven ", "reference": "seven"}


def test_predictions_file_marks_empty_answers_as_generate_does(tmp_path):
    preds = [Prediction(0, "r0", "a", "p0", "  ", "two"), Prediction(1, "r1", "a", "p1", "three", "three")]
    rows = [json.loads(line) for line in write_predictions(tmp_path, 1, preds).read_text().splitlines()]
    assert rows == [{"id": "r0", "task": "a", "prompt": "p0", "prediction": "  ", "reference": "two", "empty": True},
                    {"id": "r1", "task": "a", "prompt": "p1", "prediction": "three", "reference": "three"}]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    train = write_jsonl(tmp / "train.jsonl", demo_records("train", limit=4))
    val = write_jsonl(tmp / "val.jsonl", demo_records("val", limit=5))
    cfg = tiny_config_dict(str(train), str(val), str(tmp / "run"), data={"num_workers": 0},
                           train={"max_new_tokens": 5, "eval_batch_size": 2})
    return Trainer.build(config_from_dict(cfg))


def test_trainer_validation_loss_is_the_token_mean_over_the_whole_set(trainer):
    report_eval = trainer.evaluate()
    report = trainer.last_eval
    assert trainer.model.training  # back in training mode
    sums, targets = {}, {}
    with torch.no_grad():
        trainer.model.eval()
        for i in range(len(trainer.val_set)):
            s = teacher_forced_sample(trainer.val_set, i)
            b = collate([s], trainer.processor.pad_id)
            logits = trainer.model(b.input_ids, b.modality_inputs, b.attention_mask, b.position_ids)
            task = s.meta.task
            sums[task] = sums.get(task, 0.0) + float(token_loss_sum(logits, b.labels))
            targets[task] = targets.get(task, 0) + b.target_tokens
    assert report.loss == pytest.approx({t: sums[t] / targets[t] for t in sums}, rel=1e-5)
    assert report.loss_overall == pytest.approx(sum(sums.values()) / sum(targets.values()), rel=1e-5)
    assert report_eval == report.exact_match and report.samples == 5
    assert (trainer.run_dir / "predictions" / "step_0.jsonl").exists()
    trainer.model.train()


def test_greedy_by_forward_equals_kv_cache_decoding(trainer):
    samples = [trainer.val_set[i] for i in range(len(trainer.val_set))]
    batch = collate(samples, trainer.processor.pad_id, padding_side="left")
    stop = stop_token_ids(trainer.tokenizer, trainer.model.language_model.generation_config)
    model = trainer.model.eval()

    def forward(batches):
        with torch.no_grad():
            return [next_token_ids(model(b.input_ids, b.modality_inputs, b.attention_mask, b.position_ids), b.labels)
                    for b in batches]

    cached = greedy_token_ids(model, batch, stop, 5, trainer.processor.pad_id)
    (recomputed,) = greedy_by_forward(forward, [batch], stop, 5, trainer.processor.pad_id)
    assert recomputed.tolist() == cached.tolist()
    model.train()
