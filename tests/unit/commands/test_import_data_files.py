"""``plait import --train/--val`` refuses a data file that does not exist before reading the checkpoint (the job
it wrote named the missing file and failed only at ``plait train``)."""

from __future__ import annotations

import os

import pytest

from plait.commands.import_hf import import_command


@pytest.mark.parametrize("flag", ["train", "val"])
def test_import_refuses_a_missing_data_file_naming_the_flag_and_path(tmp_path, flag):
    data = tmp_path / "there.jsonl"
    data.write_text("")
    paths = {"train": str(data), "val": str(data), flag: str(tmp_path / "nope.jsonl")}
    with pytest.raises(FileNotFoundError, match=rf"^plait import --{flag} {tmp_path}/nope.jsonl: no such data "
                                                r"file$"):
        import_command(tmp_path / "no-checkpoint", tmp_path / "out", **paths)
    assert not (tmp_path / "out").exists()


def test_a_relative_missing_data_file_names_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"--train nope.jsonl: no such data file \(relative to the working "
                                                rf"directory {os.getcwd()}\)"):
        import_command(tmp_path / "no-checkpoint", tmp_path / "out", train="nope.jsonl")
