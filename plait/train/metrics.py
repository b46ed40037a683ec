"""Training metrics: JSONL (always), TensorBoard (when installed), Weights & Biases (when enabled), read back
for plots; progress on rank 0.

Every JSONL row gets ``time`` (ISO 8601, UTC, when it was written) and ``elapsed_s`` (seconds since the run
started; a resumed run continues from the ``elapsed_s`` of the last row it keeps, so the clock spans the whole run
without the time the run was stopped).

Energy, where it can be measured (:func:`detect_energy_meter`): every row gets ``energy_j``, the joules
used since the previous row (the steps or the validation that row reports), and ``energy_source``; training rows
also ``energy_per_step_j``. On a CUDA job, rank 0 measures every GPU visible to it through zeus's ``ZeusMonitor``
(NVML; ``pip install -e ".[energy]"``): with torchrun on one node, every GPU of the node. On CPU, the host's CPU
packages through the RAPL counters of ``/sys/class/powercap/intel-rapl:N/energy_uj`` where they are readable (the
package zones; DRAM is not counted). Elsewhere the fields are absent: never invented.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any


__all__ = ["EnergyMeter", "MetricsWriter", "NvmlEnergyMeter", "RAPL_ROOT", "RaplEnergyMeter",
           "detect_energy_meter", "import_wandb", "read_metrics"]

log = logging.getLogger(__name__)


def import_wandb() -> Any:
    """The ``wandb`` module, for ``metrics.wandb = true``.

    Raises:
        ValueError: when the ``wandb`` package is not installed, saying how to install it or turn it off.
    """
    try:
        return importlib.import_module("wandb")
    except ImportError as exc:
        raise ValueError("metrics.wandb = true but the wandb package is not installed: pip install -e \".[wandb]\" "
                         "(or pip install wandb), or set metrics.wandb = false") from exc


class MetricsWriter:
    """Appends one JSON object per line to ``<run_dir>/metrics.jsonl`` (rank 0 only), each with ``time`` and
    ``elapsed_s`` (module docstring); numeric fields also go to TensorBoard and Weights & Biases when on.

    On resume from step ``k`` the lines of steps after ``k`` (written by the interrupted run) are removed, so
    the file describes one consistent run; a run folder without ``metrics.jsonl`` gets a new, empty one (with a
    warning), which the resumed run's rows then fill.

    Args:
        run_dir: the run's folder.
        enabled: write anything (False on ranks other than 0).
        tensorboard: also write TensorBoard events to ``<run_dir>/tensorboard`` when ``torch.utils.tensorboard``
            imports (``pip install -e ".[tensorboard]"``).
        resume_step: the step a resumed run continues from (None: a fresh run, which starts an empty file).
        wandb: also log to Weights & Biases (``metrics.wandb``).
        wandb_project: its project (``metrics.wandb_project``; empty: wandb's default).
        config: the job as a plain dict, given to ``wandb.init`` as the run's config.
        energy: the energy meter of the rows' ``energy_j`` fields (module docstring; None: no energy fields).

    Raises:
        ValueError: when ``wandb`` is on and the package is not installed (:func:`import_wandb`).
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None, *, wandb: bool = False, wandb_project: str = "",
                 config: dict[str, Any] | None = None, energy: EnergyMeter | None = None):
        self.enabled = enabled
        self._energy = energy if enabled else None
        self._energy_mark = self._energy.read_j() if self._energy is not None else 0.0
        self._energy_step = resume_step or 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        self._start = time.monotonic()
        self._elapsed_before = 0.0
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._elapsed_before = max((float(r.get("elapsed_s", 0.0)) for r in kept), default=0.0)
        else:  # resuming a run whose metrics.jsonl is gone: start it again (rows from the resumed step on)
            log.warning("%s does not exist: resuming at step %d with a new one (it holds the rows from then on)",
                        self.path, resume_step)
            self.path.write_text("")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                log.info("TensorBoard not available (pip install -e \".[tensorboard]\"); metrics go to %s only",
                         self.path)
        if wandb:
            module = import_wandb()
            module.init(project=wandb_project or None, name=Path(run_dir).name, dir=str(run_dir),
                        config=config or {})
            self._wandb = module

    def destinations(self) -> list[str]:
        """Where the rows go, for people: ``["metrics.jsonl", "TensorBoard (tensorboard/)", "Weights & Biases"]``
        (those that are on)."""
        return (["metrics.jsonl"] + (["TensorBoard (tensorboard/)"] if self._tb is not None else [])
                + (["Weights & Biases"] if self._wandb is not None else []))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``) with ``time`` and ``elapsed_s`` added; numeric fields also go to
        TensorBoard and Weights & Biases (nested dicts as ``a/b`` names)."""
        if not self.enabled:
            return
        now = datetime.datetime.now(datetime.timezone.utc)
        record = {**record, **self._energy_fields(record),
                  "time": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "elapsed_s": round(self._elapsed_before + time.monotonic() - self._start, 3)}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in _flatten(record).items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def _energy_fields(self, record: dict[str, Any]) -> dict[str, Any]:
        """``energy_j`` since the previous row, ``energy_source``, and on a training row (no ``eval``)
        ``energy_per_step_j`` over the steps since the previous training row; ``{}`` without a meter."""
        if self._energy is None:
            return {}
        now = self._energy.read_j()
        used, self._energy_mark = now - self._energy_mark, now
        out: dict[str, Any] = {"energy_j": round(used, 6), "energy_source": self._energy.source}
        if "eval" not in record:
            steps = int(record["step"]) - self._energy_step
            if steps > 0:
                out["energy_per_step_j"] = round(used / steps, 6)
            self._energy_step = int(record["step"])
        return out

    def close(self) -> None:
        """Flush and close TensorBoard and Weights & Biases."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


