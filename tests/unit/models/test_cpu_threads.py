"""The CPU thread rule of training and generation: what is set wins, then OMP_NUM_THREADS (torchrun's 1 per worker),
then this process's share of the cores no other work keeps busy."""

from __future__ import annotations

import os

import pytest

from plait.models.device import choose_cpu_threads
from tests.helpers.cli import cli_rank, plait_on_ranks


@pytest.mark.parametrize("requested, omp, cores, load, local, want", [
    (3, None, 2, 5.0, 1, 3),      # as set, even beyond the cores
    (0, "1", 16, 0.0, 8, 1),      # torchrun's OMP_NUM_THREADS=1 per worker
    (0, "4", 16, 0.0, 1, 4),
    (0, None, 2, 0.1, 1, 2),      # an idle 2-core host: both cores
    (0, None, 2, 1.0, 1, 1),      # one other busy process: one thread, not two fighting for one core
    (0, None, 2, 7.5, 1, 1),      # overloaded: still one
    (0, None, 16, 0.0, 4, 4),     # 4 processes of the job share 16 idle cores
    (0, None, 16, 8.0, 4, 2),     # half the cores busy with other work
    (0, None, 16, 0.0, 32, 1),    # more processes than cores
])
def test_thread_choice(requested, omp, cores, load, local, want):
    threads, why = choose_cpu_threads(requested, omp, cores, load, local)
    assert threads == want
    assert why == ("as set" if requested else "OMP_NUM_THREADS" if omp else why)
    if not requested and not omp:
        assert why.startswith(f"auto: {cores} cores, load {load:.1f}")


@pytest.mark.parametrize("args, match", [((-1, None, 2, 0.0, 1), "threads must be >= 0"),
                                         ((0, "x", 2, 0.0, 1), "OMP_NUM_THREADS='x'"),
                                         ((0, "0", 2, 0.0, 1), "OMP_NUM_THREADS='0'"),
                                         ((0, None, 2, 0.0, 0), "processes >= 1")])
def test_bad_thread_inputs_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        choose_cpu_threads(*args)


def unset_thread_variables_rank(logs: str, *argv: str) -> None:
    """``plait <argv>`` (``cli.cli_rank``) without ``OMP_NUM_THREADS`` and ``LOCAL_WORLD_SIZE`` (as a command typed
    outside torchrun starts; a forked rank of ``spawning.run_main`` gets ``OMP_NUM_THREADS=1``)."""
    for name in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    cli_rank(logs, *argv)


def test_the_real_command_logs_its_choice(tmp_path):
    # `python -m plait.cli generate ...`, forked from the session's fork server (no interpreter start and imports)
    out = plait_on_ranks(1, "generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", limit_s=120,
                         entry="tests.unit.models.test_cpu_threads:unset_thread_variables_rank")
    assert out.returncode == 2
    line = next(x for x in out.stderr.splitlines() if "CPU intra-op threads" in x)
    threads = int(line.split("CPU intra-op threads: ")[1].split()[0])
    assert 1 <= threads <= len(os.sched_getaffinity(0)) and "set --threads to choose" in line


def test_host_cpu_threads_reads_this_hosts_environment(monkeypatch):
    """The rule on this host, as ``plait launch`` plans with it for its workers (one rule, not a twin)."""
    from plait.models.device import host_cpu_threads

    assert host_cpu_threads(3, 8) == (3, "as set")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert host_cpu_threads(0, 8)[0] == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    assert host_cpu_threads(0, 4)[0] == 4  # 16 idle cores over 4 processes
