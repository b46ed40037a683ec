"""A bad job file is refused before torch or transformers is imported (``plait.train.job_file``, ``plait.cli``):
every verb that reads ``--config`` reads it as the verb will, and the error carries ``same_on_every_rank``; the verbs
without a job file refuse overrides as early."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from plait.train.job_file import check_job, load_config_for_planning
from plait.config.loader import load_config
from tests.helpers.jobs import ROOT

JOB = str(ROOT / "configs" / "demo.toml")

# one interpreter runs every case (about 0.5 s in all): the config loader only, then sys.modules is read
_SCRIPT = """
import json, sys
from plait.cli import main
cases = json.loads(sys.argv[1])
codes = [main(args) for args in cases]
print(json.dumps({"codes": codes, "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def test_every_job_verb_refuses_a_bad_job_before_importing_torch_or_transformers(tmp_path):
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text("{}")
    missing = tmp_path / "missing.toml"
    cases = [["train", "--config", JOB, "--train.bogus=1"],
             ["plan", "--config", str(missing), "--devices", "2"],
             ["energy", "--config", JOB, "--devices", "2", "--train.lr=x"],
             ["profile", "--config", JOB, "--train.lr=-1"],
             ["tune-ranks", "--config", JOB, "--model.llm.freeze=maybe"],
             ["launch", "--config", JOB, "--nproc", "2", "--parallel.pp.degree=0"],
             ["simulate", "--plan", str(bad_plan), "--out-dir", str(tmp_path / "sim")],
             ["generate", "--model", str(tmp_path), "--prompt", "hi", "--train.lr=1"],
             ["export", "--run", str(tmp_path), "--format", "llava", "--train.lr=1"]]
    run = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == {"codes": [2] * 9, "loaded": []}
    lines = run.stderr.splitlines()
    assert len(lines) == 9, run.stderr
    assert lines[0].startswith("plait: error: unknown config key(s) ['train.bogus']; known: ['activation_checkpointing'")
    assert lines[1:6] == [f"plait: error: config file {missing} does not exist",
                          "plait: error: train.lr: expected float, got 'x'",
                          "plait: error: train.lr must be > 0 and train.min_lr_ratio in [0, 1]",
                          "plait: error: model.llm.freeze: expected bool, got 'maybe'",
                          "plait: error: parallel.pp.degree must be >= 1, got 0"]
    assert lines[6].startswith(f"plait: error: --plan {bad_plan} is not a plan JSON written by `plait plan --out`")
    assert lines[7:] == ["plait: error: plait generate takes no overrides, got ['--train.lr=1']",
                         "plait: error: plait export takes no overrides, got ['--train.lr=1']"]


def test_check_job_reads_as_the_verb_reads_and_marks_the_error_for_every_rank():
    assert check_job(JOB, ["--parallel.pp.degree=0"], planning=True) is None  # the plan replaces [parallel.pp]
    assert load_config_for_planning(JOB, ["--parallel.pp.degree=0"]) == (load_config(JOB), "[parallel.pp] table")
    with pytest.raises(ValueError, match=r"^parallel\.pp\.degree must be >= 1, got 0$") as refused:
        check_job(JOB, ["--parallel.pp.degree=0"])
    assert refused.value.same_on_every_rank is True
    with pytest.raises(FileNotFoundError, match="config file nowhere.toml does not exist") as missing:
        check_job("nowhere.toml", [], planning=True)
    assert missing.value.same_on_every_rank is True
    folder = ROOT / "configs"
    with pytest.raises(FileNotFoundError, match=f"^config file {re.escape(str(folder))} is a folder, not a job file; "
                                                r"it holds [a-z_]+\.toml, "):
        check_job(str(folder), [])


def test_check_job_leaves_the_loaders_warnings_to_the_verb(caplog):
    big = ["--train.microbatch_size=100000"]  # legal, but larger than the global batch: the loader warns
    with caplog.at_level(logging.WARNING, logger="plait.config.loader"):
        check_job(JOB, big)
        check_job(JOB, big, planning=True)
        assert caplog.records == []
        load_config(JOB, big)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "train.microbatch_size (100000) is larger than train.global_batch_size (32)"]
    assert logging.getLogger("plait.config.loader").level == logging.NOTSET
