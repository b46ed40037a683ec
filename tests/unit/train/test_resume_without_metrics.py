"""``--resume`` on a run folder without ``metrics.jsonl`` resumes from the newest checkpoint (a new metrics file
from the resumed step on); without a checkpoint it is refused with a message naming the folder and what to run."""

from __future__ import annotations

import logging
import shutil

import pytest

from plait.config.loader import config_from_dict
from plait.train.metrics import MetricsWriter, read_metrics
from plait.train.run_dir import no_checkpoint_message
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl


def test_metrics_writer_resuming_without_a_file_starts_one(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="plait.train.metrics"):
        w = MetricsWriter(tmp_path, tensorboard=False, resume_step=3)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert f"{tmp_path / 'metrics.jsonl'} does not exist: resuming at step 3" in caplog.text
    w.write({"step": 4, "loss": 1.5})
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in rows] == [(4, 1.5)] and rows[0]["elapsed_s"] >= 0.0


def test_no_checkpoint_message_names_the_folder_and_what_it_holds(tmp_path):
    gone = no_checkpoint_message(tmp_path / "nope")
    assert gone.startswith(f"no checkpoint to resume from under {tmp_path / 'nope' / 'checkpoints'} (the folder "
                           "does not exist;")
    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    held = no_checkpoint_message(tmp_path)
    assert "(the folder holds a final model (final/) and metrics.jsonl but no checkpoint;" in held
    assert "`plait train --config JOB`" in held and "--overwrite" in held and "--resume=DIR" in held


def test_resume_recreates_metrics_and_refuses_without_a_checkpoint(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("image_digit",), limit=4))

    def job(steps: int):
        return config_from_dict(tiny_config_dict(str(train), None, str(tmp_path / "run"), train={"steps": steps}))

    Trainer.build(job(2)).fit()
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.unlink()
    # nothing to train (checkpoint at the last step): the resumed run still has its metrics file
    assert Trainer.build(job(2)).fit(resume=True)["step"] == 2 and metrics.read_text() == ""
    metrics.unlink()
    result = Trainer.build(job(3)).fit(resume=True)
    assert (result["steps"], result["step"]) == (1, 3)
    assert [r["step"] for r in read_metrics(metrics)] == [3] and read_metrics(metrics)[0]["loss"] == result["losses"][0]
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint to resume from under .*checkpoints \(the folder "
                                                r"holds metrics.jsonl but no checkpoint; .*plait train --config JOB"):
        Trainer.build(job(3)).fit(resume=True)
