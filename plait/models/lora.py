"""LoRA adapters on the Hugging Face parts of a composite, through ``peft`` (its own layers, no copy).

:func:`apply_lora` injects ``peft``'s LoRA layers into the LLM and/or each encoder in place
(``peft.inject_adapter_in_model``, adapter name ``"default"``): an adapted ``nn.Linear`` named ``...q_proj``
becomes a ``peft`` ``lora.Linear`` under the same name, holding the old module as ``base_layer`` and the
adapters ``lora_A.default`` / ``lora_B.default``. Module names are unchanged, so plait's pipeline units
(:mod:`plait.models.units`) and stages find every unit as before; only parameter names gain ``.base_layer``
(the weight loader and the exports map them back, :func:`base_name`).

It runs on the meta-device model, before materialisation (:func:`plait.models.registry.build_model`): the
adapters are ordinary tensors of their unit, so a pipeline rank materialises only its own units' adapters, and
:mod:`plait.models.init` initialises them deterministically per module (``A`` Kaiming-uniform, ``B`` zero, as
``peft`` does, from the per-module seed), so every layout starts equal to one process.

Exports: :func:`save_adapter` writes a part's adapter in ``peft``'s own format (``adapter_config.json`` +
``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained`` on that plain Hugging Face part);
:func:`base_state_dict` gives the part's plain Hugging Face state dict, the adapters merged into the base weights
or left out.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import peft
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from plait.config.schema import LoraConfig, ModelConfig
from plait.models.families import FAMILIES
from plait.models.file_modes import share_saved_files

__all__ = [
    "ADAPTER",
    "ADAPTER_DIR",
    "DEFAULT_TARGETS",
    "adapter_key",
    "apply_lora",
    "freeze_base",
    "base_name",
    "base_state_dict",
    "has_lora",
    "initialised_summary",
    "inject_lora",
    "load_adapter",
    "lora_settings",
    "lora_targets",
    "save_adapter",
]

ADAPTER = "default"
"""The adapter name plait gives every part (``peft``'s default)."""
ADAPTER_DIR = "adapter"
"""Sub-folder of a saved part (``llm/adapter``, ``encoders/<name>/encoder/adapter``) holding its adapter."""
_PEFT_PREFIX = "base_model.model."

_DECODER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": _DECODER, "qwen2": _DECODER, "qwen2_5_vl_text": _DECODER, "qwen3": _DECODER, "qwen3_vl_text": _DECODER,
    "mistral": _DECODER, "gemma3_text": _DECODER,
    "gemma": _DECODER, "gemma2": _DECODER, "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "qwen2_5_omni_text": _DECODER,
    "qwen3_moe": _DECODER, "qwen3_vl_moe_text": _DECODER,
    "qwen3_omni_moe_text": _DECODER,
    **{t: f.lora_targets for f in FAMILIES if f.lora_targets for t in f.model_types},
}
"""Default ``target_modules`` per ``model_type``: the attention projections and the MLP projections (a MoE LLM's
fused experts hold 3-D parameters, not ``nn.Linear`` modules: its defaults adapt the attention and any dense MLP
layer; an encoder's: its family's ``lora_targets``)."""


def lora_targets(module: nn.Module, names: Collection[str], skip: Collection[str] = ()) -> list[str]:
    """Full names (in ``module``) of the ``nn.Linear`` modules whose last name component (or full name) is in ``names``, in
    module order, leaving out those whose ``weight`` is in ``skip`` (parameter names, e.g. an encoder's
    unreachable layers, which must stay parameter-free of adapters so they stay out of every unit)."""
    out = []
    for name, child in module.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(child, nn.Linear) and (short in names or name in names) and f"{name}.weight" not in skip:
            out.append(name)
    return out


def has_lora(module: nn.Module) -> bool:
    """True when ``module`` holds a ``peft`` LoRA layer."""
    return any(isinstance(m, peft.tuners.lora.LoraLayer) for m in module.modules())


def inject_lora(module: nn.Module, cfg: LoraConfig, where: str, skip: Collection[str] = ()) -> list[str]:
    """Inject LoRA adapters of ``cfg`` into the Hugging Face part ``module`` in place (on any device, meta
    included); base weights of the part are frozen, the adapters trainable. Returns the adapted module names.

    Args:
        module: a Hugging Face model (``PreTrainedModel``).
        cfg: the part's LoRA table (``cfg.r > 0``).
        where: the config path for errors (``"model.llm.lora"``).
        skip: parameter names never to adapt (:func:`lora_targets`).

    Raises:
        ValueError: when the part already holds adapters, or no module matches ``target_modules``.
    """
    if has_lora(module):
        raise ValueError(f"{where}: the part already holds LoRA adapters (from a checkpoint); merge them on export "
                         "(checkpoint.merge_lora) or drop this table")
    model_type = getattr(getattr(module, "config", None), "model_type", "")
    names = cfg.target_modules or DEFAULT_TARGETS.get(model_type, ())
    if not names:
        raise ValueError(f"{where}.target_modules: no default for model_type {model_type!r}; name the Linear "
                         f"modules to adapt (defaults exist for {sorted(DEFAULT_TARGETS)})")
    targets = lora_targets(module, names, skip)
    if not targets:
        raise ValueError(f"{where}.target_modules: no nn.Linear of the {model_type or 'model'} is named any of "
                         f"{list(names)}")
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)
    on_meta = any(p.is_meta for p in module.parameters())  # adapters then stay on meta until materialised
    peft.inject_adapter_in_model(config, module, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    freeze_base(module)
    return targets


def freeze_base(module: nn.Module) -> None:
    """Make only the adapter parameters of an adapted part trainable (its base weights frozen)."""
    for name, param in module.named_parameters():
        param.requires_grad_(".lora_" in name)


def apply_lora(model: nn.Module, cfg: ModelConfig) -> dict[str, list[str]]:
    """Inject the adapters of ``cfg`` (``model.llm.lora``, ``model.encoders.<name>.lora`` with ``r > 0``) into
    the composite ``model`` (a :class:`~plait.models.multimodal.MultimodalModel`, normally still on the meta
    device). A part that already holds adapters (a composite saved with them, ``model.pretrained``) keeps them,
    its base frozen. Projectors keep their ``requires_grad`` (``freeze_projector``). Returns, per newly adapted part
    (``"llm"`` or the encoder's name), the adapted module names inside that part.

    Raises:
        ValueError: as :func:`inject_lora`, naming the part's table.
    """
    done: dict[str, list[str]] = {}
    for part in [model.language_model, *(branch.encoder for branch in model.encoders.values())]:
        if has_lora(part):
            freeze_base(part)
    if cfg.llm.lora.r > 0:
        done["llm"] = inject_lora(model.language_model, cfg.llm.lora, "model.llm.lora")
    for name, enc in cfg.encoders.items():
        if enc.lora.r > 0 and name in model.encoders:
            branch = model.encoders[name]
            done[name] = inject_lora(branch.encoder, enc.lora, f"model.encoders.{name}.lora", branch.unreachable)
    return done


def base_name(name: str) -> str:
    """The plain Hugging Face name of a parameter or module of an adapted part (``.base_layer`` removed)."""
    return name.replace(".base_layer", "")


def adapter_key(name: str) -> str | None:
    """The key in ``peft``'s ``adapter_model.safetensors`` of the adapter parameter ``name`` of a part
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); None for a non-adapter name."""
    if ".lora_" not in name:
        return None
    return _PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".").replace(f".{ADAPTER}", "")


