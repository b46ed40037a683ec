"""plait generate --threads N sets torch's intra-op threads before the model loads; without it they are chosen from
the host's free cores (``plait.models.device.choose_cpu_threads``), not torch's one per core."""

import pytest
import torch

from plait.cli import main
from plait.commands.generate import generate_command


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_threads_are_set_before_the_model_loads(tmp_path, restore_threads):
    target = 1 if restore_threads != 1 else 2
    with pytest.raises(FileNotFoundError):
        generate_command(tmp_path / "missing", prompt="hi", threads=target)
    assert torch.get_num_threads() == target


def test_cli_passes_threads(tmp_path, restore_threads):
    target = 1 if restore_threads != 1 else 2
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--threads", str(target)]) != 0
    assert torch.get_num_threads() == target


@pytest.mark.parametrize("threads", [None, 0])  # 0 means "choose", as train.threads = 0
def test_default_takes_the_free_cores_not_torchs_one_per_core(tmp_path, restore_threads, monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr("os.getloadavg", lambda: (2.0, 0.0, 0.0))  # two other busy processes
    with pytest.raises(FileNotFoundError):
        generate_command(tmp_path / "missing", prompt="hi", threads=threads)
    assert torch.get_num_threads() == 2  # 4 - 2 = 2 free cores


def test_negative_threads_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^--threads must be >= 0 \(0: chosen from this host's free cores\), got -1$"):
        generate_command(tmp_path / "missing", prompt="hi", threads=-1)
