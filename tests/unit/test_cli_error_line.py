"""``plait.cli``'s error line under torchrun: each rank writes its whole line, newline included, in one write, so
the ranks' lines on a shared unbuffered stderr (``PYTHONUNBUFFERED``) never run into each other (``print`` writes
the text and the newline separately); an error every rank raises alike is printed by the first rank to reach it,
agreed through torchrun's agent store, each rank returning once every rank has reached it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from plait.cli import _report_error
from tests.helpers.jobs import ROOT


class _Recorder:
    """A stderr that keeps each ``write`` call."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_each_rank_writes_its_error_line_in_one_write(monkeypatch):
    stream = _Recorder()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _report_error(ValueError("stage 1 has no input"))
    shared = ValueError("train.lr must be > 0")
    shared.same_on_every_rank = True
    _report_error(shared)  # rank 1: rank 0 prints it
    monkeypatch.setenv("RANK", "0")
    _report_error(shared)
    assert stream.writes == ["plait: error (rank 1 of 2): stage 1 has no input\n", "plait: error: train.lr must be > 0\n"]


def test_two_unbuffered_processes_never_glue_their_lines():
    """Two processes report 3000 errors each into one pipe, unbuffered, starting at the same instant: every line of
    the output is one whole error line (with ``print``, some 100-1000 lines of such a run were glued)."""
    script = ("import os, sys, time; from plait.cli import _report_error; os.environ['WORLD_SIZE'] = '2'; "
              "os.environ['RANK'] = sys.argv[1]; start = float(sys.argv[2])\n"
              "while time.time() < start: pass\n"
              "for _ in range(3000): _report_error(ValueError('x' * 50))")
    start = time.time() + 1.5  # both interpreters are up by then
    read_end, write_end = os.pipe()
    env = {"PYTHONUNBUFFERED": "1", "PATH": os.environ.get("PATH", "")}
    procs = []
    try:
        for rank in (0, 1):
            procs.append(subprocess.Popen([sys.executable, "-c", script, str(rank), str(start)], stderr=write_end,
                                          cwd=ROOT, env=env))
        os.close(write_end)
        write_end = -1
        with os.fdopen(read_end) as pipe:
            lines = pipe.read().splitlines()
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        if write_end >= 0:
            os.close(write_end)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0] and len(lines) == 6000 and set(lines) == {f"plait: error (rank {r} of 2): {'x' * 50}" for r in (0, 1)}


def test_the_first_rank_to_reach_an_error_every_rank_raises_prints_it_once_all_have(monkeypatch):
    """torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``) hosted here, two ranks as threads: the first to call
    :func:`plait.train.job_file.first_to_report` prints (rank 1 here: letting rank 0 print alone lost the line when
    torchrun stopped rank 0 as rank 1 exited), and it returns only after the other rank reached the error too;
    without a store to agree through (another launcher), None: rank 0 prints."""
    import datetime
    import threading

    import torch.distributed as dist

    from plait.train.job_file import first_to_report
    from tests.distributed.spawning import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    events, results = [], {}

    def rank(name: str) -> None:
        events.append(f"{name} reaches the error")
        results[name] = first_to_report(2, wait_s=20)
        events.append(f"{name} returns")

    first = threading.Thread(target=rank, args=("rank 1",))
    first.start()
    while int(store.add("plait/same_error/0", 0)) < 1:  # rank 1 has reported and waits
        time.sleep(0.01)
    assert events == ["rank 1 reaches the error"]
    rank("rank 0")
    first.join(30)
    assert results == {"rank 1": True, "rank 0": False}
    assert events[:2] == ["rank 1 reaches the error", "rank 0 reaches the error"]
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    monkeypatch.delenv("MASTER_PORT")
    assert first_to_report(2) is None  # a launcher without a store address
