"""``plait train --resume`` of a checkpoint that ``plait launch`` wrote (its layout recorded as the launch's
workers): the resume line describes that layout truthfully, and the line naming ``final/`` describes the process that
wrote it, not the launch."""

from __future__ import annotations

from plait.config.loader import load_config
from plait.train.checkpoint import CheckpointLayout
from plait.train.trainer import Trainer
from tests.helpers.cli import plait, write_job

# What plait launch records after a failure left pipelines of 1 and 2 workers (PP at least 2: it saves stage models).
LAUNCH = CheckpointLayout(world_size=3, dp=2, pp=2, cp=1,
                          plan="plait launch: workers [0]: 1 stages, 2 mb; workers [1, 2]: 2 stages, 2 mb")


def test_final_written_by_a_resume_of_a_launched_run_names_the_resuming_layout(tmp_path, monkeypatch):
    job = write_job(tmp_path)
    small = ["train.global_batch_size=4", "data.val=", "checkpoint.every=2", "metrics.progress=false",
             "train.threads=1"]
    trainer = Trainer.build(load_config(job, ["train.steps=2", *small]))
    monkeypatch.setattr(trainer, "checkpoint_layout", lambda: LAUNCH)  # the checkpoint as the launch wrote it
    trainer.fit()
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step_000002").is_dir() and not (run / "final").exists()

    resumed = plait("train", "--config", job, "--resume", "--train.steps=3", *(f"--{o}" for o in small))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout
    assert ("resuming step 2 written with 3 processes (plait launch: workers [0]: 1 stages, 2 mb; workers [1, 2]: "
            "2 stages, 2 mb), now 1 process (DP 1 x PP 1 x CP 1)") in out, out
    assert "DP 2 x PP 2" not in out  # 2 x 2 is not 3 processes
    assert f"model {run / 'final'} (written by this run: 1 process (DP 1 x PP 1 x CP 1))" in out, out
    assert (run / "final" / "plait_config.json").is_file()
