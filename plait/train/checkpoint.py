"""Resumable checkpoints with torch.distributed.checkpoint (DCP), across parallel layouts.

A checkpoint holds the model and optimizer (through ``get_state_dict``, so DDP/FSDP wrappers and
resharding are handled by PyTorch), the LR schedule, the data-loader position, the step, the layout it was
written with (:class:`CheckpointLayout`), the job's model config and every rank's RNG state. Each is written
to ``<run_dir>/checkpoints/step_<k>/``.

Keys are layout-neutral: model entries are named by their full-model FQN, and the optimizer state is flattened
to per-parameter keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), written under every FQN of a tied
parameter. Under pipeline parallelism each rank passes its pruned model (owned units only, parameter names as
in the full model) and an optimizer over its own trainable parameters, or none: every rank writes its own
keys; replicas (DP, CP) write identical keys, which DCP stores once. Any rank of any layout therefore finds
every key it asks for, whichever rank wrote it.

Resuming with another layout (other world size, DP/PP/CP degrees or pipeline plan) restores the model, the
AdamW moments and step counts, the LR schedule position and the data position exactly. Only the RNG streams
cannot follow (a rank of the new layout has no counterpart in the old one): each rank's Python, NumPy and
torch generators are then seeded with :func:`derive_rng_seed` of ``(train.seed, step, rank)``, so dropout or
sampling randomness differs from an uninterrupted run. With the same layout every rank gets its own saved
RNG state back. Two things depend on the writer's layout and are translated: the LR schedule (a pipeline
trainer's ``LambdaLR`` drives a one-group placeholder, the other trainers' drive each optimizer group) moves
to the saved step with this job's base LRs; and a pipeline checkpoint lacks the model parts on no pipeline
unit (a pooling head, an unused post-norm), which keep their (seed, FQN) initial values (they never train).

What cannot change on resume (``ValueError`` naming the field): the ``[model]`` section (except
``llm.attn_implementation``), the global batch size (the data position counts global batches of the saved size,
and a different size would give other batches than the uninterrupted run), the seed, the training set size and
the training set itself: its usable samples' ids in order (:func:`training_set_identity`; a checkpoint written
without it is not compared), so a sample index means the same record after the resume. The same records under
another path (a moved or copied file) resume.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
import shutil
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = [
    "CheckpointLayout",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_state",
    "latest_checkpoint",
    "checkpoint_dir",
    "remove_checkpoints",
    "derive_rng_seed",
    "seed_rng_streams",
    "training_set_identity",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # dataset -> its training_set_identity
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# [model] fields that may differ on resume: how attention runs, not what is trained
_MODEL_FIELDS_FREE = frozenset({"llm.attn_implementation"})
# loader fields that fix which global batch comes next: (state key, what the user changes)
_LOADER_FIXED = (("global_batch_size", "train.global_batch_size"), ("seed", "train.seed"),
                 ("num_samples", "the number of usable training samples (data.train)"))


@dataclass(frozen=True)
class CheckpointLayout:
    """The parallel layout of a job: world size (processes), DP/PP/CP/TP degrees, the FSDP2 shard degree and, under
    pipeline parallelism, the plan (which units each stage holds and on which pipeline rank). Two layouts are the
    same when every field is; then rank ``r`` plays the same part in both.

    Attributes:
        dp: data-parallel ranks of each stage, replicas x shards (``parallel.dp x parallel.dp_shard``).
        dp_shard: of those, how many share one FSDP2-sharded copy (``parallel.dp_shard``).
        tp: tensor-parallel degree (``parallel.tp``).

    Raises:
        ValueError: from :meth:`from_dict` on unknown or missing fields.
    """

    world_size: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    plan: str = ""
    tp: int = 1
    dp_shard: int = 1

    def describe(self) -> str:
        """One line, e.g. ``2 processes (DP 1 x PP 2 x CP 1; <plan>)`` or, with TP or FSDP2,
        ``4 processes (DP 2 x PP 1 x CP 1 x TP 2; DP = 1 replica(s) x FSDP2 dp_shard 2)``: DP counts every
        data-parallel rank, FSDP2's shard ranks included. When the degrees do not multiply to the world size
        (``plait launch`` after a failure: pipelines of unequal depth), only the process count and the plan, e.g.
        ``3 processes (plait launch: workers [0]: 1 stages, 2 mb; workers [1, 2]: 2 stages, 2 mb)``."""
        procs = f"{self.world_size} process" + ("" if self.world_size == 1 else "es")
        if self.plan and self.dp * self.pp * self.cp * self.tp != self.world_size:
            return f"{procs} ({self.plan})"  # pipelines of unequal depth (plait launch): the plan lists them
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        shard = (f"; DP = {self.dp // self.dp_shard} replica(s) x FSDP2 dp_shard {self.dp_shard}"
                 if self.dp_shard > 1 else "")
        plan = f"; {self.plan}" if self.plan else ""
        return f"{procs} (DP {self.dp} x PP {self.pp} x CP {self.cp}{tp}{shard}{plan})"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON round-trippable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckpointLayout":
        """Inverse of :meth:`to_dict`; a layout written before ``tp`` and ``dp_shard`` were recorded has 1 for both."""
        names = {f.name for f in fields(cls)}
        data = {"tp": 1, "dp_shard": 1, **data}
        if set(data) != names:
            raise ValueError(f"checkpoint layout fields {sorted(data)} are not {sorted(names)}")
        return cls(**data)


def _optimizers(optimizer: torch.optim.Optimizer | None) -> Any:
    return () if optimizer is None else optimizer


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step, 6 digits>``."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def training_set_identity(dataset: Any) -> dict[str, Any]:
    """What a resumed run must train on: ``{"files": [path, ...], "samples": n, "ids_sha256": hex}`` of a
    ``plait.data.loader.MultimodalDataset`` (its source's file, or a mixture's files in order), where ``ids_sha256``
    is SHA-256 of its ``n`` usable samples' record ids in sample order (from the metadata pass: nothing is read).
    The data position of a checkpoint indexes these samples, so the same ids in the same order mean the same
    batches; a reordered, edited-by-id or other file of the same size gives another digest. Computed once per
    dataset (about 1 s per 100M id bytes), then remembered."""
    if dataset in _IDENTITIES:
        return _IDENTITIES[dataset]
    table = dataset.table
    digest = hashlib.sha256(np.ascontiguousarray(table.id_offsets, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(table.id_blob, dtype=np.uint8).tobytes())
    sources = getattr(dataset.source, "sources", [dataset.source])
    identity = {"files": [str(Path(s.path).absolute()) for s in sources], "samples": len(table),
                "ids_sha256": digest.hexdigest()}
    _IDENTITIES[dataset] = identity
    return identity


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``run_dir`` (one with DCP's ``.metadata``)."""
    root = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name))]
    found = [(s, p) for s, p in found if (p / ".metadata").is_file()]
    return max(found)[1] if found else None


