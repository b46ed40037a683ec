"""Deterministic per-module initialisation and meta-device materialisation of a composite model.

A pipeline rank builds the whole composite on the meta device (no memory, no init work), then materialises
only the tensors of the units it owns. For the result to equal the single-process model, every tensor's value
must not depend on which other tensors exist. plait therefore initialises module by module, each with its own
random stream:

- modules are visited in post-order (children first, as ``PreTrainedModel.initialize_weights`` does), and
  each module ``m`` with a tensor to initialise in its subtree runs its own init with the RNG forked and
  seeded from ``(seed, FQN of m)`` (:func:`module_seed`);
- a module inside a Hugging Face model runs the nearest enclosing ``PreTrainedModel``'s ``_init_weights(m)``
  (the per-module hook transformers 5 dispatches from ``initialize_weights``; it also recomputes non-persistent
  buffers such as rotary ``inv_freq`` and position ids); other modules (projectors) run
  ``m.reset_parameters()`` when they have one;
- tensors that must keep their value (not selected, or still on the meta device) carry transformers'
  ``_is_hf_initialized`` flag during the pass, so the guarded init functions
  (``transformers.initialization.guard_torch_init_functions``) leave them alone.

Initialising runs on the CPU whatever the target device, so values depend only on ``(seed, FQN)``, not on the
device or on which parts a rank holds. Limitation: the equality needs every init that draws random numbers to
touch tensors of one pipeline unit only (true for the families of :mod:`plait.models.hf`: containers spanning
units only copy deterministic values, like Whisper's sinusoidal positions); the unit tests check it per family.

Pretrained parts are then overwritten from their safetensors files (:class:`WeightSource`), reading only the
keys of the materialised tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel
from transformers.initialization import guard_torch_init_functions

from plait.config.schema import ModelConfig
from plait.models.lora import ADAPTER_DIR, adapter_key, initialised_summary

__all__ = [
    "module_seed",
    "init_weights",
    "materialize",
    "meta_tensor_names",
    "computed_buffer_names",
    "rank_prefixes",
    "PartSource",
    "WeightSource",
    "weight_source",
]

log = logging.getLogger(__name__)

_FLAG = "_is_hf_initialized"
_MISSING = object()


def module_seed(seed: int, fqn: str) -> int:
    """The seed (63 bits) of module ``fqn``'s random stream: SHA-256 of ``"<seed>/<fqn>"``."""
    digest = hashlib.sha256(f"{int(seed)}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tensors(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[str]]]:
    """Every parameter and buffer once (by identity) with all its FQNs (tied weights have several)."""
    out: dict[int, tuple[torch.Tensor, list[str]]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        out.setdefault(id(tensor), (tensor, []))[1].append(name)
    return out


def computed_buffer_names(model: nn.Module) -> set[str]:
    """FQNs of the non-persistent buffers of ``model`` (rotary ``inv_freq``, position ids): values its init
    computes, which no checkpoint needs to hold."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None}


def meta_tensor_names(model: nn.Module) -> list[str]:
    """FQNs of the parameters and buffers of ``model`` still on the meta device (first FQN of tied ones)."""
    return [names[0] for tensor, names in _tensors(model).values() if tensor.is_meta]


def _post_order(module: nn.Module, prefix: str, owner: PreTrainedModel | None, seen: set[int]
                ) -> Iterator[tuple[str, nn.Module, PreTrainedModel | None]]:
    """``(FQN, module, init owner)`` children first; the owner is the nearest enclosing ``PreTrainedModel``."""
    seen.add(id(module))
    owner = module if isinstance(module, PreTrainedModel) else owner
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, owner, seen)
    yield prefix, module, owner


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


def _run_init(module: nn.Module, owner: PreTrainedModel | None) -> None:
    if hasattr(module, "reset_lora_parameters"):  # a peft LoRA layer (plait.models.lora): A Kaiming, B zero
        for adapter in module.lora_A:
            module.reset_lora_parameters(adapter, True)
    elif owner is not None:
        owner._init_weights(module)
    elif _own_tensors(module) and hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _seed_name(fqn: str) -> str:
    """The FQN a module's random stream is seeded from: a LoRA-wrapped module's ``base_layer`` keeps the name
    of the module it was before wrapping, so adapted and plain models draw equal base weights."""
    return fqn.replace(".base_layer", "")


def init_weights(model: nn.Module, seed: int, tensors: Collection[torch.Tensor] | None = None) -> None:
    """Initialise ``tensors`` of ``model`` (default: every tensor not on the meta device) in place with the
    deterministic per-module scheme of the module docstring: a tensor's value depends only on ``seed`` and the
    FQNs of the modules whose init touches it, not on the rest of the model.

    Args:
        model: any module tree (a :class:`~plait.models.multimodal.MultimodalModel`, a HF model, ...).
        seed: the base seed (e.g. ``train.seed``).
        tensors: the tensors to (re)initialise, all real (not meta); others keep their values.

    Raises:
        ValueError: when a tensor to initialise is on the meta device.
    """
    every = _tensors(model)
    chosen = {id(t) for t in tensors} if tensors is not None else {i for i, (t, _) in every.items() if not t.is_meta}
    bad = [names[0] for i, (t, names) in every.items() if i in chosen and t.is_meta]
    if bad:
        raise ValueError(f"cannot initialise tensors on the meta device: {bad[:5]}")
    saved = {i: getattr(t, _FLAG, _MISSING) for i, (t, _) in every.items()}
    below: dict[int, bool] = {}  # module id -> a chosen tensor in its subtree
    try:
        for i, (t, _) in every.items():
            setattr(t, _FLAG, i not in chosen)
        with torch.no_grad(), guard_torch_init_functions():
            for fqn, module, owner in _post_order(model, "", None, set()):
                below[id(module)] = any(id(t) in chosen for t in _own_tensors(module)) or any(
                    below.get(id(c), False) for c in module.children())
                if below[id(module)]:
                    with torch.random.fork_rng(devices=[]):
                        torch.default_generator.manual_seed(module_seed(seed, _seed_name(fqn)))  # CPU only
                        _run_init(module, owner)
    finally:
        for i, (t, _) in every.items():
            if saved[i] is _MISSING:
                delattr(t, _FLAG)
            else:
                setattr(t, _FLAG, saved[i])


def _under(name: str, prefixes: Collection[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _swap_in(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``tensor`` (a parameter or buffer object) the storage of ``value``, keeping its identity (so
    ties, ``requires_grad`` and references held elsewhere stay valid)."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    flags = dict(vars(tensor))
    torch.utils.swap_tensors(tensor, value)
    for key, val in flags.items():
        setattr(tensor, key, val)


def _sentinel(tensor: torch.Tensor) -> torch.Tensor:
    """An empty CPU copy filled with a value no init leaves (NaN, or the integer minimum)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    return out.fill_(torch.iinfo(out.dtype).min if out.dtype != torch.bool else False)


def _unset(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return tensor.dtype != torch.bool and bool((tensor == torch.iinfo(tensor.dtype).min).any())


def materialize(
    model: nn.Module,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    keep: Collection[str] | None = None,
    source: "WeightSource | None" = None,
) -> list[str]:
    """Materialise the meta tensors of ``model`` under the module/tensor FQN prefixes ``keep`` (all when
    None) on ``device``, in place: allocate on the CPU, :func:`init_weights` with ``seed``, overwrite the ones
    ``source`` stores, move to ``device``. Tensors outside ``keep`` stay on the meta device (prune them, e.g.
    with ``plait.parallel.stages.build_rank_stages``). Parameter objects keep their identity (tied weights stay
    tied, ``requires_grad`` flags stay). Peak CPU memory: the materialised tensors once.

    Args:
        model: a model built on the meta device (``build_model(..., device="meta")``).
        device: where the tensors end up.
        seed: base seed of the per-module init (default ``torch.initial_seed()``, the last ``manual_seed``).
        keep: FQN prefixes (modules or tensors) to materialise; a tied tensor is kept if any of its FQNs is.
        source: pretrained weights to load (:func:`weight_source`), or None for random init only.

    Returns:
        The FQNs of the materialised tensors, in model order (every name of a tied tensor).

    Raises:
        ValueError: when a materialised tensor is left uninitialised (its model's init does not cover it and
            no checkpoint holds it), or a stored tensor's shape differs.
    """
    seed = torch.initial_seed() if seed is None else int(seed)
    chosen = [(t, names) for t, names in _tensors(model).values()
              if t.is_meta and (keep is None or any(_under(n, keep) for n in names))]
    for tensor, _ in chosen:
        _swap_in(tensor, _sentinel(tensor))
    init_weights(model, seed, [t for t, _ in chosen])
    if source is not None:
        source.load(chosen, computed_buffer_names(model))
    unset = [names[0] for t, names in chosen if _unset(t)]
    if unset:
        raise ValueError(f"tensors not initialised by their model's init nor found in a checkpoint: {unset[:8]}")
    if torch.device(device) != torch.device("cpu"):
        for tensor, _ in chosen:
            _swap_in(tensor, tensor.detach().to(device))
    return [name for _, names in chosen for name in names]


def rank_prefixes(model: nn.Module, units: Collection[str]) -> list[str]:
    """The FQN prefixes a pipeline rank owning ``units`` (unit names, ``plait.models.units``) must materialise:
    the modules of those units plus the LLM tensors in no unit (e.g. rotary ``inv_freq``, which every LLM stage
    computes with). Encoder modules in no unit (pooling heads, unreachable layers) are left out: the stage
    builder prunes them.

    Raises:
        ValueError: when a name is not a unit of ``model``.
    """
    from plait.models.units import unit_specs  # units imports the planner; keep this module light

    specs = unit_specs(model)
    unknown = sorted(set(units) - {s.unit.name for s in specs})
    if unknown:
        raise ValueError(f"not pipeline units of the model: {unknown[:5]}")
    prefixes = [m for s in specs if s.unit.name in units for m in s.modules]
    llm_units = [m for s in specs for m in s.modules if m.startswith("language_model.")]
    for tensor, names in _tensors(model).values():
        llm_names = [n for n in names if n.startswith("language_model.")]
        if llm_names and not any(_under(n, llm_units) for n in names):
            prefixes.append(llm_names[0])
    return prefixes


# ---------------------------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class PartSource:
    """Where one part of the composite is stored.

    Attributes:
        prefix: FQN prefix of the part in the composite (``"language_model."``, ``"encoders.vision.encoder."``,
            ``"encoders.vision.projector."``).
        files: its safetensors files (a ``save_pretrained`` directory's shards, or one file).
        base_prefix: the part's ``base_model_prefix`` plus a dot (``"model."``) or ``""``; a stored key may lack
            it (a base model's checkpoint loaded into a model with a head), as ``from_pretrained`` allows.
        adapter: the files are a LoRA adapter in ``peft``'s format (``plait.models.lora.save_adapter``): only
            adapter tensors are looked up, under ``plait.models.lora.adapter_key``.
    """

    prefix: str
    files: tuple[str, ...]
    base_prefix: str = ""
    adapter: bool = False


def _safetensors_files(directory: str | Path) -> tuple[str, ...]:
    """The safetensors files of a Hugging Face directory (sharded or not).

    Raises:
        ValueError: when it holds no safetensors weights (e.g. only ``pytorch_model.bin``).
    """
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return tuple(str(root / s) for s in shards)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root} has no safetensors weights; save it with save_pretrained (safetensors)")
    return tuple(str(f) for f in files)


class WeightSource:
    """Reads selected tensors of pretrained parts from safetensors files (only the keys asked for).

    A composite FQN ``prefix + local`` is looked up as ``local``, as ``stored_prefix + local`` where
    ``stored_prefix`` is the one prefix that makes the part's stored keys match its local names (a full Whisper
    checkpoint stores its encoder under ``model.encoder.``), or as ``local`` without ``base_prefix``.
    """

    def __init__(self, parts: Sequence[PartSource]) -> None:
        self.parts = list(parts)
        self._keys: dict[tuple[str, bool], dict[str, str]] = {}  # (part prefix, adapter) -> stored key -> file
        self._shift: dict[str, list[str]] = {}  # part prefix -> [stored prefix] once known

    def _stored(self, part: PartSource) -> dict[str, str]:
        if (part.prefix, part.adapter) not in self._keys:
            keys: dict[str, str] = {}
            for file in part.files:
                with safe_open(file, framework="pt") as f:
                    keys.update((k, file) for k in f.keys())
            self._keys[part.prefix, part.adapter] = keys
        return self._keys[part.prefix, part.adapter]

    def _resolve(self, part: PartSource, local: str, stored: dict[str, str]) -> str | None:
        shift = self._shift.setdefault(part.prefix, [])
        candidates = [s + local for s in shift] or [local]
        if part.base_prefix and local.startswith(part.base_prefix):
            candidates.append(local[len(part.base_prefix):])
        found = next((c for c in candidates if c in stored), None)
        if not shift and found == local:
            shift.append("")
        elif found is None and not shift:  # the stored prefix is not known yet: find it from a unique suffix
            ends = [k for k in stored if k.endswith("." + local)]
            if len(ends) == 1:
                shift.append(ends[0][: -len(local)])
                found = ends[0]
        return found

    def locate(self, names: Sequence[str]) -> tuple[str, str] | None:
        """``(file, stored key)`` of the tensor with FQNs ``names`` (any alias), or None when not stored."""
        names = [_seed_name(n) for n in names]  # a LoRA-wrapped weight is stored under its plain name
        for part in self.parts:
            stored = self._stored(part)
            for name in names:
                if name.startswith(part.prefix):
                    local = name[len(part.prefix):]
                    if part.adapter:
                        key = adapter_key(local)
                        key = key if key in stored else None
                    else:
                        key = self._resolve(part, local, stored)
                    if key is not None:
                        return stored[key], key
        return None

    def load(self, tensors: Sequence[tuple[torch.Tensor, Sequence[str]]], computed: Collection[str] = ()
             ) -> list[str]:
        """Copy the stored value of each ``(tensor, FQNs)`` into the (real, CPU) tensor; returns the FQNs of
        the tensors of a pretrained part that no file holds (they keep their init).

        Logs what no file holds apart: LoRA adapters (INFO: new when a job adds LoRA to a pretrained model) and
        other weights (WARNING: the checkpoint lacks a parameter or stored buffer of the model, left at its random
        init). Tensors named in ``computed`` (non-persistent buffers, :func:`computed_buffer_names`) are computed
        by the model's init and never reported.

        Raises:
            ValueError: when a stored tensor's shape differs from the model's.
        """
        by_file: dict[str, list[tuple[torch.Tensor, str, str]]] = {}
        missing = []
        for tensor, names in tensors:
            hit = self.locate(names)
            if hit is not None:
                by_file.setdefault(hit[0], []).append((tensor, hit[1], names[0]))
            elif self._fused_experts(tensor, names):
                continue
            elif any(n.startswith(p.prefix) for p in self.parts for n in names):
                missing.append(names[0])
        for file, items in by_file.items():
            with safe_open(file, framework="pt") as f:
                for tensor, key, name in items:
                    value = f.get_tensor(key)
                    if value.shape != tensor.shape:
                        raise ValueError(f"{file}: {key} has shape {tuple(value.shape)}, the model's {name} "
                                         f"{tuple(tensor.shape)}")
                    with torch.no_grad():
                        tensor.copy_(value)
        computed = set(computed)
        adapters = [n for n in missing if ".lora_" in n]
        weights = [n for n in missing if ".lora_" not in n and n not in computed]
        if adapters:
            log.info("not in the checkpoint (initialised): %s", initialised_summary(adapters))
        if weights:
            log.warning("weights missing from the checkpoint, left at their random init: %s",
                        initialised_summary(weights, other="tensor"))
        return missing

    def _fused_experts(self, tensor: torch.Tensor, names: Sequence[str]) -> bool:
        """Fill a MoE layer's fused expert weight (``...experts.gate_up_proj`` ``[E, 2I, H]``, ``...experts.down_proj``
        ``[E, H, I]``) from the per-expert tensors ``save_pretrained`` writes (``...experts.<e>.gate_proj.weight``,
        ``up_proj``, ``down_proj``; transformers' ``qwen2_moe`` conversion: expert ``e``'s gate rows then its up rows).
        Returns whether it was stored that way.

        Raises:
            ValueError: when the stored experts do not make the model's shape.
        """
        name = names[0]
        fused = name.rsplit(".", 1)[-1]
        if tensor.dim() != 3 or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return False
        base = name[: -len(fused)]
        parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        hits = [[self.locate([f"{base}{e}.{part}.weight"]) for part in parts] for e in range(tensor.shape[0])]
        if any(h is None for expert in hits for h in expert):
            return False
        with ExitStack() as stack:  # each shard file opened once for all of the layer's experts
            files = {file: stack.enter_context(safe_open(file, framework="pt"))
                     for expert in hits for file, _ in expert}
            value = torch.stack([torch.cat([files[file].get_tensor(key) for file, key in expert], dim=0)
                                 for expert in hits])
        if value.shape != tensor.shape:
            raise ValueError(f"the stored experts of {base.rstrip('.')} make {tuple(value.shape)}, the model's {name} "
                             f"{tuple(tensor.shape)}")
        with torch.no_grad():
            tensor.copy_(value)
        return True


def weight_source(cfg: ModelConfig, model: nn.Module) -> WeightSource | None:
    """The pretrained weights of ``cfg`` for ``model`` (built from ``cfg``): a plait composite
    (``cfg.pretrained``: ``llm/``, ``encoders/<name>/encoder/``, ``encoders/<name>/projector.safetensors``) or
    the local Hugging Face directories of ``cfg.llm.path`` / ``cfg.encoders[*].path``; None when every part is
    built from a config (random init only).

    Raises:
        ValueError: when a directory holds no safetensors weights.
    """
    def base(module: nn.Module) -> str:
        prefix = getattr(module, "base_model_prefix", "")
        return f"{prefix}." if prefix and hasattr(module, prefix) else ""

    parts: list[PartSource] = []
    llm = model.language_model
    if cfg.pretrained:
        root = Path(cfg.pretrained)
        parts.append(PartSource("language_model.", _safetensors_files(root / "llm"), base(llm)))
        for name, branch in model.encoders.items():
            sub = root / "encoders" / name
            parts.append(PartSource(f"encoders.{name}.encoder.", _safetensors_files(sub / "encoder"),
                                    base(branch.encoder)))
            parts.append(PartSource(f"encoders.{name}.projector.", (str(sub / "projector.safetensors"),)))
        parts += _adapter_parts(root)
        return WeightSource(parts)
    if cfg.llm.path:
        parts.append(PartSource("language_model.", _safetensors_files(cfg.llm.path), base(llm)))
    for name, enc in cfg.encoders.items():
        if enc.path:
            encoder = model.encoders[name].encoder
            parts.append(PartSource(f"encoders.{name}.encoder.", _safetensors_files(enc.path), base(encoder)))
    return WeightSource(parts) if parts else None


def _adapter_parts(root: Path) -> list[PartSource]:
    """The LoRA adapters a plait composite was saved with (``<part>/adapter/``), as weight sources."""
    out = []
    for prefix, folder in [("language_model.", root / "llm"),
                           *((f"encoders.{d.name}.encoder.", d / "encoder") for d in sorted((root / "encoders").glob("*")))]:
        file = folder / ADAPTER_DIR / "adapter_model.safetensors"
        if file.is_file():
            out.append(PartSource(prefix, (str(file),), adapter=True))
    return out
