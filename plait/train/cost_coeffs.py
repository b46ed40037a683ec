"""Per-sample cost coefficients of a live model, for the microbatch planner.

FLOPs per forward pass from the Hugging Face configs by the planner's one per-layer formula
(``EncoderArch`` / ``DecoderArch.layer_flops()``, MoE routing included; an encoder's facts from its family),
scaled by the frozen-aware pass factor (forward, + dX when some unit upstream trains, + dW when the unit
trains). A module with LoRA adapters (frozen base) pays only its trained share of dW, by the one rule of
``UnitCost.backward_s`` (``Unit.trained_fraction``). Only ratios between modules and samples matter to the
planner.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.models.lora import has_lora
from plait.models.multimodal import MultimodalModel
from plait.models.plan_inputs import encoder_arch, pixel_shuffle_patches
from plait.planner.cost.arch import arch_from_config
from plait.planner.pipeline.graph import ModuleFlags, consistent_units, module_flags
from plait.planner.microbatch import ModuleCostCoeffs
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = ["microbatch_cost_coeffs", "pass_work"]


def microbatch_cost_coeffs(model: MultimodalModel) -> dict[str, ModuleCostCoeffs]:
    """Cost coefficients per encoder branch and for ``"llm"``, in forward FLOPs x pass factor.

    Encoders: a vision item of ``n`` encoder tokens costs ``L (a n + b n^2)`` (full attention; window and
    per-tile attention and the tokens per placeholder of Qwen2.5-VL and InternVL: ``_vision_coeffs``); a Whisper
    clip always fills the encoder's fixed window, so its cost is a constant per item (``fixed``). LLM: a
    sample of ``L`` tokens costs ``layers (a L + b L^2 / 2) + 2 H V L`` (causal attention, LM head).
    Flags: ``trainable`` from the parameters' ``requires_grad``, ``needs_input_grad`` by the unit-graph rule
    (``planner.graph``: something at or upstream of the module trains). A LoRA module's backward pays dX and only
    its trained share ``f`` of dW (:func:`pass_work`): its coefficients are scaled by ``pass_work / pass_factor``
    (e.g. ``(2 + f) / 3``), so that ``ModuleCostCoeffs.cost`` is its forward + backward work.
    """
    flags, fractions = _module_flags(model)
    coeffs: dict[str, ModuleCostCoeffs] = {}
    for name, branch in model.encoders.items():
        arch = encoder_arch(branch.encoder.config)
        per_token, per_pair = map(float, arch.layer_flops())
        trains, needs = flags[name].trainable, flags[name].needs_input_grad
        scale = _lora_scale(flags[name], fractions[name])
        if branch.modality == "audio":
            n = arch.item_len
            fixed = arch.layers * (per_token * n + per_pair * n * n) * scale
            coeffs[name] = ModuleCostCoeffs(linear=0.0, fixed=fixed, trainable=trains, needs_input_grad=needs)
        else:
            linear, quadratic, per_feature = _vision_coeffs(arch, per_token, per_pair, branch.downsample)
            coeffs[name] = ModuleCostCoeffs(linear=linear * scale, quadratic=quadratic * scale,
                                            trainable=trains, needs_input_grad=needs,
                                            encoder_tokens_per_feature=per_feature)
    llm_arch = arch_from_config(model.language_model.config)
    per_token, per_pair = map(float, llm_arch.layer_flops())
    scale = _lora_scale(flags[LLM_MODULE], fractions[LLM_MODULE])
    coeffs[LLM_MODULE] = ModuleCostCoeffs(
        linear=(llm_arch.layers * per_token + 2 * llm_arch.hidden * llm_arch.vocab) * scale,
        quadratic=llm_arch.layers * per_pair / 2 * scale,
        trainable=flags[LLM_MODULE].trainable,
        needs_input_grad=flags[LLM_MODULE].needs_input_grad,
    )
    return coeffs


def _vision_coeffs(arch: Any, per_token: float, per_pair: float, downsample: int) -> tuple[float, float, float]:
    """``(linear, quadratic, encoder tokens per placeholder)`` of a vision tower in forward FLOPs per encoder token.
    Full attention over an item's tokens by default; Qwen2.5-VL (``arch.window``): its window layers attend at most
    ``window`` tokens each (linear), only ``arch.full_layers`` over the whole item, and 4 patches make one
    placeholder (``arch.output_pool``, the 2x2 merger); InternVL (``downsample`` is its pixel shuffle): attention
    within each tile of ``arch.item_len`` tokens (linear) and ``downsample^2`` patches per placeholder (so too a
    SigLIP tower average-pooling ``downsample x downsample`` patches, Gemma 3's, on its fixed-size images). Packed
    calls are priced per item, as their towers attend: Qwen2.5-VL's and Pixtral's (all images of a microbatch in one
    call) attend within each image and run their linear layers over all patches, so a call costs the sum of its
    images' costs (exact under flash attention's ``cu_seq_lens`` and Qwen2.5-VL's per-image split; transformers'
    eager/sdpa Pixtral masks a dense ``(sum n)^2`` score matrix instead, which no per-item price can hold)."""
    if arch.window:
        full = len(arch.full_layers)
        return (arch.layers * per_token + (arch.layers - full) * per_pair * arch.window, full * per_pair,
                float(arch.output_pool))
    if downsample > 1:  # InternVL's pixel shuffle, SigLIP's d x d average pooling (Gemma 3): fixed-size items
        return arch.layers * (per_token + per_pair * arch.item_len), 0.0, float(pixel_shuffle_patches(downsample))
    return arch.layers * per_token, arch.layers * per_pair, float(arch.output_pool)


def pass_work(flags: ModuleFlags, trainable_fraction: float = 1.0) -> float:
    """Forward + backward work of a module in forward passes, by the one rule (``UnitCost.backward_s`` with dX,
    dW = forward): ``1 + [needs_input_grad] + [trainable] * trainable_fraction``; e.g. 2.25 for a LoRA module
    whose adapters are 25% of its parameters."""
    unit = Unit("module", "m", "layer", flags.trainable, flags.needs_input_grad, trainable_fraction)
    return 1.0 + UnitCost(1.0, 1.0, 1.0).backward_s(unit)


def _lora_scale(flags: ModuleFlags, fraction: float) -> float:
    """``pass_work / pass_factor``: 1 unless the module trains only a share of its parameters (LoRA)."""
    whole = ModuleCostCoeffs(trainable=flags.trainable, needs_input_grad=flags.needs_input_grad).pass_factor
    return pass_work(flags, fraction) / whole


def _module_flags(model: MultimodalModel) -> tuple[dict[str, ModuleFlags], dict[str, float]]:
    """Per-module flags from the unit-graph rule on a coarse graph of the model (one unit per encoder, one per
    projector, one for the LLM, each ``trainable`` when any of its parameters has ``requires_grad``; coarse so that
    models without a pipeline layout, which ``models.units`` needs, get coefficients too), and per module (encoder
    without projector, LLM) the share of its parameters that train when it holds LoRA adapters (else 1)."""
    units, fractions = [], {}
    for name, branch in model.encoders.items():
        fractions[name] = _trained_share(branch.encoder)
        units.append(Unit(f"encoders.{name}.encoder", name, "layer", _trains(branch.encoder), False, fractions[name]))
        units.append(Unit(f"encoders.{name}.projector", name, "projector", _trains(branch.projector), False))
    fractions[LLM_MODULE] = _trained_share(model.language_model)
    units.append(Unit("language_model", LLM_MODULE, "layer", _trains(model.language_model), False,
                      fractions[LLM_MODULE]))
    return module_flags(consistent_units(units)), fractions


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _trained_share(module: nn.Module) -> float:
    """For a part with LoRA adapters (``models.lora.has_lora``), its parameters with ``requires_grad`` over all of
    its parameters, by count (as ``models.units`` counts a unit's); 1.0 for any other part (a fully trainable part
    whose output never reaches some parameters keeps the whole dW, as before)."""
    if not has_lora(module):
        return 1.0
    total = sum(p.numel() for p in module.parameters())
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return trained / total if trained else 1.0
