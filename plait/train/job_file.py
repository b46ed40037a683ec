"""Reading a command's job file, with nothing heavy imported: ``plait.cli`` reads the job of every verb that takes
``--config`` through :func:`check_job` before the verb's module (torch, transformers, the trainer: seconds of
imports) is loaded, so a misspelt key, a wrong type or value, or a missing file is reported at once.

- :func:`check_job`: read and validate a job file as the verb will, errors marked as every rank's alike.
- :func:`load_config_for_planning`: the job ``plait plan`` and ``plait energy`` plan for (``[parallel.pp]`` and
  ``parallel.dp`` reset: the plan replaces them).
- :func:`same_on_every_rank`: mark the errors raised inside it as ones every rank of a job raises alike.
- :func:`first_to_report`: which rank of a torchrun job prints such an error, agreed through the job's store.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from plait.config.loader import config_from_dict, load_config, read_config_data, validate
from plait.config.schema import JobConfig
from plait.train.run_lock import check_run_free

__all__ = ["check_job", "load_config_for_planning", "same_on_every_rank", "first_to_report", "REPORT_WAIT_S"]

REPORT_WAIT_S = 15.0
"""Seconds a rank that reports an error every rank raises alike waits for the others to reach it
(:func:`first_to_report`)."""


@contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Mark a ``ValueError`` or ``FileNotFoundError`` raised inside as one every rank raises alike (each rank reads
    the same files): under torchrun the command line prints it once (``plait.cli``, :func:`first_to_report`)."""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        exc.same_on_every_rank = True  # type: ignore[attr-defined]
        raise


def first_to_report(world: int, wait_s: float = REPORT_WAIT_S) -> bool | None:
    """Whether this rank of a ``world``-rank torchrun job is the first to report an error every rank raises alike
    (:func:`same_on_every_rank`): each rank adds 1 to a key of the job's store (``MASTER_ADDR:MASTER_PORT``, a key of
    this start of the job: ``TORCHELASTIC_RESTART_COUNT``) and the first prints. Every rank then waits, at most
    ``wait_s`` seconds, until all ``world`` have added: no rank exits while another still finishes a collective with
    it (the peer's closed connection would end that one in a gloo ``RuntimeError`` and its traceback), and torchrun,
    which stops every rank as soon as one exits, never stops the job before its error is printed (letting rank 0
    print alone lost the line whenever another rank exited first).

    The store is torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), or the one rank 0 hosts once the process
    group is joined. Returns None without one (another launcher, or before joining without the agent store): the
    caller then lets rank 0 print. Imports ``torch.distributed`` (an error path only).
    """
    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized()
    if not (joined or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True") or "MASTER_PORT" not in os.environ:
        return None
    key = f"plait/same_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=datetime.timedelta(seconds=wait_s))
        first = store.add(key, 1) == 1
    except (RuntimeError, OSError, ValueError):  # no store to reach
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if store.add(key, 0) >= world:
                break
        except (RuntimeError, OSError):  # the store's host is gone
            break
        time.sleep(0.05)
    return first


def check_job(config: str | Path, overrides: Sequence[str], *, planning: bool = False,
              run_folder: bool = False) -> None:
    """Read and validate the job file ``config`` with its ``--section.key=value`` overrides as the verb will:
    ``plait.config.loader.load_config``, or :func:`load_config_for_planning` when ``planning`` (``plait plan``,
    ``plait energy``). With ``run_folder`` (``plait train``, ``plait launch``'s launcher: not its workers, whose
    launcher holds the lock) a ``metrics.run_dir`` another live run is writing is refused too
    (:func:`plait.train.run_lock.check_run_free`). Imports nothing beyond the config loader, the planner and the
    run lock (about 0.2 s). The loader's warnings (legal but odd values) are left to the verb's own reading, so they
    are printed once.

    Raises:
        FileNotFoundError, ValueError: as the reader (missing file, TOML syntax, unknown keys, wrong types or
            values, named by dotted key), or naming the busy run folder and its process, marked
            ``same_on_every_rank``.
    """
    log = logging.getLogger(load_config.__module__)
    level = log.level
    log.setLevel(logging.ERROR)  # the loader's warnings are the verb's to print, when it reads the job
    try:
        with same_on_every_rank():
            if planning:
                load_config_for_planning(config, overrides)
            else:
                cfg = load_config(config, list(overrides))
                if run_folder:
                    check_run_free(cfg.metrics.run_dir)
    finally:
        log.setLevel(level)


def load_config_for_planning(config_path: str | Path, overrides: Sequence[str] = ()) -> tuple[JobConfig, str]:
    """The job config ``plait plan`` plans for: the TOML file with its ``--section.key=value`` overrides, read and
    validated as ``plait.config.loader.load_config`` does, except that the job's ``[parallel.pp]`` table and
    ``parallel.dp`` are reset to their defaults first: the plan replaces them, so a table written for another
    model or world size (e.g. ``attach_encoders = true`` on an LLM-only job) must not stop the planning.

    Returns:
        ``(JobConfig, replaced)``: ``replaced`` names what was reset (``"[parallel.pp] table"``,
        ``"parallel.dp = 2"``, both joined by ``" and "``), ``""`` when the job set neither.

    Raises:
        FileNotFoundError: when the file does not exist; ValueError: as ``load_config`` (TOML syntax, unknown
            keys, wrong types or invalid values outside ``[parallel.pp]``, named by dotted key).
    """
    data = read_config_data(config_path, overrides)
    parallel = data.get("parallel")
    replaced = []
    if isinstance(parallel, dict):
        if parallel.pop("pp", None):
            replaced.append("[parallel.pp] table")
        if parallel.get("dp", 0) not in (0, 1):
            replaced.append(f"parallel.dp = {parallel['dp']}")
        parallel.pop("dp", None)
    cfg = config_from_dict(data)
    validate(cfg)
    return cfg, " and ".join(replaced)
