"""``plait profile``: measure the per-unit costs of a job's model on this machine, stored and reused by key.

:func:`profile_command` loads the job and profiles it with ``plait.measure.job_profile.profile_job`` (reusing a
stored profile whose key matches), prints the profile as a table, and with ``--energy [--clocks N]`` also sweeps
N SM clocks of the GPU (``plait.measure.job_profile.energy_profile_job``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from plait.config.loader import load_config
from plait.measure.job_profile import energy_profile_job, profile_job
from plait.planner.cost.measured_profile import Profile
from plait.planner.report import format_profile

__all__ = ["profile_command"]


def profile_command(config: str | Path, overrides: Sequence[str] = (), *, store: str | Path = "runs/profiles",
                    out_path: str | Path | None = None, microbatches: int = 1, microbatch_size: int | None = None,
                    repeats: int = 5, warmup: int = 2, clock: str = "wall", force: bool = False,
                    energy: bool = False, clocks: int = 5) -> Profile:
    """``plait profile``: profile the job in ``config`` (with its ``--section.key=value`` overrides) by
    :func:`profile_job` and print the profile as a table (``plait.planner.report.format_profile``); with
    ``energy``, then the GPU energy sweep over ``clocks`` SM clocks (:func:`energy_profile_job`).

    Raises:
        ValueError, FileNotFoundError: as ``load_config`` and :func:`profile_job`.
    """
    cfg = load_config(config, overrides)
    profile = profile_job(cfg, store_dir=store, out_path=out_path, microbatches=microbatches,
                          microbatch_size=microbatch_size, repeats=repeats, warmup=warmup, clock=clock, force=force)
    print(format_profile(profile))
    if energy:
        energy_profile_job(cfg, store_dir=store, clocks=clocks, microbatches=microbatches,
                           microbatch_size=microbatch_size, repeats=repeats, warmup=warmup, force=force)
    return profile
