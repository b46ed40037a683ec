"""What a resume checks and says beyond the layout: the training set is the one the checkpoint was written with
(its usable samples' ids in order, ``training_set_identity``), a checkpoint past ``train.steps`` says so, the setup
line names how FSDP2 runs, and ``Trainer.fit`` holds the run folder's lock."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from plait.config.loader import config_from_dict
from plait.parallel.fsdp import ShardedModel
from plait.train.checkpoint import training_set_identity
from plait.train.run_lock import LOCK_NAME
from plait.train.run_start import fsdp_description, nothing_to_train
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.run_lock import start_holder, stop_holder


def test_resume_refuses_another_training_set_of_the_same_size_naming_both_files(tiny_job, tmp_path):
    recs = demo_records("train", ("text",), limit=4)
    sections = {"train": {"steps": 1, "global_batch_size": 2, "microbatch_size": 2}}
    first = Trainer.build(tiny_job(recs, **sections))
    first.fit()
    saved = training_set_identity(first.train_set)
    train = tmp_path / "train.jsonl"
    assert saved["files"] == [str(train)] and saved["samples"] == 4 and len(saved["ids_sha256"]) == 64
    sections["train"]["steps"] = 2

    rev = write_jsonl(tmp_path / "train_rev.jsonl", recs[::-1])  # same size, same records, another order
    cfg = config_from_dict(tiny_config_dict(str(rev), None, str(tmp_path / "run"), **sections))
    resumed = Trainer.build(cfg)
    assert training_set_identity(resumed.train_set)["ids_sha256"] != saved["ids_sha256"]
    with pytest.raises(ValueError) as refused:
        resumed.fit(resume=True)
    message = str(refused.value)
    assert message.startswith(f"cannot resume from {tmp_path / 'run' / 'checkpoints' / 'step_000001'}: the training "
                              f"set differs: it was written training on {train}, now on {rev} (4 and 4 usable "
                              "samples; their record ids in order differ)")
    assert "resume with that run's data.train" in message and refused.value.same_on_every_rank

    with pytest.raises(ValueError, match=f"the training set differs: {train} changed since it was written"):
        Trainer.build(tiny_job(recs[::-1], **sections)).fit(resume=True)  # its own file, rewritten reordered

    copy = shutil.copy(tiny_job(recs, **sections).data.train, tmp_path / "moved.jsonl")  # same records, other path
    cfg = config_from_dict(tiny_config_dict(str(copy), None, str(tmp_path / "run"), **sections))
    assert Trainer.build(cfg).fit(resume=True)["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_fit_holds_the_run_folders_lock_and_refuses_one_held_by_a_live_run(tiny_job, tmp_path):
    cfg = tiny_job(demo_records("train", ("text",), limit=2),
                   train={"steps": 1, "global_batch_size": 2, "microbatch_size": 2})
    trainer = Trainer.build(cfg)
    proc = start_holder(tmp_path / "run")
    try:
        with pytest.raises(ValueError, match=f"is in use by another plait run: process {proc.pid} on this host"):
            trainer.fit(overwrite=True)
        assert proc.poll() is None
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_NAME]  # nothing written or removed
    finally:
        assert stop_holder(proc) == 0
    seen = []
    trainer.save = lambda: seen.append((tmp_path / "run" / LOCK_NAME).is_file())  # held while the run writes
    assert trainer.fit()["step"] == 1 and seen == [True]
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_checkpoint_past_train_steps_says_so_and_how_to_train_on():
    train = SimpleNamespace(steps=20, epochs=1.0)
    assert nothing_to_train(40, 20, train) == (
        "checkpoint at step 40 is past train.steps = 20: nothing to train (train.steps counts from the run's start, "
        "not from the checkpoint: 20 more steps is --train.steps=60)")
    assert nothing_to_train(20, 20, train) == (
        "nothing to train: checkpoint is at step 20, train.steps = 20 (longer: --train.steps=N above 20)")
    assert nothing_to_train(50, 47, SimpleNamespace(steps=0, epochs=2.0)).startswith(
        "checkpoint at step 50 is past train.epochs = 2.0 (47 steps): nothing to train")


def test_the_setup_line_names_fsdp2s_reshard_mode_and_offload():
    assert fsdp_description(None) == ""
    assert fsdp_description(ShardedModel()) == "fsdp_reshard after_forward, offload none"
    assert fsdp_description(ShardedModel(offload=True, reshard_after_forward=False)) == (
        "fsdp_reshard after_backward, offload cpu")
    assert fsdp_description(ShardedModel(), pipeline=True) == (
        "parameters gathered once per step (pipeline stages), offload none")
