"""Per-action GPU frequencies in the pipeline runtime (Perseus, Chung et al., SOSP 2024).

A frequency plan (:class:`plait.planner.energy.types.EnergyPlan`, written by ``plait energy``) gives every ``F``/``B``
/``W`` action of every pipeline rank an SM clock. With ``[energy] plan = "path"`` the executor
(:mod:`plait.parallel.pipeline.executor`) calls this rank's :class:`FrequencyController` before each action:

- on a CUDA device, :class:`NvmlFrequencyController` locks the SM clock through zeus's device layer
  (``zeus.device.get_gpus().set_gpu_locked_clocks``, NVML underneath), only when the frequency changes. Locking
  clocks needs ``SYS_ADMIN`` (or a zeus daemon); where it is refused, or zeus is not installed
  (``pip install -e ".[energy]"``), one warning says so and the controller records only;
- on CPU, :class:`FrequencyController` records the would-be frequency, so the path runs and is tested everywhere.

Either way the frequency is written into the action's measured :class:`~plait.planner.pipeline.types.TimelineEvent`
(``frequency_mhz``), and setting it changes nothing of the numerics (the same losses and parameters bit for bit).

Straggler reaction (item 4): after each step :class:`StragglerReaction` exchanges every rank's step time (one
``all_gather`` of a float over the job) and moves this replica to the frontier point the pure policy
:mod:`plait.planner.resilience.straggler` chooses (hysteresis stated there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.config.schema import EnergyConfig
from plait.planner.energy.types import EnergyPlan, FrontierPoint, action_label
from plait.planner.resilience.straggler import react_to_stragglers, replica_point
from plait.planner.resilience.types import StragglerPolicy, StragglerState
from plait.planner.pipeline.types import TimelineEvent

__all__ = ["EnergyRuntime", "FrequencyController", "NvmlFrequencyController", "StragglerReaction",
           "build_energy_runtime", "build_frequency_controller", "import_zeus_gpus", "read_energy_plan",
           "step_span_s"]

log = logging.getLogger(__name__)


def read_energy_plan(path: str | Path) -> EnergyPlan:
    """The frequency plan in the JSON file ``path`` (``EnergyPlan.to_json``).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: naming ``path`` when it is not a valid plan or has no frontier point.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"energy.plan: {path} does not exist (write one with `plait energy`)")
    try:
        plan = EnergyPlan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"energy.plan: {path} is not a frequency plan: {exc}") from exc
    if not plan.points:
        raise ValueError(f"energy.plan: {path} has no frontier point")
    return plan


class FrequencyController:
    """Sets (here: records) the SM frequency of each action of one pipeline rank from a frequency plan.

    The controller runs one frontier point at a time (initially the fastest, ``T*``: intrinsic bloat removed, no
    slowdown); :meth:`use_point` switches it (straggler reaction). :meth:`before` is called by the executor before
    each action and returns the frequency (MHz) the action runs at; ``records`` keeps ``(label, MHz)`` per call.

    Args:
        plan: the frequency plan.
        rank: this process's pipeline rank (the plan's ``ActionFrequency.rank``).

    Raises:
        ValueError: when the plan has no point or ``rank < 0``.
    """

    applies = False
    """Whether :meth:`_apply` changes a real clock (False: recording only)."""

    def __init__(self, plan: EnergyPlan, rank: int) -> None:
        if not plan.points or rank < 0:
            raise ValueError(f"FrequencyController needs a plan with points and a rank >= 0, got "
                             f"{len(plan.points)} points, rank {rank}")
        self.plan, self.rank = plan, rank
        self.point: FrontierPoint = plan.points[0]
        self.current_mhz = 0
        self.records: list[tuple[str, int]] = []

    def use_point(self, point: FrontierPoint) -> None:
        """Run the following actions at ``point``'s frequencies."""
        self.point = point

    def before(self, kind: str, stage: int, microbatch: int) -> int:
        """Set the frequency of the action about to run (``kind`` F/B/W of ``stage`` on ``microbatch``); returns it
        (MHz). The clock is changed only when it differs from the current one."""
        label = action_label(kind, stage, microbatch)
        if not self.plan.plans_action(self.rank, label):
            raise ValueError(f"the energy plan ([energy] plan) was made for another layout: it has no action "
                             f"{label!r} on rank {self.rank}, which this job runs (plan {len(self.plan.schedule)} "
                             "actions); make it for this job with plait energy --config <this job>")
        mhz = self.plan.frequency_of(self.point, self.rank, label)
        if mhz != self.current_mhz:
            self._apply(mhz)
            self.current_mhz = mhz
        self.records.append((label, mhz))
        return mhz

    def _apply(self, mhz: int) -> None:
        """Change the clock to ``mhz`` (nothing: this controller records)."""

    def close(self) -> None:
        """Give the clock back (nothing to give back when recording)."""


