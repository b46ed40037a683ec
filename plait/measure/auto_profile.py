"""The profile ``parallel.plan = "auto"`` plans with, measured on demand: rank 0 profiles the model alone
(reusing a stored profile whose key matches) while the other ranks wait, and every rank receives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.config.schema import JobConfig
from plait.measure.job_profile import profile_job
from plait.parallel.process_group import DistInfo, broadcast_from_main
from plait.planner.cost.measured_profile import Profile

__all__ = ["PROFILE_WAIT_S", "main_rank_profile"]

PROFILE_WAIT_S = 3600.0
"""Seconds the other ranks wait for rank 0's profile under ``parallel.plan = "auto"`` (at least
``parallel.timeout_s``): measuring one takes minutes on a CPU, longer than an ordinary collective may take. A rank
that dies ends the wait at once (its connections close)."""

_SHARED_ERRORS = (ValueError, FileNotFoundError)
"""Rank 0's profiling errors every rank raises alike (bad data, too few samples, a missing file)."""


def main_rank_profile(cfg: JobConfig, store: str | Path, info: DistInfo) -> Profile:
    """Rank 0's ``profile_job`` of the job, on every rank. Rank 0 builds the profile's model and data alone (its
    metadata pass enters no collective: ``build_profile_inputs``); the others wait for the result
    (``broadcast_from_main``) for :data:`PROFILE_WAIT_S`, not ``parallel.timeout_s``.

    Raises:
        ValueError, FileNotFoundError: rank 0's (e.g. too few usable samples to profile), on every rank alike
            (marked ``same_on_every_rank``: printed once); RuntimeError on the other ranks naming any other error
            of rank 0, which raises its own.
    """
    sent: Any = None
    error: Exception | None = None
    if info.is_main:
        try:
            sent = profile_job(cfg, store_dir=store).to_dict()
        except Exception as exc:  # noqa: BLE001 - sent to the waiting ranks, then raised here
            kind = next((k.__name__ for k in _SHARED_ERRORS if isinstance(exc, k)), type(exc).__name__)
            error, sent = exc, (kind, str(exc))
    got = broadcast_from_main(sent, info, max(PROFILE_WAIT_S, cfg.parallel.timeout_s))
    if isinstance(got, dict):
        return Profile.from_dict(got)
    kind, message = got
    shared = next((k for k in _SHARED_ERRORS if k.__name__ == kind), None)
    if error is None:  # a waiting rank
        error = shared(message) if shared else RuntimeError(
            f"parallel.plan=auto: rank 0 failed to profile the model ({kind}: {message})")
    if shared:
        error.same_on_every_rank = True  # type: ignore[attr-defined]  # printed once, by rank 0 (plait.cli)
    raise error
