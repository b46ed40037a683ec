"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer (through ``get_state_dict``, so DDP/FSDP wrappers and
resharding are handled by PyTorch), the LR schedule, the data-loader position, the step and every rank's
RNG state. Each is written to ``<run_dir>/checkpoints/step_<k>/``.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_dir"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step, 6 digits>``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``run_dir`` (one with DCP's ``.metadata``)."""
    root = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name))]
    found = [(s, p) for s, p in found if (p / ".metadata").is_file()]
    return max(found)[1] if found else None


def _rng_state() -> torch.Tensor:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def _set_rng_state(blob: torch.Tensor) -> None:
    state = pickle.loads(blob.numpy().tobytes())
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader_state: dict[str, Any],
    step: int,
    keep: int = 0,
) -> Path:
    """Write a checkpoint of this step to ``path`` (collective: every rank calls it).

    ``keep`` > 0 removes older ``step_*`` siblings beyond the newest ``keep`` (on rank 0).
    """
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "extra": {"scheduler": scheduler.state_dict(), "loader": loader_state, "step": step},
        f"rng_rank{_rank()}": _rng_state(),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path))
    if keep > 0 and _rank() == 0:
        _prune(path.parent, keep)
    return path


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader_state: dict[str, Any],
) -> dict[str, Any]:
    """Restore model, optimizer, schedule and this rank's RNG from ``path``; returns
    ``{"step": int, "loader": dict}``. ``loader_state`` is the current loader state, whose keys say what
    to read.

    Raises:
        FileNotFoundError: when ``path`` is not a complete checkpoint.
        ValueError: when the checkpoint holds no RNG state for this rank (saved with fewer ranks).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    key = f"rng_rank{_rank()}"
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if key not in keys:
        raise ValueError(f"checkpoint {path} has no RNG state for rank {_rank()}: saved with another world size")
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "extra": {"scheduler": scheduler.state_dict(), "loader": dict(loader_state), "step": 0},
        key: torch.zeros(keys[key].size, dtype=torch.uint8),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["extra"]["scheduler"])
    _set_rng_state(state[key])
    return {"step": int(state["extra"]["step"]), "loader": state["extra"]["loader"]}


def _prune(root: Path, keep: int) -> None:
    found = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
    for _, old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