def import_zeus_gpus() -> Any:
    """zeus's GPU collection (``zeus.device.get_gpus()``), or None with a warning when zeus is not installed
    (``pip install -e ".[energy]"``) or finds no GPU."""
    try:
        from zeus.device import get_gpus
        return get_gpus()
    except Exception as exc:  # ImportError, or NVML failing to initialise
        log.warning("zeus GPU control unavailable (%s: %s); pip install -e \".[energy]\"", type(exc).__name__, exc)
        return None


class NvmlFrequencyController(FrequencyController):
    """:class:`FrequencyController` that locks the SM clock of GPU ``gpu_index`` through zeus (NVML) before each
    action whose frequency differs from the current one (module docstring), and resets it on :meth:`close`.

    Where locking is refused (no ``SYS_ADMIN``, no zeus, no GPU) it warns once, naming the reason, and records
    only (``applies`` becomes False).

    Args:
        plan, rank: as :class:`FrequencyController`.
        gpu_index: the GPU (zeus index among the visible GPUs).
        gpus: zeus's GPU collection (default: :func:`import_zeus_gpus`; tests pass a fake).
    """

    def __init__(self, plan: EnergyPlan, rank: int, gpu_index: int, gpus: Any = None) -> None:
        super().__init__(plan, rank)
        self.gpu_index = gpu_index
        self.gpus = gpus if gpus is not None else import_zeus_gpus()
        self.applies = self.gpus is not None
        if not self.applies:
            log.warning("energy.plan: cannot control GPU %d's clock; recording the planned frequencies only",
                        gpu_index)

    def _apply(self, mhz: int) -> None:
        if not self.applies:
            return
        try:
            self.gpus.set_gpu_locked_clocks(self.gpu_index, mhz, mhz)
        except Exception as exc:  # zeus's ZeusGPUNoPermissionError and friends
            self.applies = False
            log.warning("energy.plan: locking GPU %d's SM clock at %d MHz was refused (%s: %s); this needs "
                        "SYS_ADMIN (see https://ml.energy/zeus/getting_started/#system-privileges). Recording the "
                        "planned frequencies only", self.gpu_index, mhz, type(exc).__name__, exc)

    def close(self) -> None:
        """Reset the GPU's locked clocks (when any was set)."""
        if self.applies and self.current_mhz:
            try:
                self.gpus.reset_gpu_locked_clocks(self.gpu_index)
            except Exception as exc:
                log.warning("energy.plan: resetting GPU %d's clocks failed: %s", self.gpu_index, exc)
        self.current_mhz = 0


def build_frequency_controller(plan: EnergyPlan, rank: int, device: torch.device) -> FrequencyController:
    """The controller for pipeline rank ``rank`` on ``device``: :class:`NvmlFrequencyController` on a CUDA device
    (its index; recording only where clocks cannot be locked), the recording :class:`FrequencyController` else."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return NvmlFrequencyController(plan, rank, index)
    return FrequencyController(plan, rank)


def step_span_s(events: Sequence[TimelineEvent]) -> float:
    """Seconds from the first action's start to the last action's end of one rank's step (0 without events)."""
    if not events:
        return 0.0
    return max(e.end_s for e in events) - min(e.start_s for e in events)


