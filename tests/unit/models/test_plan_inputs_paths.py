"""The plan's inputs read the job's files or say which one is missing: a ``data.tokenizer`` that is no directory
(a relative path read from another working directory) is refused, not replaced by the config's default vocabulary."""

from __future__ import annotations

import os
import re

import pytest

from plait.config.loader import load_config
from plait.models.plan_inputs import model_parts
from tests.helpers.jobs import ROOT


def test_the_demo_tokenizer_sets_the_llm_vocabulary_and_a_missing_one_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    configs, _, _ = model_parts(load_config(ROOT / "configs" / "demo.toml"))
    vocab = configs["llm"].vocab_size
    monkeypatch.chdir(tmp_path)  # data/demo/tokenizer does not resolve from here
    with pytest.raises(FileNotFoundError, match=r"^data\.tokenizer data/demo/tokenizer is not a directory \(relative "
                                                r"paths are read from the working directory, " + re.escape(str(tmp_path))):
        model_parts(load_config(ROOT / "configs" / "demo.toml"))
    assert vocab < 1000 and os.getcwd() == str(tmp_path)  # the demo's own small vocabulary was read
