"""Progress of long work (the metadata pass, training, validation, profiling, generation) on stderr, one rule for
all: a tqdm bar on an interactive terminal, and plain lines elsewhere. A log file or a pipe gets one line at the start,
at most one every ``interval`` seconds and one at the end, never tqdm's carriage-return redraws; so does a terminal
too narrow for a bar (some report 0 columns, where tqdm drew nothing for minutes)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["MIN_COLUMNS", "Progress", "is_interactive"]

MIN_COLUMNS = 40
"""Narrowest terminal (columns) that gets a bar."""


def is_interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal at least :data:`MIN_COLUMNS` wide."""
    stream = stream or sys.stderr
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns >= MIN_COLUMNS
    except (OSError, ValueError, AttributeError):  # not a real file, or no size
        return False


class Progress:
    """``total`` units of work named ``desc`` (``unit`` each) on stderr: a bar when :func:`is_interactive`, plain
    lines ``"<desc>: <unit> <done>/<total>, <key> <value>, ..."`` otherwise; nothing when ``enabled`` is False.

    Args:
        total: units of work; initial: units already done (a resumed run).
        interval: seconds between plain lines at most.
        leave: keep the bar on screen once closed.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0,
                 interval: float = 30.0, leave: bool = True) -> None:
        self.total, self.desc, self.unit, self.done, self.interval = total, desc, unit, initial, interval
        self.enabled = enabled
        self.bar_shown = enabled and is_interactive()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not self.bar_shown, leave=leave,
                        dynamic_ncols=True)
        self.last = -float("inf")

    def update(self, n: int = 1, **postfix: Any) -> None:
        """``n`` more units done; ``postfix`` (e.g. ``loss="0.412"``) shown beside the count."""
        self.done += n
        if self.bar_shown:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.enabled and (self.done >= self.total or time.monotonic() - self.last >= self.interval):
            extra = "".join(f", {k} {v}" for k, v in postfix.items())
            sys.stderr.write(f"{self.desc}: {self.unit} {self.done}/{self.total}{extra}\n")
            sys.stderr.flush()
            self.last = time.monotonic()

    def describe(self, desc: str) -> None:
        """Name the work from now on ``desc`` (a later phase of it)."""
        self.desc = desc
        self.bar.set_description(desc)

    def write(self, message: str) -> None:
        """``message`` on stdout without breaking the bar."""
        if self.bar_shown:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()
