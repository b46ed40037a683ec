"""Per-sample cost coefficients of a live model, for the microbatch planner.

FLOPs per forward pass from the Hugging Face configs by the planner's one per-layer formula
(``arch_from_config(...).layer_flops()``, MoE routing included), scaled by the frozen-aware pass factor
(forward + dX + dW, ../shared/DESIGN.md "Cost of a unit"). Only ratios between modules and samples matter to the planner.
"""

from __future__ import annotations

from torch import nn

from plait.models.multimodal import MultimodalModel
from plait.planner.arch import arch_from_config
from plait.planner.graph import ModuleFlags, consistent_units, module_flags
from plait.planner.microbatch import ModuleCostCoeffs
from plait.planner.types import LLM_MODULE, Unit

__all__ = ["microbatch_cost_coeffs"]


def microbatch_cost_coeffs(model: MultimodalModel) -> dict[str, ModuleCostCoeffs]:
    """Cost coefficients per encoder branch and for ``"llm"``, in forward FLOPs x pass factor.

    Encoders: a vision item of ``n`` placeholders costs ``L (a n + b n^2)`` (full attention); a Whisper
    clip always fills the encoder's fixed window, so its cost is a constant per item (``fixed``). LLM: a
    sample of ``L`` tokens costs ``layers (a L + b L^2 / 2) + 2 H V L`` (causal attention, LM head).
    Flags: ``trainable`` from the parameters' ``requires_grad``, ``needs_input_grad`` by the unit-graph rule
    (``planner.graph``: something at or upstream of the module trains).
    """
    flags = _module_flags(model)
    coeffs: dict[str, ModuleCostCoeffs] = {}
    for name, branch in model.encoders.items():
        arch = arch_from_config(branch.encoder.config)
        per_token, per_pair = map(float, arch.layer_flops())
        trains, needs = flags[name].trainable, flags[name].needs_input_grad
        if branch.modality == "audio":
            n = arch.item_len
            fixed = arch.layers * (per_token * n + per_pair * n * n)
            coeffs[name] = ModuleCostCoeffs(linear=0.0, fixed=fixed, trainable=trains, needs_input_grad=needs)
        else:
            coeffs[name] = ModuleCostCoeffs(linear=arch.layers * per_token, quadratic=arch.layers * per_pair,
                                            trainable=trains, needs_input_grad=needs)
    llm_arch = arch_from_config(model.language_model.config)
    per_token, per_pair = map(float, llm_arch.layer_flops())
    coeffs[LLM_MODULE] = ModuleCostCoeffs(
        linear=llm_arch.layers * per_token + 2 * llm_arch.hidden * llm_arch.vocab,
        quadratic=llm_arch.layers * per_pair / 2,
        trainable=flags[LLM_MODULE].trainable,
        needs_input_grad=flags[LLM_MODULE].needs_input_grad,
    )
    return coeffs


def _module_flags(model: MultimodalModel) -> dict[str, ModuleFlags]:
    """Per-module flags from the unit-graph rule on a coarse graph of the model: one unit per encoder, one per
    projector, one for the LLM, each ``trainable`` when any of its parameters has ``requires_grad``. (Coarse so
    that models without a pipeline layout, which ``models.units`` needs, get coefficients too.)"""
    units = []
    for name, branch in model.encoders.items():
        units.append(Unit(f"encoders.{name}.encoder", name, "layer", _trains(branch.encoder), False))
        units.append(Unit(f"encoders.{name}.projector", name, "projector", _trains(branch.projector), False))
    units.append(Unit("language_model", LLM_MODULE, "layer", _trains(model.language_model), False))
    return module_flags(consistent_units(units))


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
