"""``plait profile`` (table, profile file, reuse only on a matching key) and ``plait train`` with
``parallel.plan = "auto"`` on a tiny job, through the command's entry point in this process."""

from __future__ import annotations

import json

from plait.cli import main
from plait.config.loader import config_from_dict
from plait.models.registry import build_model, load_tokenizer
from plait.models.units import model_units
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.pipeline_training import to_toml

FAST = ["--microbatch-size", "2", "--repeats", "1", "--warmup", "0"]


def _job(tmp_path) -> str:
    records = demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("text",), limit=2)
    train = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(train), None, str(tmp_path / "run"),
                           train={"steps": 1, "global_batch_size": 2, "microbatch_size": 2, "threads": 1})
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job) + "\n")
    return str(path)


def _unit_names(tmp_path) -> list[str]:
    job = tiny_config_dict(str(tmp_path / "train.jsonl"))
    cfg = config_from_dict(job)
    return [u.name for u in model_units(build_model(cfg.model, load_tokenizer(cfg.data.tokenizer)))]


def test_profile_writes_a_table_and_reuses_only_a_matching_profile(tmp_path, capsys):
    job, out = _job(tmp_path), tmp_path / "profile.json"
    assert main(["profile", "--config", job, "--out", str(out), *FAST]) == 0
    first = capsys.readouterr().out
    assert f"measuring (no stored profile at {out})" in first
    rows = [line.split()[0] for line in first.splitlines() if line.startswith(("encoders.", "language_model."))]
    assert rows == _unit_names(tmp_path)
    stored = json.loads(out.read_text())
    assert [m["name"] for m in stored["measurements"]] == rows
    assert stored["key"]["shapes"][0]["input_ids"][0] == 2 and stored["key"]["dtype"] == "float32"

    assert main(["profile", "--config", job, "--out", str(out), *FAST]) == 0
    assert f"reusing {out}" in capsys.readouterr().out

    assert main(["profile", "--config", job, "--out", str(out), *FAST, "--model.llm.freeze=true"]) == 0
    text = capsys.readouterr().out
    assert "stale: model.model.llm.freeze differs (stored False, wanted True)" in text
    frozen = json.loads(out.read_text())
    head = next(u for u in frozen["units"] if u["name"] == "language_model.lm_head")
    assert head["trainable"] is False and head["needs_input_grad"] is True


def test_train_with_an_automatic_plan(tmp_path, capsys):
    job, store = _job(tmp_path), tmp_path / "profiles"
    assert main(["train", "--config", job, "--parallel.plan=auto", "--profile-store", str(store),
                 "--metrics.progress=false", "--metrics.tensorboard=false"]) == 0
    text = capsys.readouterr().out
    assert "plait: parallel.plan=auto for 1 process(es): DP 1 x PP 1" in text and "trained 1 step (" in text
    assert len(list(store.glob("profile-*.json"))) == 1


def test_profile_refuses_to_overwrite_a_file_that_is_not_a_profile(tmp_path, capsys):
    job, out = _job(tmp_path), tmp_path / "plan.json"
    out.write_text(json.dumps({"dp": 1, "plan": {}, "parallel_pp_toml": None}))
    before = out.read_text()
    assert main(["profile", "--config", job, "--out", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"plait: error: profile file {out} exists and is not a plait profile" in err
    assert out.read_text() == before


def test_auto_plan_says_what_it_replaces():
    from plait.commands.train import auto_plan_replaces
    from plait.config.schema import PipelineConfig

    cfg = config_from_dict(tiny_config_dict("train.jsonl"))
    resolved = config_from_dict(tiny_config_dict("train.jsonl"))
    resolved.parallel.dp, resolved.parallel.pp = 2, PipelineConfig(degree=1)
    assert auto_plan_replaces(cfg, resolved) is None  # the job wrote neither: nothing to say
    cfg.parallel.dp = 4
    cfg.parallel.pp = PipelineConfig(degree=2, microbatches=8)
    assert auto_plan_replaces(cfg, resolved) == (
        "plait: parallel.plan=auto replaces the job's parallel.dp = 4 -> 2, parallel.pp.degree = 2 -> 1, "
        "parallel.pp.microbatches = 8 -> 0 (written -> chosen)")
