"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer (through ``get_state_dict``, so DDP/FSDP wrappers and
resharding are handled by PyTorch), the LR schedule, the data-loader position, the step and every rank's
RNG state. Each is written to ``<run_dir>/checkpoints/step_<k>/``.

Under pipeline parallelism each rank passes its pruned model (owned units only, parameter names as in the
full model) and an optimizer over its own trainable parameters, or none: every rank then writes its own
keys. The optimizer state is flattened to per-parameter keys (``state.<fqn>.exp_avg``,
``param_groups.<fqn>.lr``) so that ranks holding different parameters never write one key with different
contents; replicas (DP) write identical keys, which DCP stores once.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_state", "latest_checkpoint", "checkpoint_dir"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _optimizers(optimizer: torch.optim.Optimizer | None) -> Any:
    return () if optimizer is None else optimizer


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


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group (single-process jobs, rank-0 loads)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    loader_state: dict[str, Any],
    step: int,
    keep: int = 0,
) -> Path:
    """Write a checkpoint of this step to ``path`` (collective: every rank calls it).

    ``optimizer`` is None on a rank that trains nothing (a frozen pipeline stage); ``scheduler`` is any object
    with ``state_dict``/``load_state_dict``. ``keep`` > 0 removes older ``step_*`` siblings beyond the newest
    ``keep`` (on rank 0).
    """
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_OPTIONS)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "extra": {"scheduler": scheduler.state_dict(), "loader": loader_state, "step": step},
        f"rng_rank{_rank()}": _rng_state(),
    }
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path))
    if keep > 0 and _rank() == 0:
        _prune(path.parent, keep)
    return path


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    loader_state: dict[str, Any],
) -> dict[str, Any]:
    """Restore model, optimizer (unless None), schedule and this rank's RNG from ``path``; returns
    ``{"step": int, "loader": dict}``. ``loader_state`` is the current loader state, whose keys say what
    to read.

    Raises:
        FileNotFoundError: when ``path`` is not a complete checkpoint.
        ValueError: when the checkpoint holds no RNG state for this rank (saved with fewer ranks).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_OPTIONS)
    key = f"rng_rank{_rank()}"
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if key not in keys:
        raise ValueError(f"checkpoint {path} has no RNG state for rank {_rank()}: saved with another world size")
    # Parameters that had received no gradient when the checkpoint was written had no optimizer state:
    # read none for them (partial load) and drop the state get_state_dict initialised, so they resume
    # exactly as they were.
    stateless = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in optim_sd
                 if k.startswith("state.") and f"optim.{k}" not in keys}
    missing = [k for k in model_sd if f"model.{k}" not in keys]
    if missing:
        raise ValueError(f"cannot resume from {path}: it lacks parameters of this model, e.g. {missing[:3]} "
                         "(was the model config changed?)")
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "extra": {"scheduler": scheduler.state_dict(), "loader": dict(loader_state), "step": 0},
        key: torch.zeros(keys[key].size, dtype=torch.uint8),
    }
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=bool(stateless)))
        set_state_dict(model, _optimizers(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_OPTIONS)
        if optimizer is not None:
            for name, param in model.named_parameters():
                if name in stateless:
                    optimizer.state.pop(param, None)
    except (Exception, CheckpointException) as exc:  # DCP's own type is a BaseException
        raise ValueError(f"cannot resume from {path}: it does not match this job's model or optimizer "
                         f"(was the model config changed?): {_reason(exc)}") from exc
    scheduler.load_state_dict(state["extra"]["scheduler"])
    _set_rng_state(state[key])
    return {"step": int(state["extra"]["step"]), "loader": state["extra"]["loader"]}


def load_model_state(path: str | Path, model: nn.Module) -> list[str]:
    """Load the model entries of checkpoint ``path`` into ``model`` in this process alone (DCP with
    ``no_dist=True``: no collective), e.g. the whole model on one rank from a pipeline checkpoint in which each
    rank saved its own stage under the full model's names.

    Returns:
        the names of ``model``'s entries that the checkpoint lacks (they keep their current values): parts that
        belong to no pipeline unit (a pooling head, layers after the selected feature layer) are never saved.

    Raises:
        FileNotFoundError: when ``path`` is not a complete checkpoint.
        ValueError: when the checkpoint lacks a trainable parameter of ``model`` (another model's checkpoint).
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    current = model.state_dict()
    present = {k: v for k, v in current.items() if f"model.{k}" in saved}
    missing = sorted(set(current) - set(present))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad and n in missing)
    if trainable:
        raise ValueError(f"checkpoint {path} has no value for trainable parameter(s) {trainable[:3]}: saved from "
                         "another model?")
    try:
        with _single_process_quiet():
            dcp.load({"model": present}, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's own type is a BaseException
        raise ValueError(f"checkpoint {path} does not fit this model (was the model config changed?): "
                         f"{_reason(exc)}") from exc
    model.load_state_dict(present, strict=False)  # a no-op for tensors DCP filled in place
    return missing


def _reason(exc: BaseException) -> str:
    """The last line of an exception's text (DCP's CheckpointException carries each rank's whole traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def _prune(root: Path, keep: int) -> None:
    found = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
    for _, old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
