"""Where relative paths are resolved: job-file paths against the working directory (errors say which), media
paths inside a JSONL file against that file's folder."""

from __future__ import annotations

import shutil

import pytest

from plait.data.sources import parse_record, read_jsonl
from plait.models.hf import _load_config
from plait.models.registry import load_tokenizer
from tests.helpers.jobs import DEMO, ROOT, demo_records, write_jsonl


def test_a_relative_job_path_is_read_from_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert load_tokenizer("data/demo/tokenizer").chat_template
    monkeypatch.chdir(tmp_path)
    note = rf" \(relative to the working directory {tmp_path}\)$"
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory data/demo/tokenizer does not exist" + note):
        load_tokenizer("data/demo/tokenizer")
    with pytest.raises(FileNotFoundError, match=r"data file data/demo/train.jsonl does not exist" + note):
        read_jsonl("data/demo/train.jsonl")
    with pytest.raises(FileNotFoundError, match=r"model directory models/llm does not exist" + note):
        _load_config("models/llm")


def test_an_absolute_missing_path_gets_no_working_directory_note(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"tokenizer directory {tmp_path / 'nope'} does not exist$"):
        load_tokenizer(str(tmp_path / "nope"))


def test_media_paths_in_a_jsonl_are_relative_to_that_file(monkeypatch, tmp_path):
    rec = demo_records("train", ("image_digit",), limit=1)[0]
    (tmp_path / "set" / "img").mkdir(parents=True)
    shutil.copy(rec["images"][0], tmp_path / "set" / "img" / "a.png")
    path = write_jsonl(tmp_path / "set" / "data.jsonl", [{**rec, "images": ["img/a.png"]}])
    monkeypatch.chdir(DEMO)  # another folder: must not matter
    [(obj, where, _)] = read_jsonl(path)
    assert parse_record(obj, where, path.parent).media["image"] == (str(tmp_path / "set" / "img" / "a.png"),)
