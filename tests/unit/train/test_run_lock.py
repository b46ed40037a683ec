"""The run folder's lock (``plait.train.run_lock``): a run into a folder another live run is writing is refused,
naming the folder and the other process; the other run is unharmed; a dead run's lock is taken over with a
warning; another host's is refused with how to remove it. The other run is a second process holding the lock (no
training): the module imports no torch, so it starts in a fraction of a second."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plait.train.run_lock import (LOCK_NAME, acquire_run_lock, busy_run_message, check_run_free, hold_run_lock,
                                  release_run_lock)
from tests.helpers.run_lock import start_holder, stop_holder


def lock_owner(run: Path) -> int:
    return json.loads((run / LOCK_NAME).read_text())["pid"]


def test_a_second_run_is_refused_naming_the_folder_and_the_other_process_which_is_unharmed(tmp_path):
    run = tmp_path / "run"
    proc = start_holder(run)
    try:
        for attempt in (check_run_free, acquire_run_lock):
            with pytest.raises(ValueError) as refused:
                attempt(run)
            message = str(refused.value)
            assert message.startswith(f"{run} is in use by another plait run: process {proc.pid} on this host, "
                                      "started ")
            assert f"(lock {run / LOCK_NAME}); wait for it to end or stop it" in message
            assert "--metrics.run_dir=DIR" in message
        with pytest.raises(ValueError, match="is in use by another plait run") as refused, hold_run_lock(run):
            raise AssertionError("the block must not run")
        assert refused.value.same_on_every_rank
        assert proc.poll() is None and lock_owner(run) == proc.pid  # the first run keeps its lock
    finally:
        assert stop_holder(proc) == 0
    assert not (run / LOCK_NAME).exists()  # released by its holder on its way out
    assert busy_run_message(run) is None
    with hold_run_lock(run):  # now free
        assert lock_owner(run) == os.getpid()
    assert not (run / LOCK_NAME).exists()


def test_a_dead_runs_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    proc = start_holder(run, then="exit")  # ends without releasing: a run killed before its cleanup
    dead = proc.pid
    assert stop_holder(proc) == 0 and lock_owner(run) == dead
    assert busy_run_message(run) is None  # stale: not in the way
    with caplog.at_level("WARNING", logger="plait.train.trainer"):
        acquire_run_lock(run)
    assert f"taking over the lock of process {dead} on this host, which is gone" in caplog.text
    assert lock_owner(run) != dead
    release_run_lock(run)
    assert not (run / LOCK_NAME).exists()


def test_another_hosts_lock_is_refused_with_how_to_remove_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME
    lock.write_text(json.dumps({"host": "elsewhere.example", "pid": 4242, "started": 1.7e9,
                                "command": "plait train --config job.toml"}))
    before = lock.read_text()
    with pytest.raises(ValueError) as refused:
        acquire_run_lock(run)
    message = str(refused.value)
    assert message.startswith(f"{run} is in use by a plait run on host elsewhere.example: process 4242, started ")
    assert "(plait train --config job.toml) holds its lock" in message
    assert f"remove the lock (rm {lock})" in message
    assert lock.read_text() == before
    release_run_lock(run)  # not this process's: left alone
    assert lock.read_text() == before


def test_a_torchrun_restart_takes_over_its_earlier_attempts_lock_from_another_host(tmp_path, monkeypatch, caplog):
    """The same torchrun job (``TORCHELASTIC_RUN_ID``) restarted (a higher ``TORCHELASTIC_RESTART_COUNT``): its
    earlier attempt's lock on another host is taken over; another job's, or the same attempt's, is refused."""
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME

    def held_by(run_id: str, restart: int) -> None:
        lock.write_text(json.dumps({"host": "node0.example", "pid": 4242, "started": 1.7e9, "command": "plait train",
                                    "run_id": run_id, "restart": restart}))

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for other in (("job8", 0), ("job7", 1)):
        held_by(*other)
        assert "is in use by a plait run on host node0.example" in busy_run_message(run), other
    held_by("job7", 0)
    assert busy_run_message(run) is None
    acquire_run_lock(run)
    assert "taking over the lock of process 4242 on node0.example, this torchrun job's attempt before" in caplog.text
    mine = json.loads(lock.read_text())
    assert (mine["pid"], mine["run_id"], mine["restart"]) == (os.getpid(), "job7", 1)
    release_run_lock(run)
    assert not lock.exists()


def test_the_lock_is_reentrant_and_released_on_every_exit_path(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with hold_run_lock(run):
        with hold_run_lock(run):  # the command holds it around fit, which takes it too
            assert (run / LOCK_NAME).is_file()
        assert (run / LOCK_NAME).is_file()  # still held by the outer block
    assert not (run / LOCK_NAME).exists()
    with pytest.raises(RuntimeError, match="boom"), hold_run_lock(run):
        raise RuntimeError("boom")
    assert not (run / LOCK_NAME).exists()
    with hold_run_lock(run, is_main=False):  # another rank: neither takes nor checks it
        assert not (run / LOCK_NAME).exists()

    def unwritable(run_dir):
        raise PermissionError(13, "Permission denied", str(run_dir))

    monkeypatch.setattr("plait.train.run_lock.acquire_run_lock", unwritable)
    with pytest.raises(ValueError, match=f"^cannot write the lock of run folder {run}: .*Permission denied") as err:
        with hold_run_lock(run):
            raise AssertionError("the block must not run")
    assert err.value.same_on_every_rank  # a ValueError every rank raises, not rank 0's OSError alone
    assert "[Errno" not in str(err.value) and "metrics.run_dir" in str(err.value)  # plain words and the field


def test_plait_train_and_launch_refuse_a_folder_in_use_before_building_anything(tmp_path, capsys):
    from plait.cli import main
    from plait.train.job_file import check_job
    from plait.commands.launch import launch_command
    from plait.commands.train import train_command
    from tests.helpers.jobs import tiny_config_dict
    from tests.helpers.run_dir import toml_text

    run = tmp_path / "run"
    job = tmp_path / "job.toml"
    job.write_text(toml_text(tiny_config_dict(str(tmp_path / "missing.jsonl"), None, str(run))))
    proc = start_holder(run)
    try:
        for kwargs in ({}, {"overwrite": True}, {"resume": True}):  # --overwrite and --resume too
            with pytest.raises(ValueError, match=f"process {proc.pid} on this host") as refused:
                train_command(job, [], **kwargs)
            assert refused.value.same_on_every_rank
        with pytest.raises(ValueError, match=f"process {proc.pid} on this host"):
            launch_command(job, 4, 1)
        with pytest.raises(ValueError, match=f"process {proc.pid} on this host") as refused:  # before torch loads
            check_job(job, [], run_folder=True)
        assert refused.value.same_on_every_rank
        check_job(job, [])  # plait launch's workers (their launcher holds the lock), plait profile, ...
        assert main(["train", "--config", str(job)]) == 2
        assert capsys.readouterr().err == f"plait: error: {refused.value}\n"
        assert proc.poll() is None and lock_owner(run) == proc.pid
    finally:
        assert stop_holder(proc) == 0
