"""``plait launch`` argument parsing (no processes)."""

from __future__ import annotations

import pytest

from plait.commands.launch import parse_kills, worker_command


def test_parse_kills_reads_worker_step_pairs_and_names_a_bad_value():
    assert parse_kills(["4:1", "0:3"]) == ((4, 1), (0, 3))
    assert parse_kills([]) == ()
    with pytest.raises(ValueError, match=r"'4-1': expected WORKER:STEP"):
        parse_kills(["4-1"])


def test_worker_command_passes_the_config_overrides_and_joining_flag():
    cmd = worker_command("job.toml", ["--train.lr=1e-3"], 2, 6, "127.0.0.1:1234", joining=True)
    assert cmd[1:] == ["-m", "plait.cli", "launch", "--config", "job.toml", "--nproc", "6", "--worker", "2",
                       "--store", "127.0.0.1:1234", "--joining", "--train.lr=1e-3"]