def remove_checkpoints(run_dir: str | Path) -> int:
    """Delete every ``step_*`` folder (complete or not) under ``<run_dir>/checkpoints``, e.g. an earlier run's
    before a new run starts there, so a later resume can only find the new run's; returns how many."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob("step_*") if _STEP_DIR.match(p.name) and p.is_dir()]
    for old in found:
        shutil.rmtree(old, ignore_errors=True)
    return len(found)


def derive_rng_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` when a job resumes at ``step`` with another layout: the first 8 bytes
    (big-endian) of SHA-256 of ``"plait-rng/<seed>/<step>/<rank>"``, masked to 63 bits. Deterministic on every
    machine and process, and different for every (seed, step, rank)."""
    digest = hashlib.sha256(f"plait-rng/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def seed_rng_streams(seed: int, step: int, rank: int) -> int:
    """Seed this process's Python ``random``, NumPy (with the seed mod 2**32) and torch (CPU and every CUDA
    device) generators with :func:`derive_rng_seed`; returns that seed."""
    value = derive_rng_seed(seed, step, rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    return value


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


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _with_tied_aliases(model: nn.Module, optim_sd: dict[str, Any]) -> dict[str, Any]:
    """``optim_sd`` (flattened) plus the entries of every tied parameter under each of its other FQNs.

    ``get_state_dict`` keys a tied parameter's optimizer state by one FQN (the input embedding's); a pipeline
    rank that holds only the other copy (the output embedding) asks for its own FQN."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    out = dict(optim_sd)
    for fqns in (f for f in names.values() if len(f) > 1):
        for kind in ("state", "param_groups"):
            source = next((f for f in fqns if any(k.startswith(f"{kind}.{f}.") for k in optim_sd)), None)
            if source is None:
                continue
            prefix = f"{kind}.{source}."
            entries = {k[len(prefix):]: v for k, v in optim_sd.items() if k.startswith(prefix)}
            for alias in fqns:
                for rest, value in entries.items():
                    out.setdefault(f"{kind}.{alias}.{rest}", value)
    return out


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    loader_state: dict[str, Any],
    step: int,
    keep: int = 0,
    layout: CheckpointLayout | None = None,
    model_config: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of this step to ``path`` (collective: every rank calls it).

    ``optimizer`` is None on a rank that trains nothing (a frozen pipeline stage); ``scheduler`` is any object
    with ``state_dict``/``load_state_dict``. ``keep`` > 0 removes older ``step_*`` siblings beyond the newest
    ``keep`` (on rank 0). ``layout`` (default: plain DP over the world), ``model_config`` (the job's
    ``[model]`` section as a plain dict; None records nothing) and ``data`` (the training set's
    :func:`training_set_identity`; None records nothing) are recorded for :func:`load_checkpoint`.
    """
    path = Path(path)
    layout = layout or CheckpointLayout(world_size=_world(), dp=_world())
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_OPTIONS)
    extra = {"scheduler": scheduler.state_dict(), "loader": loader_state, "step": step,
             "layout": json.dumps(layout.to_dict(), sort_keys=True),
             "model_config": json.dumps(model_config, sort_keys=True) if model_config is not None else "",
             "data": json.dumps(data, sort_keys=True) if data is not None else ""}
    state = {"model": model_sd, "optim": _with_tied_aliases(model, optim_sd), "extra": extra,
             f"rng_rank{_rank()}": _rng_state()}
    with _single_process_quiet(), warnings.catch_warnings():
        # a resumed run re-saves steps its interrupted predecessor had saved: replacing them is intended
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
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
    layout: CheckpointLayout | None = None,
    model_config: dict[str, Any] | None = None,
    seed: int = 0,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore model, optimizer (unless None), LR schedule and RNG from ``path``, written with any layout
    (module docstring). Collective: every rank calls it (DCP's load agrees on the ranks' read plans).

    Args:
        loader_state: the current loader state (its fixed fields are checked against the saved ones).
        layout: this job's layout (default: plain DP over the world). When it equals the layout recorded in
            the checkpoint, this rank's saved RNG state and the whole saved LR schedule state are restored;
            otherwise the RNG streams are re-derived with :func:`seed_rng_streams` ``(seed, step, rank)`` and
            the LR schedule keeps this job's base LRs, moved to the saved step. A checkpoint written before
            layouts were recorded counts as the same layout when it holds one RNG state per current rank.
        model_config: this job's ``[model]`` section (plain dict); None skips the comparison.
        seed: ``train.seed``, for re-derived RNG streams.
        data: this job's training set, :func:`training_set_identity`; None (or a checkpoint that recorded none)
            skips the comparison.

    Returns:
        ``{"step": int, "loader": dict, "layout": CheckpointLayout | None (None: written before layouts were
        recorded), "rng": "restored" | "derived"}``.

    Raises:
        FileNotFoundError: when ``path`` is not a complete checkpoint.
        ValueError: when the model config, global batch size, seed, training set size or training set (its
            sample ids in order) differ from the saved run's, or the checkpoint lacks or mis-shapes a parameter of
            ``model``.
    """
    path = _complete(path)
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    extra = _read_extra(path, keys)
    _check_loader(path, extra["loader"], loader_state)
    _check_data(path, extra.get("data") or None, data)
    saved = CheckpointLayout.from_dict(json.loads(extra["layout"])) if extra.get("layout") else None
    current = layout or CheckpointLayout(world_size=_world(), dp=_world())
    same = saved == current if saved is not None else _rng_keys(keys) == _world()
    rng_key = f"rng_rank{_rank()}"
    rng = torch.zeros(keys[rng_key].size, dtype=torch.uint8) if same and rng_key in keys else None
    changes = _config_changes(extra.get("model_config") or None, model_config)
    # a pipeline checkpoint lacks the parts of the model on no pipeline unit (never used, never trained)
    unsaved_ok = saved is not None and saved.pp > 1 and bool(extra.get("model_config")) and not changes
    _load_model_and_optimizer(path, keys, model, optimizer, (rng_key, rng), changes, unsaved_ok)
    if changes:
        raise _same_everywhere(ValueError(
            f"cannot resume from {path}: the [model] config differs from the one it was written with "
            f"({'; '.join(changes[:4])}); --resume continues the same model (to train a changed model from these "
            "weights, start a new run with model.pretrained set to a saved model)"))
    step = int(extra["step"])
    _restore_schedule(scheduler, extra["scheduler"], reposition=not same)
    if rng is not None:
        _set_rng_state(rng)
    else:
        seed_rng_streams(seed, step, _rank())
    return {"step": step, "loader": extra["loader"], "layout": saved,
            "rng": "restored" if rng is not None else "derived"}


def _complete(path: str | Path) -> Path:
    """``path`` as a Path, checked to be a complete checkpoint (raises FileNotFoundError)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata)")
    return path


