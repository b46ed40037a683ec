"""One progress rule: a bar on a terminal wide enough for one, plain lines (first, every interval, last; no carriage
returns) in a log file, a pipe, or a terminal that reports 0 columns."""

from __future__ import annotations

import fcntl
import os
import struct
import termios

import pytest

from plait.data.progress import Progress, is_interactive


def pty_stream(columns: int):
    """The child side of a pseudo-terminal reporting ``columns`` columns, as a text stream."""
    parent, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return os.fdopen(parent, "rb", buffering=0), os.fdopen(child, "w")


@pytest.mark.parametrize("columns, bar", [(0, False), (20, False), (80, True)])
def test_a_terminal_gets_a_bar_only_when_wide_enough(columns, bar):
    parent, stream = pty_stream(columns)
    with parent, stream:
        assert stream.isatty()
        assert is_interactive(stream) is bar


def test_a_log_gets_plain_lines_first_every_interval_and_last(capsys):
    bar = Progress(5, "metadata train.jsonl", "record", interval=3600)
    for _ in range(5):
        bar.update(1, **{"tokens/s": "12"})
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == ["metadata train.jsonl: record 1/5, tokens/s 12",
                                "metadata train.jsonl: record 5/5, tokens/s 12"]


def test_interval_zero_reports_every_update_and_disabled_reports_nothing(capsys):
    bar = Progress(3, "generate", "prompt", interval=0)
    bar.update(2)
    bar.update(1)
    Progress(3, "quiet", enabled=False).update(3)
    assert capsys.readouterr().err.splitlines() == ["generate: prompt 2/3", "generate: prompt 3/3"]


def test_a_resumed_run_counts_from_its_step(capsys):
    bar = Progress(10, "train", "step", initial=7, interval=3600)
    bar.update(1, loss="0.412")
    bar.write("step 8: validation exact match 50.0%")
    captured = capsys.readouterr()
    assert captured.err == "train: step 8/10, loss 0.412\n"
    assert captured.out == "step 8: validation exact match 50.0%\n"
