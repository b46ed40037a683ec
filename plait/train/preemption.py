"""A checkpoint instead of lost steps when a run is stopped: SIGTERM (a cluster's notice before preemption, also
what ``torchrun`` sends its workers when it is stopped) and SIGINT (Ctrl-C) during :meth:`Trainer.fit` let the
current step finish, then every rank agrees on the stop at the same step boundary, writes a checkpoint and leaves
the loop; ``--resume`` continues exactly from there. A second Ctrl-C stops at once (``KeyboardInterrupt``), as
torchtitan and Lightning do."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from plait.parallel.process_group import DistInfo, max_over_ranks

__all__ = ["StopSignals", "exit_code"]

log = logging.getLogger(__name__)


class StopSignals:
    """Context manager catching SIGTERM and SIGINT while it is active (in the main thread only; elsewhere it does
    nothing), restoring the previous handlers on exit; ``then`` says what happens before the stop. :meth:`agreed` is
    the stop every rank acts on."""

    CAUGHT = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, then: str = "finishing this step, then writing a checkpoint and stopping") -> None:
        self.signum, self.then = 0, then
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.CAUGHT:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without the checkpoint
        if not self.signum:
            self.signum = signum
            log.warning("%s received: %s (Ctrl-C again stops at once)", signal.Signals(signum).name, self.then)

    def agreed(self, info: DistInfo) -> int:
        """The signal any rank caught so far (0 for none): the same value on every rank (a collective in a job of
        several processes: call it at the same step boundary everywhere)."""
        return max_over_ranks(self.signum, info)


def exit_code(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 128 + its number, as a shell reports a process the signal
    ended (130 for SIGINT, 143 for SIGTERM), so a scheduler sees the run did not finish."""
    return 128 + signum
