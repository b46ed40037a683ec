"""Shared fixtures: a tiny job on a slice of the committed demo set."""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing
import os
import shutil
import sys

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


EXIT_DEADLINE_S = 120
"""Seconds the test process may take to exit after the session: past them every thread's stack is printed and the
process ends with status 1 (a hang at exit then fails CI with its cause instead of running into CI's time limit)."""


def pytest_sessionfinish(session, exitstatus):
    """Child processes a test left running, ended and named: the interpreter's exit joins its children, so one that
    ignores SIGTERM (a DataLoader worker of plait's) would hang the run after every test passed."""
    gc.collect()  # a dropped DataLoader iterator shuts its workers down when it is collected
    left = multiprocessing.active_children()
    for proc in left:
        proc.join(timeout=5)
    left = [proc for proc in left if proc.is_alive()]
    for proc in left:
        proc.kill()
        proc.join(timeout=5)
    if left:
        names = ", ".join(f"{proc.name} (pid {proc.pid})" for proc in left)
        print(f"\nconftest: {len(left)} child process(es) left running by the tests were killed: {names}",
              file=sys.stderr)


def pytest_unconfigure(config):
    faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
