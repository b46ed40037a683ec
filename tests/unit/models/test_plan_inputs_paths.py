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


def test_a_missing_pretrained_folder_is_named_with_how_to_make_it(tmp_path):
    """A recipe before ``plait import``: plan and train say the same, naming the import."""
    from plait.config.loader import load_config as load
    from plait.data.chat_template import missing_pretrained

    cfg = load(ROOT / "configs" / "recipes" / "qwen3_vl.toml", [f"--model.pretrained={tmp_path / 'nowhere'}"])
    with pytest.raises(FileNotFoundError) as info:
        model_parts(cfg)
    assert str(info.value) == missing_pretrained(str(tmp_path / "nowhere"))
    assert "plait import --from <Hugging Face folder> --out <dir>" in str(info.value)
