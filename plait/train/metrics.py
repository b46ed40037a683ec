"""Training metrics: JSONL (always), TensorBoard (when installed), read back for plots; progress on rank 0."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line to ``<run_dir>/metrics.jsonl`` (rank 0 only).

    On resume from step ``k`` the lines of steps after ``k`` (written by the interrupted run) are removed, so
    the file describes one consistent run.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                log.info("TensorBoard not available; metrics go to %s only", self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``); numeric fields also go to TensorBoard."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class Progress:
    """Training progress on rank 0. On a terminal: a tqdm bar. Otherwise (stderr is a log file or a pipe): one
    plain line on stderr for the first and the last step and at most every ``interval`` seconds (no carriage-return
    updates piling up in the log).

    Args:
        total: the run's steps; initial: the step it starts from; enabled: show anything.
    """

    def __init__(self, total: int, initial: int, enabled: bool, interval: float = 30.0) -> None:
        self.enabled, self.total, self.initial, self.interval = enabled, total, initial, interval
        self.tty = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, disable=not self.tty, desc="train", dynamic_ncols=True)
        self.last = time.monotonic()

    def update(self, step: int, loss: float, tokens_per_s: float, last: bool = False) -> None:
        """Step ``step`` is done with this loss and throughput (tokens/s); ``last``: the loop's final step."""
        if self.tty:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            self.bar.update(1)
        elif self.enabled and (last or step == self.initial + 1 or time.monotonic() - self.last >= self.interval):
            print(f"train: step {step}/{self.total}, loss {loss:.3f}, {tokens_per_s:.0f} tokens/s", file=sys.stderr,
                  flush=True)
            self.last = time.monotonic()

    def write(self, message: str) -> None:
        """Print ``message`` on stdout without breaking the bar."""
        self.bar.write(message)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()