class StragglerReaction:
    """Reacts to a slow DP replica (module docstring): each step, every rank's step time over the predicted
    iteration time of its current point goes to every rank (``all_gather`` of one float per rank over the default
    group: all ranks then decide alike), a replica's time is the largest of its ranks', and
    :func:`~plait.planner.resilience.straggler.react_to_stragglers` updates the state; the controller runs
    :func:`~plait.planner.resilience.straggler.replica_point` of it.

    Args:
        controller: this rank's frequency controller (its plan and point).
        policy: the hysteresis (``[energy]`` ``slow_ratio``, ``recover_ratio``, ``patience``).
        dp_rank, dp_size: this rank's DP replica and the number of replicas.
        device: where the exchanged tensor lives (CPU for gloo, CUDA for NCCL).

    Attributes:
        state: the current :class:`~plait.planner.resilience.types.StragglerState`.
        history: per observed step, ``(state.straggler, frequency point time in seconds)``.
    """

    def __init__(self, controller: FrequencyController, policy: StragglerPolicy, dp_rank: int, dp_size: int,
                 device: torch.device) -> None:
        self.controller, self.policy, self.dp_rank, self.dp_size = controller, policy, dp_rank, dp_size
        self.device = device
        self.state = StragglerState()
        self.history: list[tuple[int, float]] = []

    def observe(self, step_time_s: float) -> FrontierPoint:
        """After a step that took ``step_time_s`` on this rank (its actions' span, :func:`step_span_s`): exchange,
        update the state and switch the controller's point. Collective over the default group when distributed.
        Returns the point the next step runs."""
        planned = max(self.controller.point.iteration_time_s, 1e-12)
        relative = self._replica_times(max(step_time_s, 1e-9) / planned)
        self.state = react_to_stragglers(self.policy, self.state, relative)
        point = replica_point(self.controller.plan, self.state, self.dp_rank)
        self.controller.use_point(point)
        self.history.append((self.state.straggler, point.iteration_time_s))
        return point

    def _replica_times(self, mine: float) -> list[float]:
        """Every DP replica's relative time (the largest of its ranks'), from one all_gather."""
        if not (dist.is_available() and dist.is_initialized()) or self.dp_size == 1:
            return [mine] * self.dp_size
        row = torch.tensor([float(self.dp_rank), mine], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        times = [0.0] * self.dp_size
        for r in rows:
            d = int(r[0])
            times[d] = max(times[d], float(r[1]))
        return times


@dataclass
class EnergyRuntime:
    """What a pipeline rank runs for ``[energy]``: its frequency controller (passed to ``run_pipeline_step``) and
    the straggler reaction (None when ``energy.straggler`` is false)."""

    controller: FrequencyController
    reaction: StragglerReaction | None = None

    def after_step(self, events: Sequence[TimelineEvent]) -> None:
        """After a step whose actions on this rank are ``events``: the straggler reaction (collective over the
        job when on)."""
        if self.reaction is not None:
            self.reaction.observe(step_span_s(events))

    def close(self) -> None:
        """Give the GPU clock back."""
        self.controller.close()


def build_energy_runtime(cfg: EnergyConfig, pp_rank: int, dp_rank: int, dp_size: int,
                         device: torch.device) -> EnergyRuntime | None:
    """The :class:`EnergyRuntime` of ``[energy]`` for this rank (None when ``cfg.plan`` is empty): the plan read
    from ``cfg.plan``, this device's controller, and the straggler reaction with ``cfg``'s hysteresis.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_energy_plan`, or for bad hysteresis values.
    """
    if not cfg.plan:
        return None
    controller = build_frequency_controller(read_energy_plan(cfg.plan), pp_rank, device)
    if not cfg.straggler:
        return EnergyRuntime(controller)
    policy = StragglerPolicy(cfg.slow_ratio, cfg.recover_ratio, cfg.patience)
    return EnergyRuntime(controller, StragglerReaction(controller, policy, dp_rank, dp_size, device))