def _rng_keys(keys: Any) -> int:
    return sum(1 for k in keys if re.fullmatch(r"rng_rank\d+", k))


def _read_extra(path: Path, keys: Any) -> dict[str, Any]:
    """The checkpoint's ``extra`` entries (schedule, loader, step, layout, model config: whatever it holds),
    read by this process alone. The template is built from the saved key names, so it needs no knowledge of
    the layout that wrote them."""
    template: dict[str, Any] = {}
    for key in keys:
        if key.startswith("extra."):
            *parents, leaf = key.split(".")[1:]
            node = template
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = None
    state = {"extra": template}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["extra"]


def _same_everywhere(exc: ValueError) -> ValueError:
    """Mark an error that every rank raises alike (the command line then prints it once)."""
    exc.same_on_every_rank = True  # type: ignore[attr-defined]
    return exc


def _check_loader(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise ValueError when a loader field that fixes the next global batch changed (``_LOADER_FIXED``)."""
    for key, what in _LOADER_FIXED:
        if key in saved and key in current and int(saved[key]) != int(current[key]):
            raise _same_everywhere(ValueError(
                f"cannot resume from {path}: {what} was {saved[key]} when it was written, now {current[key]}; "
                "the data position counts global batches of that run, so the next batches would differ from it"))


def _check_data(path: Path, saved_json: str | bytes | None, current: dict[str, Any] | None) -> None:
    """Raise ValueError when the training set's sample ids in order (:func:`training_set_identity`) differ from the
    ones the checkpoint was written with, naming both files; nothing when either side is unknown."""
    if not saved_json or current is None:
        return
    saved = json.loads(saved_json)
    if saved.get("ids_sha256") == current["ids_sha256"]:
        return
    was, now = ", ".join(saved.get("files", ["?"])), ", ".join(current["files"])
    change = (f"{now} changed since it was written (same path, other records or another order)" if was == now
              else f"it was written training on {was}, now on {now}")
    raise _same_everywhere(ValueError(
        f"cannot resume from {path}: the training set differs: {change} ({saved.get('samples', '?')} and "
        f"{current['samples']} usable samples; their record ids in order differ); the data position indexes the "
        "saved run's samples, so the next batches would be other samples than it would have seen: resume with that "
        "run's data.train, or start a new run (--overwrite, or --metrics.run_dir=DIR) on this one"))


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _config_changes(saved_json: str | None, current: dict[str, Any] | None) -> list[str]:
    """``"<field>: <saved> -> <now>"`` for each ``[model]`` field that differs (``_MODEL_FIELDS_FREE`` aside);
    empty when either side is unknown."""
    if saved_json is None or current is None:
        return []
    old, new = _flat(json.loads(saved_json)), _flat(json.loads(json.dumps(current)))
    missing = object()
    return [f"model.{k}: {old.get(k, 'unset')!r} -> {new.get(k, 'unset')!r}" for k in sorted(set(old) | set(new))
            if k not in _MODEL_FIELDS_FREE and old.get(k, missing) != new.get(k, missing)]


def _load_model_and_optimizer(path: Path, keys: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                              rng: tuple[str, torch.Tensor | None], changes: list[str], unsaved_ok: bool) -> None:
    """Read this rank's model and optimizer entries (and, when ``rng = (key, blob)`` holds a blob, its RNG state
    into it) and set them.

    Parameters that had received no gradient when the checkpoint was written had no optimizer state: none is
    read for them and the state ``get_state_dict`` initialised is dropped, so they resume exactly as they
    were. Optimizer group fields the checkpoint lacks (``initial_lr``, which only a trainer whose optimizer
    carries the LR schedule has) keep their current values. Model entries the checkpoint lacks are an error
    unless ``unsaved_ok`` (a pipeline checkpoint of the same model config: the entries on no pipeline unit,
    such as a pooling head, are never saved, never trained, and keep their (seed, FQN) initial values)."""
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_OPTIONS)
    missing = [k for k in model_sd if f"model.{k}" not in keys]
    if missing and not unsaved_ok:
        error = ValueError(f"cannot resume from {path}: it lacks parameters of this model, e.g. {missing[:3]} "
                           f"({'; '.join(changes[:4]) or 'was the model config changed?'})")
        raise _same_everywhere(error) if changes else error
    stateless = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in optim_sd
                 if k.startswith("state.") and f"optim.{k}" not in keys}
    wanted = {k: v for k, v in optim_sd.items() if f"optim.{k}" in keys}
    state: dict[str, Any] = {"model": {k: v for k, v in model_sd.items() if f"model.{k}" in keys}, "optim": wanted}
    if rng[1] is not None:
        state[rng[0]] = rng[1]
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
        model_sd.update(state["model"])
        optim_sd.update(state["optim"])
        set_state_dict(model, _optimizers(optimizer), model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=_OPTIONS)
        if optimizer is not None:
            for name, param in model.named_parameters():
                if name in stateless:
                    optimizer.state.pop(param, None)
    except (Exception, CheckpointException) as exc:  # DCP's own type is a BaseException
        error = ValueError(f"cannot resume from {path}: it does not match this job's model or optimizer "
                           f"({'; '.join(changes[:4]) or 'was the model config changed?'}): {_reason(exc)}")
        raise (_same_everywhere(error) if changes else error) from exc


def _restore_schedule(scheduler: Any, saved: dict[str, Any], reposition: bool) -> None:
    """Restore the LR schedule: its whole saved state (same layout, or a schedule that is not a ``LambdaLR``),
    or, for a ``LambdaLR`` after a layout change (or with another number of groups), only its position
    (``last_epoch``, ``_step_count``) with this job's base LRs, the current LRs recomputed from them and written
    into the optimizer's groups. The saved base LRs belong to the old layout's optimizer (a pipeline trainer's
    :class:`~plait.train.optim.LRSchedule` records the job's one base LR, the others one per (LR scale, weight
    decay) group), so they cannot be reused."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.load_state_dict(saved)
        return
    if not reposition and len(saved["base_lrs"]) == len(scheduler.base_lrs):
        scheduler.load_state_dict(saved)
        return
    scheduler.last_epoch, scheduler._step_count = int(saved["last_epoch"]), int(saved["_step_count"])
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


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