def initialised_summary(names: Sequence[str], shown: int = 3, other: str = "other tensor") -> str:
    """The tensors a checkpoint did not hold (so they were initialised), summarised for one log line: the LoRA
    adapter tensors (``.lora_`` in the name: new when a job adds LoRA to a pretrained model, thousands for a 7B
    LLM) and the others, each as a count and its first ``shown`` names, e.g. ``56 LoRA adapter tensors
    (model.layers.0.self_attn.q_proj.lora_A.default.weight, ... and 53 more); 2 other tensors (a, b)`` (``other``:
    what the non-adapter tensors are called)."""
    adapters = [n for n in names if ".lora_" in n]
    others = [n for n in names if ".lora_" not in n]
    parts = []
    for group, what in ((adapters, "LoRA adapter tensor"), (others, other)):
        if group:
            more = f" and {len(group) - shown} more" if len(group) > shown else ""
            plural = "s" if len(group) != 1 else ""
            parts.append(f"{len(group)} {what}{plural} ({', '.join(group[:shown])}{more})")
    return "; ".join(parts)


def lora_settings(module: nn.Module) -> dict[str, Any] | None:
    """The ``peft`` LoRA settings of an adapted part as a JSON dict (``r``, ``alpha``, ``dropout``, the adapted
    module names), or None without adapters; :func:`inject_lora` of :class:`LoraConfig` rebuilds them."""
    config = getattr(module, "peft_config", {}).get(ADAPTER)
    if config is None or not has_lora(module):
        return None
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "target_modules": sorted(config.target_modules)}


def save_adapter(module: nn.Module, directory: str | Path) -> None:
    """Write the adapter of the adapted part ``module`` in ``peft``'s format into ``directory``
    (``adapter_config.json``, ``adapter_model.safetensors``): ``peft.PeftModel.from_pretrained(plain_part,
    directory)`` loads it onto the plain Hugging Face part.

    Raises:
        ValueError: when ``module`` holds no adapter.
    """
    config = getattr(module, "peft_config", {}).get(ADAPTER)
    if config is None:
        raise ValueError("the part holds no LoRA adapter to save")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(root))
    state = {}
    for name, param in module.named_parameters():
        key = adapter_key(name)
        if key is not None:
            state[key] = param.detach().to("cpu").contiguous()
    save_file(state, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    share_saved_files(root)  # safetensors writes 0600


def load_adapter(module: nn.Module, directory: str | Path) -> None:
    """Copy the adapter weights of ``directory`` (:func:`save_adapter`) into the adapted part ``module``
    (real tensors; meta ones are skipped, for a pipeline rank that holds only some units).

    Raises:
        ValueError: when an adapter parameter of ``module`` is not in the file, or its shape differs.
    """
    stored = load_file(str(Path(directory) / "adapter_model.safetensors"))
    for name, param in module.named_parameters():
        key = adapter_key(name)
        if key is None or param.is_meta:
            continue
        if key not in stored or stored[key].shape != param.shape:
            raise ValueError(f"{directory}: adapter tensor {key} missing or of another shape than {name}")
        with torch.no_grad():
            param.copy_(stored[key])


def base_state_dict(module: nn.Module, merge: bool) -> dict[str, torch.Tensor]:
    """The plain Hugging Face state dict of an adapted part (names without ``.base_layer``, no adapter tensors):
    with ``merge`` each adapted weight is ``W + (alpha / r) B A`` (``peft``'s ``get_delta_weight``), else the
    frozen base weights themselves. The module is not changed."""
    state = {base_name(k): v for k, v in module.state_dict().items() if ".lora_" not in k}
    if merge:
        for name, layer in module.named_modules():
            if isinstance(layer, peft.tuners.lora.LoraLayer) and ADAPTER in layer.lora_A:
                key = base_name(f"{name}.base_layer.weight")
                with torch.no_grad():
                    state[key] = state[key] + layer.get_delta_weight(ADAPTER).to(state[key].dtype)
    return state