RAPL_ROOT = Path("/sys/class/powercap")
"""Where Linux exposes the RAPL energy counters (``intel-rapl:N`` package zones)."""

_PACKAGE_ZONE = re.compile(r"^intel-rapl:\d+$")


class EnergyMeter:
    """A cumulative energy counter: :meth:`read_j` is the joules used since the meter was made; ``source`` names
    what it measures (for the metrics rows)."""

    source = "none"

    def read_j(self) -> float:
        """Joules used since the meter was made."""
        raise NotImplementedError


class RaplEnergyMeter(EnergyMeter):
    """The host's CPU packages through RAPL: the sum over the package zones ``<root>/intel-rapl:N`` of their
    ``energy_uj`` counters (microjoules), each wrapping at its ``max_energy_range_uj`` back to 0. A reading that
    is below the previous one wrapped once: the step is ``now + range - previous`` (read more often than a wrap
    period: minutes at hundreds of watts).

    Args:
        zones: the package zone folders (each with ``energy_uj`` and ``max_energy_range_uj``).

    Raises:
        ValueError: when there is no zone.
        OSError: when a counter cannot be read.
    """

    def __init__(self, zones: list[Path]) -> None:
        if not zones:
            raise ValueError("RaplEnergyMeter needs at least one intel-rapl package zone")
        self.zones = zones
        self.ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self.last = [int((z / "energy_uj").read_text()) for z in zones]
        self.total_uj = 0
        self.source = f"rapl ({len(zones)} CPU package{'s' if len(zones) > 1 else ''})"

    @classmethod
    def find(cls, root: str | Path = RAPL_ROOT) -> RaplEnergyMeter | None:
        """The meter of every readable package zone under ``root``; None when there is none (no RAPL, or its
        counters are readable by root only)."""
        root = Path(root)
        zones = sorted(p for p in root.glob("intel-rapl:*") if _PACKAGE_ZONE.match(p.name)) if root.is_dir() else []
        try:
            return cls(zones) if zones else None
        except (OSError, ValueError):
            return None

    def read_j(self) -> float:
        """Joules used by the packages since the meter was made (wrap-around handled)."""
        for i, zone in enumerate(self.zones):
            now = int((zone / "energy_uj").read_text())
            step = now - self.last[i] if now >= self.last[i] else now + self.ranges[i] - self.last[i]
            self.total_uj += step
            self.last[i] = now
        return self.total_uj / 1e6


class NvmlEnergyMeter(EnergyMeter):
    """The GPUs' energy through zeus's ``ZeusMonitor`` (NVML ``nvmlDeviceGetTotalEnergyConsumption``; short
    windows approximated by instant power x time, ``approx_instant_energy``): one measurement window per reading,
    summed.

    Args:
        gpu_indices: the GPUs (zeus/CUDA indices); None: every visible GPU.
        monitor: a ``ZeusMonitor`` (tests pass a fake); default: built here.

    Raises:
        ImportError: when zeus is not installed.
    """

    _WINDOW = "plait_metrics_energy"

    def __init__(self, gpu_indices: list[int] | None = None, monitor: Any = None) -> None:
        if monitor is None:
            from zeus.monitor import ZeusMonitor

            monitor = ZeusMonitor(gpu_indices=gpu_indices, cpu_indices=[], approx_instant_energy=True)
        self.monitor = monitor
        self.total_j = 0.0
        self.source = f"nvml ({len(monitor.gpu_indices)} GPU{'s' if len(monitor.gpu_indices) != 1 else ''})"
        self.monitor.begin_window(self._WINDOW)

    def read_j(self) -> float:
        """Joules used by the GPUs since the meter was made (synchronises them)."""
        measurement = self.monitor.end_window(self._WINDOW)
        self.total_j += sum(measurement.gpu_energy.values())
        self.monitor.begin_window(self._WINDOW)
        return self.total_j


def detect_energy_meter(device_type: str, rapl_root: str | Path = RAPL_ROOT) -> EnergyMeter | None:
    """The energy meter of a job on ``device_type`` (module docstring): NVML through zeus on ``"cuda"`` (None,
    with a log line, when zeus is not installed or fails), RAPL on other devices where readable, else None."""
    if device_type == "cuda":
        try:
            return NvmlEnergyMeter()
        except Exception as exc:  # no zeus, or NVML failing to initialise
            log.info("no GPU energy in the metrics (%s: %s); pip install -e \".[energy]\"", type(exc).__name__, exc)
            return None
    return RaplEnergyMeter.find(rapl_root)


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
