"""Values a new user passes on the command line: an empty run folder."""

from __future__ import annotations

from plait.config.loader import load_config, read_config_data
from tests.conftest import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def test_empty_run_dir_means_the_default_folder_of_the_job():
    assert read_config_data(DEMO, ["--metrics.run_dir="])["metrics"]["run_dir"] == "runs/demo"
    assert load_config(DEMO, ["--metrics.run_dir="]).metrics.run_dir == "runs/demo"
    assert read_config_data(DEMO, ["--metrics.run_dir=out/x"])["metrics"]["run_dir"] == "out/x"

