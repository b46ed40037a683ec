"""Reading a command's job file, with nothing heavy imported: ``plait.cli`` reads the job of every verb that takes
``--config`` through :func:`check_job` before the verb's module (torch, transformers, the trainer: seconds of
imports) is loaded, so a misspelt key, a wrong type or value, or a missing file is reported at once.

- :func:`check_job`: read and validate a job file as the verb will, errors marked as every rank's alike.
- :func:`load_config_for_planning`: the job ``plait plan`` and ``plait energy`` plan for (``[parallel.pp]`` and
  ``parallel.dp`` reset: the plan replaces them).
- :func:`same_on_every_rank`: mark the errors raised inside it as ones every rank of a job raises alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from plait.config.loader import config_from_dict, load_config, read_config_data, validate
from plait.config.schema import JobConfig
from plait.train.run_lock import check_run_free

__all__ = ["check_job", "load_config_for_planning", "same_on_every_rank"]


@contextmanager
def same_on_every_rank() -> Iterator[None]:
    """Mark a ``ValueError`` or ``FileNotFoundError`` raised inside as one every rank raises alike (each rank reads
    the same files): under torchrun the command line prints it once, from rank 0 (``plait.cli``)."""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        exc.same_on_every_rank = True  # type: ignore[attr-defined]
        raise


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
