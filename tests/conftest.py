"""Shared fixtures: a tiny job on a slice of the committed demo set."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.helpers.jobs import tiny_config_dict, write_jsonl


torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tiny_job(tmp_path):
    """Factory: ``tiny_job(records, **sections)`` -> JobConfig for a tiny model on those records."""
    from plait.config.loader import config_from_dict

    def make(records: list[dict], val_records: list[dict] | None = None, **sections):
        train = write_jsonl(tmp_path / "train.jsonl", records)
        val = write_jsonl(tmp_path / "val.jsonl", val_records) if val_records else None
        return config_from_dict(tiny_config_dict(str(train), str(val) if val else None,
                                                 str(tmp_path / "run"), **sections))

    return make


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is faster than two on a shared, oversubscribed machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
