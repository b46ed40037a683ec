"""The ``plait generate`` command on a tiny trained ``final/``: one prompt, a JSONL file whose exact match equals the
trainer's validation on the same records, and errors that name the file."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers.cli import plait
from tests.helpers.jobs import write_jsonl
from tests.unit.models.generation_cases import task_records, train_final, trainer_predictions


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(trainer, final/, validation exact match per task, val.jsonl) of generation_cases.train_final."""
    return train_final(tmp_path_factory.mktemp("cli_gen"))


def test_jsonl_mode_scores_like_the_trainers_validation(trained, tmp_path):
    trainer, final, evals, val = trained
    out = tmp_path / "pred" / "predictions.jsonl"
    run = plait("generate", "--model", str(final), "--input", str(val), "--output", str(out),
                "--max-new-tokens", str(trainer.cfg.train.max_new_tokens), "--batch-size", "5", "--device", "cpu")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    records = [json.loads(line) for line in val.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in records]
    assert all(set(r) == {"id", "task", "prompt", "prediction", "reference"} for r in rows)
    assert [r["prompt"] for r in rows] == [r["messages"][0]["content"] for r in records]
    assert [r["reference"] for r in rows] == [r["messages"][-1]["content"] for r in records]
    assert [r["prediction"] for r in rows] == trainer_predictions(trainer)
    printed = {t: (int(c), int(n)) for t, c, n in
               re.findall(r"^plait: exact match (\w+): [\d.]+% \((\d+)/(\d+)\)$", run.stdout, re.M)}
    assert {t: c / n for t, (c, n) in printed.items()} == evals  # the same accuracy, task by task
    assert 0 < sum(evals.values()) < len(evals)
    right = sum(c for c, _ in printed.values())
    assert f"plait: exact match: {right / len(rows):.1%} ({right}/{len(rows)})" in run.stdout
    assert f"plait: {len(rows)} predictions written to {out}" in run.stdout
    assert f"generate: prompt {len(rows)}/{len(rows)}" in run.stderr  # progress, as plain lines in a log

    # one prompt, as a user types it: image and audio files, no placeholders in the text
    head = "<image>\n<audio>\n"  # where plait puts the placeholders of a prompt that has none
    both = next(r for r in records if r["messages"][0]["content"].startswith(head))
    text = both["messages"][0]["content"].removeprefix(head)
    one = plait("generate", "--model", str(final), "--image", both["images"][0], "--audio", both["audios"][0],
                "--prompt", text, "--max-new-tokens", "6")
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.stdout == next(r["prediction"] for r in rows if r["id"] == both["id"]) + "\n"


def test_prompts_without_answers_and_errors_that_name_the_file(trained, tmp_path):
    _, final, _, _ = trained
    recs = [dict(r, messages=r["messages"][:1]) for r in task_records("val", 1)]
    recs[1] = dict(recs[1], audios=[str(tmp_path / "missing.flac")])
    data = write_jsonl(tmp_path / "prompts.jsonl", recs)
    bad = plait("generate", "--model", str(final), "--input", str(data), "--output", str(tmp_path / "p.jsonl"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert (f"plait: error: record '{recs[1]['id']}' ({data}:2): audio file {tmp_path / 'missing.flac'} does not "
            "exist") in bad.stderr
    del recs[1]
    write_jsonl(data, recs)
    out = tmp_path / "p.jsonl"
    ok = plait("generate", "--model", str(final), "--input", str(data), "--output", str(out), "--max-new-tokens", "3")
    assert ok.returncode == 0, ok.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["id", "prediction", "prompt", "task"]] * 3
    assert "exact match" not in ok.stdout
    not_final = plait("generate", "--model", str(final.parent), "--prompt", "Which digit?")
    assert not_final.returncode == 2 and "Traceback" not in not_final.stderr
    assert (f"plait: error: {final.parent / 'plait_config.json'} does not exist: {final.parent} is not a trained "
            f"plait model; did you mean {final}?") in not_final.stderr
    no_output = plait("generate", "--model", str(final), "--input", str(data))
    assert no_output.returncode == 2 and "--input needs --output" in no_output.stderr
