"""The ``plait train`` command on a tiny job: metrics, plot, checkpoints, final model, resume, errors."""

from __future__ import annotations

import json

import pytest

from tests.helpers.jobs import ROOT
from tests.helpers.cli import plait, plait_on_ranks, write_job


def test_train_then_resume_from_the_command_line(tmp_path):
    job = write_job(tmp_path)
    small = ["--train.steps=4", "--train.global_batch_size=4", "--train.eval_every=0", "--checkpoint.every=2",
             "--metrics.progress=false", "--train.max_new_tokens=4"]
    first = plait("train", "--config", job, *small)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    assert "validation exact match" in first.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert any("eval" in r and "image_digit" in r["eval"] for r in records)
    assert (run / "loss.png").stat().st_size > 10_000
    assert (run / "final" / "plait_config.json").is_file()
    assert (run / "final" / "tokenizer" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (run / "final" / "processors").iterdir()) == ["audio", "vision"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]

    again = plait("train", "--config", job, *small[1:], "--train.steps=6", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]

    (run / "metrics.jsonl").unlink()  # a finished run whose metrics were lost: nothing to train, final/ saved again
    done = plait("train", "--config", job, *small[1:], "--train.steps=6", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nothing trained (model at step 6); loss curve not drawn (metrics.jsonl holds no training loss)" in done.stdout

    resized = plait("train", "--config", job, *small[1:], "--train.steps=8", "--resume",
                    "--model.llm.config.hidden_size=64")  # same names, other shapes: one line, no traceback
    assert resized.returncode == 2 and "Traceback" not in resized.stderr, resized.stderr[-3000:]
    assert "cannot resume from" in resized.stderr and "Size mismatch" in resized.stderr


def test_errors_are_reported_without_a_traceback(tmp_path):
    job = write_job(tmp_path)
    bad_key = plait("train", "--config", job, "--train.lrr=1")
    assert bad_key.returncode == 2
    assert "plait: error: unknown config key(s) ['train.lrr']" in bad_key.stderr
    assert "Traceback" not in bad_key.stderr
    no_ckpt = plait("train", "--config", job, "--resume", "--metrics.run_dir=" + str(tmp_path / "empty"))
    assert no_ckpt.returncode == 2 and "no checkpoint to resume from" in no_ckpt.stderr


def test_torchrun_errors_print_once_or_name_the_rank(monkeypatch, capsys):
    from plait.cli import _report_error

    monkeypatch.setenv("WORLD_SIZE", "4")
    config_error = ValueError("train.lr must be > 0")
    config_error.same_on_every_rank = True
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        _report_error(config_error)
    assert capsys.readouterr().err == "plait: error: train.lr must be > 0\n"  # rank 0's line only
    _report_error(ValueError("stage 1 has no input"))  # still RANK=2: a rank's own error is never hidden
    assert capsys.readouterr().err == "plait: error (rank 2 of 4): stage 1 has no input\n"


def test_a_file_error_every_rank_hits_after_joining_prints_one_line_and_no_traceback(tmp_path):
    """Two ranks as torchrun starts them (:func:`plait_on_ranks`): the job file checks out, both ranks join the gloo
    group, then the tokenizer folder is missing on both: one ``plait: error:`` line (the first rank's to reach it),
    exit code 2, no traceback (a rank that exited at once left the other's gloo connect failing with one). About 6 s
    with the fork server up."""
    job = write_job(tmp_path)
    small = ["--metrics.progress=false", "--data.num_workers=0"]
    missing = plait_on_ranks(2, "train", "--config", job, *small, f"--data.tokenizer={tmp_path / 'no_tokenizer'}",
                             limit_s=120)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr[-3000:]
    errors = [line for line in missing.stderr.splitlines() if line.startswith("plait: error")]
    assert errors == [f"plait: error: data.tokenizer: tokenizer directory {tmp_path / 'no_tokenizer'} does not exist"]


def test_plan_and_simulate_commands(tmp_path):
    plan_json = tmp_path / "plan.json"
    planned = plait("plan", "--config", str(ROOT / "configs" / "demo.toml"), "--devices", "4", "--out", str(plan_json))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert ("layout" in planned.stdout or "no pipeline" in planned.stdout) and "bubble" in planned.stdout
    assert "-m plait.cli train --config " in planned.stdout or "plait train --config " in planned.stdout
    plan = json.loads(plan_json.read_text())
    assert plan["dp"] * len({s["rank"] for s in plan["plan"]["stages"]}) <= 4
    sim = plait("simulate", "--plan", str(plan_json), "--out-dir", str(tmp_path / "sim"))
    assert sim.returncode == 0, sim.stderr[-3000:]
    trace = json.loads((tmp_path / "sim" / "timeline.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert (tmp_path / "sim" / "timeline.png").stat().st_size > 5_000
    bad = plait("plan", "--config", str(ROOT / "configs" / "demo.toml"), "--devices", "4", "--model.llm.freeze=maybe")
    assert bad.returncode == 2 and "model.llm.freeze: expected bool" in bad.stderr
    # the trace just written is not a plan: named, no dataclass internals
    not_plan = plait("simulate", "--plan", str(tmp_path / "sim" / "timeline.json"), "--out-dir", str(tmp_path / "x"))
    assert not_plan.returncode == 2 and "Traceback" not in not_plan.stderr
    assert f"--plan {tmp_path / 'sim' / 'timeline.json'} is not a plan JSON written by `plait plan --out`" \
        in not_plan.stderr and "a Chrome trace" in not_plan.stderr
    # demo.toml: 2 microbatches per step, so --dp is at most 2; the flag is named
    dp = plait("plan", "--config", str(ROOT / "configs" / "demo.toml"), "--devices", "4", "--dp", "3")
    assert dp.returncode == 2 and dp.stderr.startswith("plait: error: --dp 3: ") and "dp_degrees" not in dp.stderr
    frac = plait("plan", "--config", str(ROOT / "configs" / "demo.toml"), "--devices", "4", "--memory-fraction", "0")
    assert frac.returncode == 2 and "--memory-fraction must be in (0, 1], got 0.0" in frac.stderr


def test_a_new_run_never_removes_an_earlier_one_and_a_longer_run_keeps_its_lr_smooth(tmp_path):
    import math

    job = write_job(tmp_path)
    small = ["--train.steps=4", "--train.global_batch_size=4", "--data.val=", "--checkpoint.every=2",
             "--metrics.progress=false", "--train.warmup_steps=1", "--train.min_lr_ratio=0.1"]
    run = tmp_path / "run"
    assert plait("train", "--config", job, *small).returncode == 0
    refused = plait("train", "--config", job, *small)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (f"plait: error: {run} holds an earlier run (2 checkpoint(s), newest step_000004; a final model (final/))"
            in refused.stderr)
    assert f"plait train --config {job} {' '.join(small)} --resume" in refused.stderr  # the user's overrides kept
    assert f"plait train --config {job} {' '.join(small)} --overwrite" in refused.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]

    longer = plait("train", "--config", job, *small, "--train.steps=8",
                   "--resume", str(run / "checkpoints" / "step_000002"))
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "the run's length changed from 4 to 8 steps" in longer.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert sorted(lr) == list(range(1, 9)) and all("time" in r and "elapsed_s" in r for r in rows)
    # f(s) of README "Longer runs": phase 1/3 at step index 2 (row 3), re-stretched over the 6 new steps
    for step in range(3, 9):
        phase = 1 / 3 + (2 / 3) * (step - 3) / 6
        assert lr[step] / lr[1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * phase)), rel=1e-6)
    changes = [abs(lr[s + 1] - lr[s]) for s in range(1, 8)]
    assert max(changes[2:]) <= max(changes[:2])  # from the resumed step on: no jump

    over = plait("train", "--config", job, *small, "--overwrite")
    assert over.returncode == 0, over.stderr[-3000:]
    assert "removed its 2 checkpoint(s) (newest step_000008) and its final model" in over.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    both = plait("train", "--config", job, *small, "--overwrite", "--resume")
    assert both.returncode == 2 and "give one" in both.stderr
