"""``plait profile --energy`` without a GPU: the sweep is skipped with the reason (no invented numbers)."""

from __future__ import annotations

import io

import pytest

from plait.measure.job_profile import energy_profile_job
from plait.config.loader import config_from_dict, validate
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl


def test_energy_sweep_skips_on_cpu_with_the_reason(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("image_digit",), limit=2))
    cfg = config_from_dict(tiny_config_dict(str(train), None, str(tmp_path / "run"),
                                            train={"microbatch_size": 1, "device": "cpu", "threads": 1}))
    validate(cfg)
    out = io.StringIO()
    assert energy_profile_job(cfg, store_dir=tmp_path / "profiles", clocks=3, out=out) is None
    assert out.getvalue().startswith("plait profile: energy sweep skipped: no GPU (cpu device)")
    assert not (tmp_path / "profiles").exists()
    with pytest.raises(ValueError, match="--clocks must be >= 1"):
        energy_profile_job(cfg, clocks=0)
