"""Fixtures of the parallel layer's single-process tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread is faster than two on a shared, oversubscribed machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
