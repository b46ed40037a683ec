"""Safe run folders: ``metrics.run_dir`` defaults to ``runs/<job file name>``, and a new run refuses a folder that
holds an earlier run's checkpoints or final model unless ``--overwrite``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.commands.train import train_command
from plait.config.loader import load_config
from plait.train.run_dir import check_new_run, earlier_run
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.run_dir import toml_text


def write_job(folder: Path, name: str, **sections) -> Path:
    """A tiny job file ``folder/<name>.toml`` without a ``[metrics]`` table."""
    train = write_jsonl(folder / "train.jsonl", demo_records("train", ("text",), limit=4))
    data = tiny_config_dict(str(train), **sections)
    del data["metrics"]
    job = folder / f"{name}.toml"
    job.write_text(toml_text(data))
    return job


def test_the_default_run_dir_is_named_after_the_job_file(tmp_path):
    job = write_job(tmp_path, "myjob")
    assert "[metrics]" not in job.read_text()
    assert load_config(job).metrics.run_dir == "runs/myjob"
    assert load_config(job, ["--metrics.run_dir=elsewhere"]).metrics.run_dir == "elsewhere"
    assert load_config(job, ["--metrics.log_every=2"]).metrics.run_dir == "runs/myjob"
    job.write_text(job.read_text() + '[metrics]\nrun_dir = "mine"\n')
    assert load_config(job).metrics.run_dir == "mine"


def test_a_new_job_writes_runs_of_its_name_and_refuses_an_earlier_run_without_overwrite(tmp_path, monkeypatch,
                                                                                        capsys):
    monkeypatch.chdir(tmp_path)  # as when run from the repository root
    demo = tmp_path / "runs" / "demo"
    (demo / "checkpoints" / "step_000300").mkdir(parents=True)
    (demo / "checkpoints" / "step_000300" / ".metadata").write_text("x")
    (demo / "metrics.jsonl").write_text('{"step": 300, "loss": 0.1}\n')
    before = sorted((p.relative_to(demo), p.stat().st_mtime_ns) for p in demo.rglob("*"))
    job = write_job(tmp_path, "myjob", train={"steps": 2, "global_batch_size": 2, "microbatch_size": 2})
    overrides = ["--metrics.progress=false", "--metrics.tensorboard=false"]

    assert train_command("myjob.toml", overrides) == 0
    assert "plait: run folder runs/myjob (metrics to metrics.jsonl; checkpoints/, final/)" in capsys.readouterr().out
    run = tmp_path / "runs" / "myjob"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert (run / "checkpoints" / "step_000002").is_dir() and (run / "final").is_dir()
    assert sorted((p.relative_to(demo), p.stat().st_mtime_ns) for p in demo.rglob("*")) == before  # untouched
    assert earlier_run(run) == ["1 checkpoint(s), newest step_000002", "a final model (final/)"]

    with pytest.raises(ValueError) as refused:  # before anything is built
        train_command(job.name, overrides)
    message = str(refused.value)
    assert message.startswith("runs/myjob holds an earlier run (1 checkpoint(s), newest step_000002; a final model")
    job_args = "--config myjob.toml --metrics.progress=false --metrics.tensorboard=false"  # the overrides kept
    assert f"`plait train {job_args} --resume`" in message
    assert f"`plait train {job_args} --overwrite`" in message and "--metrics.run_dir=DIR" in message
    assert getattr(refused.value, "same_on_every_rank", False)
    with pytest.raises(ValueError, match="--resume continues the run in metrics.run_dir and --overwrite replaces it"):
        train_command(job.name, overrides, resume=True, overwrite=True)

    (run / "final" / "marker").write_text("old")
    assert train_command(job.name, overrides + ["--train.steps=1"], overwrite=True) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    assert not (run / "final" / "marker").exists() and (run / "final").is_dir()
    assert sorted((p.relative_to(demo), p.stat().st_mtime_ns) for p in demo.rglob("*")) == before


def test_the_trainer_itself_refuses_an_earlier_run(tiny_job, tmp_path):
    recs = demo_records("train", ("text",), limit=2)
    cfg = tiny_job(recs, train={"steps": 1, "global_batch_size": 2, "microbatch_size": 2})
    Trainer.build(cfg).fit()
    with pytest.raises(ValueError, match=r"run holds an earlier run \(1 checkpoint\(s\), newest step_000001\)"):
        Trainer.build(cfg).fit()
    check_new_run(tmp_path / "nothing here")  # an empty or missing folder is fine
