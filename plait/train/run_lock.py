"""The lock that keeps two live runs out of one run folder (``metrics.run_dir``).

The lock is a file, ``<run_dir>/plait.lock``, holding the writer's host, process id, start time and command line
(JSON), created atomically (``O_CREAT | O_EXCL``) by :func:`acquire_run_lock` and removed by
:func:`release_run_lock`; :func:`hold_run_lock` holds it around a block, on the main rank of a job, and gives it
back on every exit path. A lock whose process is gone (same host, no such pid) is stale: it is taken over with a
warning, as is one of this torchrun job's attempt before a restart (same ``TORCHELASTIC_RUN_ID``, a lower
``TORCHELASTIC_RESTART_COUNT``: torchrun restarted every worker, on whichever host). Another lock from another host
cannot be checked from here: it is refused, saying how to remove it. This module
imports no torch (``torch.distributed`` only when a job of several ranks holds the lock), so checking a folder costs
nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["LOCK_NAME", "acquire_run_lock", "busy_run_message", "check_run_free", "hold_run_lock",
           "release_run_lock"]

log = logging.getLogger("plait.train.trainer")

LOCK_NAME = "plait.lock"
"""The lock file's name inside a run folder."""
_HELD: dict[Path, int] = {}  # lock files this process holds -> how many times acquired (re-entrant)


def _lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir).absolute() / LOCK_NAME


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's holder (``{"host", "pid", "started", "command"}``), None when there is no lock file; a file that is
    not a whole lock (being written this instant, or damaged) reads as ``{}``."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) and {"host", "pid"} <= set(holder) else {}


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _attempt() -> tuple[str, int] | None:
    """This process's torchrun job and restart (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``); None
    outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id is None else (run_id, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _earlier_attempt(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` is an earlier attempt of this torchrun job (same run id, a lower restart count): torchrun
    restarted every worker after a failure, so that holder is gone, whichever host it ran on."""
    mine = _attempt()
    return mine is not None and holder.get("run_id") == mine[0] and int(holder.get("restart", mine[1])) < mine[1]


def busy_run_message(run_dir: str | Path) -> str | None:
    """Why ``run_dir`` is in use by another live run: its lock's holder (another live process on this host, or any
    process on another host), with how to proceed; None when the folder is free (no lock, this process's own, or a
    stale one whose process is gone)."""
    path = _lock_path(run_dir)
    return _busy(run_dir, path, _read_lock(path))


def _busy(run_dir: str | Path, path: Path, holder: dict[str, Any] | None) -> str | None:
    """:func:`busy_run_message` for the lock at ``path`` read as ``holder`` (:func:`_read_lock`)."""
    if not holder:  # none, or one being written by a process that has not finished it: acquire decides
        return None
    host, pid = str(holder["host"]), int(holder["pid"])
    started = holder.get("started")
    since = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    command = f" ({holder['command']})" if holder.get("command") else ""
    if host == socket.gethostname():
        if pid == os.getpid() or not _alive(pid):
            return None
        return (f"{run_dir} is in use by another plait run: process {pid} on this host{since}{command} is writing "
                f"it (lock {path}); wait for it to end or stop it, or write this run elsewhere with "
                "--metrics.run_dir=DIR")
    if _earlier_attempt(holder):
        return None
    return (f"{run_dir} is in use by a plait run on host {host}: process {pid}{since}{command} holds its lock "
            f"{path}, which cannot be checked from {socket.gethostname()}; if that run is over (the host went down "
            f"before removing it), remove the lock (rm {path}), or write this run elsewhere with --metrics.run_dir=DIR")


def check_run_free(run_dir: str | Path) -> None:
    """Refuse a run folder that another live run is writing (:func:`busy_run_message`); nothing is written.

    Raises:
        ValueError: naming the folder, the other process and its host, and what to do.
    """
    message = busy_run_message(run_dir)
    if message is not None:
        raise ValueError(message)


