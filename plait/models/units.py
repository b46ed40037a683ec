"""Ordered pipeline units of a composite model, with frozen-aware flags (whether a unit trains
and whether anything upstream trains: the one place costs, memory, scheduling and execution read them).

Each encoder branch gives ``[embed, layers.0..k, post-norm, projector]`` (no post-norm unit for a tower without
one; Qwen2.5-VL's patch merger takes that slot) and the LLM gives
``[embed_tokens, layers.0..n-1, norm, lm_head]``; names are fully qualified module names read from the model
through the per-family layouts of :mod:`plait.models.hf`. Encoder units whose parameters can never reach the
selected features (``ModalityEncoder.unreachable``: layers after ``feature_layer``, an unused post-norm) are
not units at all, so the chain of a branch's units computes exactly the features the branch selects. The blocks and
merger of a tower with DeepStack features (Qwen3-VL) are ``Unit.joined``: the tower's units form one stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from plait.models.encoder import ModalityEncoder
from plait.models.families.base import config_field
from plait.models.hf import encoder_layout, llm_layout
from plait.models.multimodal import MultimodalModel
from plait.planner.pipeline.graph import consistent_units
from plait.planner.types import LLM_MODULE, Unit

__all__ = ["UnitSpec", "model_units", "unit_specs"]


@dataclass(frozen=True)
class UnitSpec:
    """A pipeline unit with the modules it is made of.

    Attributes:
        unit: the planner's :class:`Unit` (name = FQN of its first module in the composite).
        modules: FQNs (in the composite) of every module of the unit, in forward order; one module except for
            multi-module embeddings (Whisper: ``conv1, conv2, embed_positions``; CLIP: ``embeddings,
            pre_layrnorm``).
        layer: index of the layer in its family's layer list, -1 for other units.
    """

    unit: Unit
    modules: tuple[str, ...]
    layer: int = -1


def model_units(model: MultimodalModel) -> tuple[Unit, ...]:
    """The ordered pipeline units of ``model``: every encoder branch (in ``model.encoders`` order), then the LLM.

    Flags (``Unit``): ``trainable`` when any reachable parameter of the unit has ``requires_grad``
    (``trainable_fraction``: the share that does, e.g. a LoRA unit's adapters);
    ``needs_input_grad`` by the unit-graph rule (``plait.planner.pipeline.graph.consistent_units``: some unit upstream
    trains, every encoder branch feeding the LLM's first unit).

    Raises:
        ValueError: for an encoder or LLM family without a pipeline layout (``plait.models.hf``).
    """
    return tuple(spec.unit for spec in unit_specs(model))


def unit_specs(model: MultimodalModel) -> tuple[UnitSpec, ...]:
    """:func:`model_units` with the modules of each unit (used to build pipeline stages).

    Raises:
        ValueError: as :func:`model_units`.
    """
    specs: list[UnitSpec] = []
    for name, branch in model.encoders.items():
        chain = _chain(model, _encoder_parts(name, branch), name)
        if config_field(branch.encoder.config, "deepstack_visual_indexes", ()):  # the tower is one stage
            chain = [dataclasses.replace(s, unit=dataclasses.replace(s.unit, joined=s.unit.kind in ("layer", "norm")))
                     for s in chain]
        specs += chain
    specs += _chain(model, _llm_parts(model), LLM_MODULE)
    units = consistent_units([spec.unit for spec in specs])
    return tuple(dataclasses.replace(spec, unit=unit) for spec, unit in zip(specs, units))


def _encoder_parts(name: str, branch: ModalityEncoder) -> list[tuple[str, tuple[str, ...], int]]:
    """``(kind, module FQNs, layer index)`` of the branch's reachable units, in order."""
    layout = encoder_layout(branch.encoder)
    prefix = f"encoders.{name}.encoder."
    n_layers = len(branch.encoder.get_submodule(layout.layers))
    parts = [("embed", _runnable(branch.encoder, layout.embed), -1)]
    parts += [("layer", (f"{layout.layers}.{i}",), i) for i in range(n_layers)]
    if layout.post_norm:  # None: a tower without a post-layer module (Pixtral)
        parts.append(("norm", (layout.post_norm,), -1))
    reachable = [p for p in parts if _reachable(branch, p[1])]
    out = [(kind, tuple(prefix + m for m in mods), i) for kind, mods, i in reachable]
    return out + [("projector", (f"encoders.{name}.projector",), -1)]


def _runnable(root: nn.Module, paths: tuple[str, ...]) -> tuple[str, ...]:
    """``paths`` with each container (a ``ModuleList`` / ``ModuleDict``, which is never called itself: Qwen3-VL's
    DeepStack mergers) replaced by its children's paths, so every module of a unit is one that runs (FSDP2 shards
    and hooks modules that run)."""
    out: list[str] = []
    for path in paths:
        module = root.get_submodule(path)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            out += [f"{path}.{name}" for name, _ in module.named_children()]
        else:
            out.append(path)
    return tuple(out)


def _reachable(branch: ModalityEncoder, modules: tuple[str, ...]) -> bool:
    """A unit is reachable when it has a parameter outside ``branch.unreachable`` (or no parameter)."""
    names = [f"{m}.{n}" for m in modules for n, _ in branch.encoder.get_submodule(m).named_parameters()]
    return not names or any(n not in branch.unreachable for n in names)


def _llm_parts(model: MultimodalModel) -> list[tuple[str, tuple[str, ...], int]]:
    layout = llm_layout(model.language_model)
    prefix = "language_model."
    n_layers = len(model.language_model.get_submodule(layout.layers))
    parts = [("embed", (prefix + layout.embed,), -1)]
    parts += [("layer", (f"{prefix}{layout.layers}.{i}",), i) for i in range(n_layers)]
    return parts + [("norm", (prefix + layout.norm,), -1), ("head", (prefix + layout.head,), -1)]


def _chain(model: MultimodalModel, parts: list[tuple[str, tuple[str, ...], int]], module: str) -> list[UnitSpec]:
    """Specs of one chain with ``trainable`` and ``trainable_fraction`` (the share of the unit's parameters, by
    count, with ``requires_grad``: below 1 for a LoRA unit) from the parameters (``needs_input_grad`` is set by the
    graph rule)."""
    specs = []
    for kind, modules, layer in parts:
        params = [p for m in modules for p in _params(model, m)]
        trained = sum(p.numel() for p in params if p.requires_grad)
        fraction = trained / sum(p.numel() for p in params) if trained else 1.0
        specs.append(UnitSpec(Unit(modules[0], module, kind, trained > 0, False, fraction), modules, layer))
    return specs


def _params(model: MultimodalModel, module: str) -> list[nn.Parameter]:
    return list(model.get_submodule(module).parameters())
