"""Helpers of several test modules, taken from tests/e2e/test_cli.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.jobs import ROOT, demo_records, write_jsonl


def toml_value(v) -> str:
    return json.dumps(v)


def write_job(tmp_path) -> str:
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", limit=12))
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=6))
    text = (ROOT / "configs" / "demo.toml").read_text()
    text = text.replace('"data/demo/train.jsonl"', toml_value(str(train))).replace(
        '"data/demo/val.jsonl"', toml_value(str(val))).replace(
        '"data/demo/tokenizer"', toml_value(str(ROOT / "data/demo/tokenizer"))).replace(
        '"runs/demo"', toml_value(str(tmp_path / "run")))
    job = tmp_path / "job.toml"
    job.write_text(text)
    return str(job)


def plait(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
