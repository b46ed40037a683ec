"""Profiling a job: its model and first samples (:func:`build_profile_inputs`), measured by
``plait.measure.unit_timing.measure_profile`` unless a stored profile's key matches (:func:`load_or_measure`: model,
freezing, shapes, dtype, device, versions; a stale one is re-measured and the reason printed).

Profiles are JSON files under a folder, one per key (:class:`ProfileStore`); a file that is not a plait profile is
never overwritten (:func:`not_a_profile`). ``plait profile`` and ``parallel.plan = "auto"`` profile through
:func:`profile_job`. :func:`energy_profile_job` sweeps N SM clocks of the GPU and stores the measured energy
profile (``plait.measure.energy_sweep``) as ``<store>/energy-profile-<key digest>.json``, reused while its key
and GPU match (``energy_profile_mismatch``); where clocks cannot be locked (no GPU, no zeus, no ``SYS_ADMIN``) it
prints why and skips. Messages go to the ``out`` stream the caller gives (default stdout): they are the verbs'
output.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from plait.attention.interface import resolve_implementation, use_plait_attention
from plait.attention.masks import MaskInfo
from plait.config.loader import config_to_dict
from plait.data.chat_template import tokenizer_dir
from plait.data.collate import Batch, collate
from plait.data.loader import MultimodalDataset
from plait.data.metadata import this_process_only
from plait.models.device import resolve_device
from plait.models.multimodal import MultimodalModel
from plait.models.registry import build_model, build_processor, load_tokenizer
from plait.planner.energy.power_profile import energy_profile_mismatch
from plait.planner.energy.types import EnergyProfile
from plait.planner.cost.measured_profile import Profile, profile_mismatch
from plait.planner.cost.types import ProfileKey
from plait.measure.unit_timing import KwargsFn, measure_profile, profile_key

__all__ = [
    "ProfileInputs",
    "ProfileStore",
    "build_profile_inputs",
    "energy_profile_job",
    "load_or_measure",
    "model_description",
    "not_a_profile",
    "profile_job",
]


def energy_profile_job(cfg: Any, *, store_dir: str | Path = "runs/profiles", clocks: int = 5, microbatches: int = 1,
                       microbatch_size: int | None = None, repeats: int = 5, warmup: int = 2, force: bool = False,
                       out: TextIO | None = None) -> EnergyProfile | None:
    """The job's measured GPU energy profile at ``clocks`` SM clocks (``plait.measure.energy_sweep``), stored as
    ``<store_dir>/energy-profile-<key digest>.json`` and reused while its key and GPU match; None, with the
    reason printed, where clocks cannot be locked (``gpu_clock_control``).

    Raises:
        ValueError, FileNotFoundError: as :func:`build_profile_inputs`; ValueError on ``clocks < 1``.
    """
    from plait.measure.energy_sweep import gpu_clock_control, measure_energy_profile, sweep_clocks

    stream = out or sys.stdout
    if clocks < 1:
        raise ValueError(f"--clocks must be >= 1, got {clocks}")
    t = cfg.train
    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    control, reason = gpu_clock_control(torch.device("cuda" if cuda else "cpu"))  # before building anything
    if control is None:
        print(f"plait profile: energy sweep skipped: {reason}", file=stream)
        return None
    inputs = build_profile_inputs(cfg, microbatches=microbatches, microbatch_size=microbatch_size)
    path = Path(store_dir) / f"energy-profile-{inputs.key.digest()}.json"
    if path.is_file() and not force:
        stored = EnergyProfile.from_json(path.read_text())
        why = energy_profile_mismatch(stored, inputs.key, control.name)
        if why is None:
            print(f"plait profile: reusing {path}", file=stream)
            return stored
        print(f"plait profile: measuring the energy profile ({why})", file=stream)
    from zeus.monitor import ZeusMonitor

    monitor = ZeusMonitor(gpu_indices=[control.index], cpu_indices=[], approx_instant_energy=True)
    freqs = sweep_clocks(control.supported_mhz, clocks)
    profile = measure_energy_profile(inputs.model, inputs.microbatches, inputs.key, control, freqs, monitor,
                                     repeats=repeats, warmup=warmup, llm_kwargs=inputs.llm_kwargs,
                                     autocast=inputs.autocast, progress=lambda line: print(line, file=stream))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json(indent=1))
    print(f"plait profile: wrote {path} ({control.name}, clocks {list(freqs)} MHz)", file=stream)
    return profile


# ----- the store -----------------------------------------------------------------------------------------
def not_a_profile(path: str | Path) -> str | None:
    """Why the existing file ``path`` is not a plait profile, or None when it is one (a JSON object with the
    ``format`` and ``key`` of ``Profile.to_dict``, any format version, stale or not) or does not exist. A file
    that is not a profile must not be overwritten by a measured one (it may be a plan, a trace, anything).

    Raises:
        ValueError: when ``path`` exists and is not a regular file (a folder).
    """
    source = Path(path)
    if not source.exists():
        return None
    if not source.is_file():
        raise ValueError(f"profile path {source} exists and is not a file")
    try:
        data = json.loads(source.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return f"not JSON: {exc}"
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    missing = [k for k in ("format", "key") if k not in data]
    return f"no profile {' or '.join(repr(k) for k in missing)} key" if missing else None


def _refuse_foreign(target: Path, advice: str = "") -> None:
    """Refuse to overwrite ``target`` when it exists and is not a plait profile (:func:`not_a_profile`).

    Raises:
        ValueError: naming the file, why it is not a profile and ``advice``.
    """
    foreign = not_a_profile(target)
    if foreign is not None:
        raise ValueError(f"profile file {target} exists and is not a plait profile ({foreign}); refusing to "
                         f"overwrite it{advice}")


class ProfileStore:
    """Profiles as JSON files under ``root``: ``<root>/profile-<key digest>.json``.

    Args:
        root: the folder (created on the first save).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, key: ProfileKey) -> Path:
        """The file of ``key``'s profile."""
        return self.root / f"profile-{key.digest()}.json"

    def file(self, key: ProfileKey, path: str | Path | None = None) -> Path:
        """The file of ``key``'s profile: ``path`` when given, else :meth:`path_for`."""
        return Path(path) if path is not None else self.path_for(key)

    def save(self, profile: Profile, path: str | Path | None = None) -> Path:
        """Write ``profile`` (to ``path``, default ``path_for(profile.key)``); returns the path.

        Raises:
            ValueError: when the file exists and is not a plait profile (``not_a_profile``): never overwritten.
        """
        target = self.file(profile.key, path)
        _refuse_foreign(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(profile.to_dict(), indent=1, sort_keys=True))
        return target

    def load(self, key: ProfileKey, path: str | Path | None = None) -> tuple[Profile | None, str]:
        """The stored profile for ``key`` (from ``path``, default ``path_for(key)``), checked field by field.

        Returns:
            ``(profile, "hit")``, or ``(None, reason)`` when there is no file, it cannot be read, or any key
            field differs (:func:`profile_mismatch`): the caller must re-measure.
        """
        source = self.file(key, path)
        if not source.is_file():
            return None, f"no stored profile at {source}"
        try:
            profile = Profile.from_dict(json.loads(source.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            return None, f"stored profile {source} is unreadable ({exc})"
        reason = profile_mismatch(profile.key, key)
        if reason is not None:
            return None, f"stored profile {source} is stale: {reason}"
        return profile, "hit"


def load_or_measure(store: ProfileStore, key: ProfileKey, measure: Callable[[], Profile], *,
                    path: str | Path | None = None, force: bool = False, out: TextIO | None = None) -> Profile:
    """The stored profile of ``key`` when every key field matches, else ``measure()`` saved to the store.

    Prints ``"plait profile: reusing <file>"`` or ``"plait profile: measuring (<reason>)"`` to ``out`` (default
    stdout): a stale or mismatched profile is never silently reused.

    Args:
        store: the profile folder; path: an explicit file instead of the store's file for ``key``.
        force: measure even when a matching profile exists.

    Raises:
        ValueError: before measuring, when the file to write exists and is not a plait profile
            (:func:`not_a_profile`: not JSON, or no profile ``format`` and ``key``); a plait profile
            that is stale, of another format version or unreadable field by field is re-measured and replaced.
    """
    stream = out or sys.stdout
    target = store.file(key, path)
    _refuse_foreign(target, ": give another --out (or store) or remove the file")
    profile, reason = (None, "forced by the caller") if force else store.load(key, path)
    if profile is not None:
        print(f"plait profile: reusing {target}", file=stream)
        return profile
    print(f"plait profile: measuring ({reason})", file=stream, flush=True)
    profile = measure()
    saved = store.save(profile, path)
    print(f"plait profile: wrote {saved}", file=stream)
    return profile


# ----- jobs ----------------------------------------------------------------------------------------------
@dataclass
class ProfileInputs:
    """What profiling a job needs: its model (real flags), microbatches, LLM kwargs, autocast and key."""

    model: MultimodalModel
    microbatches: list[Batch]
    llm_kwargs: KwargsFn
    autocast: Callable[[], AbstractContextManager]
    key: ProfileKey
    extra: dict[str, Any] = field(default_factory=dict)


def model_description(cfg: Any) -> dict[str, Any]:
    """The model part of a job's profile key: ``config_to_dict(cfg)["model"]`` without the learning-rate
    scales (they change no cost), plus the attention settings and ``data.packing``."""
    data = config_to_dict(cfg)
    model = data["model"]
    for enc in model.get("encoders", {}).values():
        enc.pop("lr_scale", None)
    return {"model": model, "attention": data["attention"], "packing": data["data"]["packing"]}


def build_profile_inputs(cfg: Any, *, microbatches: int = 1, microbatch_size: int | None = None,
                         device: str | None = None, clock: str = "wall") -> ProfileInputs:
    """Build a job's model (seed ``train.seed``, freezing applied) and its first ``microbatches`` x
    ``microbatch_size`` (default ``train.microbatch_size``) training samples in file order, collated into
    microbatches, with the trainer's attention setup (``"hf"`` when it suffices, else plait SDPA/flex);
    ``clock`` goes into the key (:func:`profile_key`). Work of this process alone: the data's metadata pass
    enters no collective (``metadata.this_process_only``), so one rank of a process group may build the inputs
    while the others wait (``parallel.plan = "auto"``).

    Raises:
        ValueError: on counts < 1, fewer usable samples than needed or an unknown clock; FileNotFoundError:
            on missing data.
    """
    size = microbatch_size or cfg.train.microbatch_size
    if microbatches < 1 or size < 1:
        raise ValueError(f"microbatches and microbatch_size must be >= 1, got {microbatches} and {size}")
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    dev = resolve_device(device or t.device)
    torch.manual_seed(t.seed)
    tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
    model = build_model(cfg.model, tokenizer).to(dev)
    processor = build_processor(cfg.model, model, tokenizer, cfg.data.max_length)
    attention = resolve_implementation(cfg.attention.implementation, cfg.attention.mask, cfg.data.packing, 1, dev.type)
    if attention != "hf":
        use_plait_attention(model.language_model, "sdpa" if attention == "plait_sdpa" else "flex")
    needed = microbatches * size
    with this_process_only():
        dataset = MultimodalDataset(cfg.data.train, processor, cfg.data.on_error, max_samples=needed)
    if len(dataset) < needed:
        raise ValueError(f"data.train has {len(dataset)} usable samples; profiling needs {needed}")
    batches = [collate([dataset[i] for i in range(k * size, (k + 1) * size)], processor.pad_id,
                       pack=cfg.data.packing).to(dev) for k in range(microbatches)]
    mode = cfg.attention.mask
    llm_kwargs: KwargsFn = (lambda b: {}) if attention == "hf" else (
        lambda b: {"plait_mask": MaskInfo.from_batch(vars(b), mode=mode)})
    bf16 = t.dtype == "bf16" or (t.dtype == "auto" and dev.type == "cuda")
    autocast = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    key = profile_key(model_description(cfg), batches, "bfloat16" if bf16 else "float32", dev, clock)
    return ProfileInputs(model, batches, llm_kwargs, autocast, key, {"attention": attention})


def profile_job(cfg: Any, *, store_dir: str | Path = "runs/profiles", out_path: str | Path | None = None,
                microbatches: int = 1, microbatch_size: int | None = None, repeats: int = 5, warmup: int = 2,
                clock: str = "wall", force: bool = False, out: TextIO | None = None) -> Profile:
    """Profile a job's model on its first training samples (:func:`build_profile_inputs`), reusing a stored
    profile only when its key matches (:func:`load_or_measure`).

    Args:
        cfg: a loaded ``JobConfig``.
        store_dir: profile folder; out_path: an explicit profile file (checked the same way).
        microbatches, microbatch_size: what to profile; repeats, warmup: as :func:`measure_profile`;
        clock: ``"wall"`` or ``"thread"`` (:func:`measure_profile`).
        force: re-measure even on a matching stored profile; out: where messages go (default stdout).

    Raises:
        ValueError, FileNotFoundError: as :func:`build_profile_inputs`; ValueError when the file to write
            (``out_path`` or the store's) exists and is not a plait profile (:func:`load_or_measure`).
    """
    inputs = build_profile_inputs(cfg, microbatches=microbatches, microbatch_size=microbatch_size, clock=clock)

    def measure() -> Profile:
        return measure_profile(inputs.model, inputs.microbatches, inputs.key, repeats=repeats, warmup=warmup,
                               llm_kwargs=inputs.llm_kwargs, autocast=inputs.autocast, progress=True)

    return load_or_measure(ProfileStore(store_dir), inputs.key, measure, path=out_path, force=force, out=out)


