"""Helpers of several test modules, taken from tests/unit/data/test_processing.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import pytest

from plait.models.registry import build_model, build_processor, load_tokenizer


@pytest.fixture(scope="module")
def setup():
    from plait.config.loader import config_from_dict
    from tests.helpers.jobs import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok)
    return tok, model, build_processor(cfg.model, model, tok, 256)