def acquire_run_lock(run_dir: str | Path) -> Path:
    """Take ``run_dir``'s lock for this process (creating the folder), or again when this process holds it already
    (re-entrant: it is removed at the matching :func:`release_run_lock`). A stale lock (its process gone, same host)
    is taken over with a warning. Returns the lock file's path.

    Raises:
        ValueError: when another live run holds it (:func:`busy_run_message`).
    """
    path = _lock_path(run_dir)
    if path in _HELD:
        _HELD[path] += 1
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    attempt = _attempt()
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                         "command": " ".join(["plait", *sys.argv[1:]])[:300]}
                        | ({"run_id": attempt[0], "restart": attempt[1]} if attempt else {}))
    for attempt in range(50):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _clear_stale(path, run_dir, attempt)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(record)
        _HELD[path] = 1
        return path
    raise ValueError(f"could not take the lock {path} of {run_dir}: it keeps reappearing; is another run starting "
                     "there? Write this run elsewhere with --metrics.run_dir=DIR")


def _clear_stale(path: Path, run_dir: str | Path, attempt: int) -> None:
    """The lock at ``path`` exists: raise when a live run holds it, remove it when stale (warning), or wait a moment
    when it is being written (an unreadable lock is taken as stale after about a second). The lock is read once,
    so what is removed is what was judged stale; gone meanwhile, the caller's next attempt creates it."""
    holder = _read_lock(path)
    if holder is None:
        return
    message = _busy(run_dir, path, holder)
    if message is not None:
        raise ValueError(message)
    if holder == {} and attempt < 20:
        time.sleep(0.05)
        return
    if holder and holder["host"] != socket.gethostname() and _earlier_attempt(holder):
        log.warning("%s: taking over the lock of process %s on %s, this torchrun job's attempt before the restart",
                    run_dir, holder["pid"], holder["host"])
    elif holder:
        log.warning("%s: taking over the lock of process %s on this host, which is gone (an earlier run that "
                    "ended without removing it)", run_dir, holder["pid"])
    else:
        log.warning("%s: removing the unreadable lock %s (left by a run that died while writing it)", run_dir, path)
    path.unlink(missing_ok=True)


def release_run_lock(run_dir: str | Path) -> None:
    """Give back this process's lock of ``run_dir`` (:func:`acquire_run_lock`); the file is removed at the last
    release, and only when it is still this process's."""
    path = _lock_path(run_dir)
    count = _HELD.get(path, 0)
    if count > 1:
        _HELD[path] = count - 1
        return
    _HELD.pop(path, None)
    holder = _read_lock(path)
    if count and holder and holder["host"] == socket.gethostname() and int(holder["pid"]) == os.getpid():
        path.unlink(missing_ok=True)


@contextmanager
def hold_run_lock(run_dir: str | Path, is_main: bool = True, world_size: int = 1) -> Iterator[None]:
    """Hold ``run_dir``'s lock (:func:`acquire_run_lock`) while the block runs: the main rank (global rank 0) takes
    it and gives it back on every exit path; under ``torch.distributed`` with several ranks the main rank's outcome
    is broadcast (collective: every rank enters), so every rank refuses alike. Re-entrant in one process.

    Raises:
        ValueError: on every rank, when another live run holds the lock (naming the folder and its process) or the
            lock cannot be written, marked ``same_on_every_rank``.
    """
    error = None
    if is_main:
        try:
            acquire_run_lock(run_dir)
        except ValueError as exc:
            error = str(exc)
        except OSError as exc:  # e.g. a read-only or foreign folder: every rank must hear of it
            where = f" ({exc.filename})" if exc.filename else ""
            error = (f"cannot write the lock of run folder {run_dir}: {exc.strerror or type(exc).__name__}"
                     f"{where}; choose a folder this user can write (metrics.run_dir)")
    if world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
    if error is not None:
        exc = ValueError(error)
        exc.same_on_every_rank = True  # type: ignore[attr-defined]
        raise exc
    try:
        yield
    finally:
        if is_main:
            release_run_lock(run_dir)
