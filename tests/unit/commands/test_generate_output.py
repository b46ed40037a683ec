"""plait generate --output: the --input file itself or a directory is refused before the model loads (the model path
here does not exist, so reaching the load would raise FileNotFoundError instead); another existing file is still
overwritten."""

import os

import pytest

from plait.cli import main
from plait.commands.generate import check_output_path, generate_command

RECORD = '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'


def test_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path):
    data = tmp_path / "recs.jsonl"
    data.write_text(RECORD)
    for out in (data, tmp_path / "sub" / ".." / "recs.jsonl"):
        with pytest.raises(ValueError, match=rf"^--output {out} is the --input file {data}: writing the predictions "
                                             r"there would overwrite the records; give another --output file$"):
            generate_command(tmp_path / "missing", input_path=data, output_path=out)
    assert data.read_text() == RECORD


def test_a_link_to_the_input_is_the_input(tmp_path):
    data, link = tmp_path / "recs.jsonl", tmp_path / "link.jsonl"
    data.write_text(RECORD)
    os.link(data, link)  # a hard link: another path, the same file
    with pytest.raises(ValueError, match=r"is the --input file"):
        check_output_path(link, data)


def test_output_that_is_a_directory_is_refused_before_generating(tmp_path, capsys):
    data = tmp_path / "recs.jsonl"
    data.write_text(RECORD)
    assert main(["generate", "--model", str(tmp_path / "missing"), "--input", str(data),
                 "--output", str(tmp_path)]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"plait: error: --output {tmp_path} is a directory: give the JSONL file to write the predictions to, "
        f"e.g. --output {tmp_path / 'predictions.jsonl'}")


def test_another_existing_output_passes_the_check(tmp_path):
    data, out = tmp_path / "recs.jsonl", tmp_path / "old_predictions.jsonl"
    data.write_text(RECORD)
    out.write_text("old\n")
    check_output_path(out, data)  # overwritten later, as any output file
    with pytest.raises(FileNotFoundError):  # past the check: the model load is what fails
        generate_command(tmp_path / "missing", input_path=data, output_path=out)
