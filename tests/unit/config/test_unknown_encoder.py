"""An override naming an encoder the job does not have is reported as such (found by a fresh-user pass)."""

from __future__ import annotations

import re

import pytest

from plait.config.loader import load_config
from tests.helpers.jobs import ROOT


def test_a_misspelt_encoder_override_lists_the_known_encoders():
    message = ("model.encoders.vison: no such encoder in the job (encoders: audio, vision); "
               "a new encoder needs path or config")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(ROOT / "configs" / "demo.toml", ["--model.encoders.vison.freeze=true"])


def test_an_encoder_with_both_path_and_config_still_says_exactly_one():
    with pytest.raises(ValueError, match="model.encoders.vision: give exactly one of path and config"):
        load_config(ROOT / "configs" / "demo.toml", ["--model.encoders.vision.path=/somewhere"])
