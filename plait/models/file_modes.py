"""Saved model files readable as the process's umask allows: ``safetensors``' ``save_file`` (and so transformers'
``save_pretrained``) creates its files with mode 0600, so a ``final/`` or an export written by one user could not be
read by the group that shares the run folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["share_saved_files"]


def share_saved_files(folder: str | Path) -> int:
    """Give every ``*.safetensors`` file under ``folder`` the mode a new file gets under the process's umask
    (0644 with the usual umask 022), as ``open()`` would have; returns how many files changed. Files whose mode
    already allows more than that are left as they are."""
    umask = os.umask(0)
    os.umask(umask)
    want = 0o666 & ~umask
    changed = 0
    for path in Path(folder).rglob("*.safetensors"):
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode | want != mode:
            path.chmod(mode | want)
            changed += 1
    return changed
