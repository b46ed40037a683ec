"""Values a new user passes on the command line: an empty run folder and bad data-loader settings."""

from __future__ import annotations

import re

import pytest

from plait.config.loader import load_config, read_config_data
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def test_empty_run_dir_means_the_default_folder_of_the_job():
    assert read_config_data(DEMO, ["--metrics.run_dir="])["metrics"]["run_dir"] == "runs/demo"
    assert load_config(DEMO, ["--metrics.run_dir="]).metrics.run_dir == "runs/demo"
    assert read_config_data(DEMO, ["--metrics.run_dir=out/x"])["metrics"]["run_dir"] == "out/x"


@pytest.mark.parametrize("override, message", [
    ("--data.num_workers=-1", "data.num_workers must be >= 0, got -1"),
    ("--data.prefetch=-1", "data.prefetch must be >= 1, got -1"),
    ("--data.prefetch=0", "data.prefetch must be >= 1, got 0"),
])
def test_bad_loader_settings_name_the_field(override, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_config(DEMO, [override])
