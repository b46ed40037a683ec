"""Per-sample cost coefficients of a live model, for the microbatch planner.

FLOPs per forward pass from the Hugging Face configs (shape facts via the analytic cost model's
``arch_from_config``), scaled by the frozen-aware pass factor (forward + dX + dW, ../shared/DESIGN.md "Cost
of a unit"). Only ratios between modules and samples matter to the planner.
"""

from __future__ import annotations

from plait.models.multimodal import MultimodalModel
from plait.planner.cost_model import arch_from_config
from plait.planner.microbatch import ModuleCostCoeffs

__all__ = ["microbatch_cost_coeffs"]


def _layer_flops(arch) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per attended (query, key) pair) of one transformer layer's forward."""
    q = arch.heads * arch.head_dim
    kv = getattr(arch, "kv_heads", arch.heads) * arch.head_dim
    mats = 3 if arch.gated_mlp else 2
    per_token = 2 * (arch.hidden * q + 2 * arch.hidden * kv + q * arch.hidden) + 2 * mats * arch.hidden * arch.intermediate
    return float(per_token), float(4 * q)


def microbatch_cost_coeffs(model: MultimodalModel) -> dict[str, ModuleCostCoeffs]:
    """Cost coefficients per encoder branch and for ``"llm"``, in forward FLOPs x pass factor.

    Encoders: a vision item of ``n`` placeholders costs ``L (a n + b n^2)`` (full attention); a Whisper
    clip always fills the encoder's fixed window, so its cost is a constant per item (``fixed``). LLM: a
    sample of ``L`` tokens costs ``layers (a L + b L^2 / 2) + 2 H V L`` (causal attention, LM head).
    Trainable / needs-input-grad flags come from the parameters' ``requires_grad``.
    """
    coeffs: dict[str, ModuleCostCoeffs] = {}
    upstream_trains = False
    for name, branch in model.encoders.items():
        arch = arch_from_config(branch.encoder.config)
        per_token, per_pair = _layer_flops(arch)
        enc_trains = any(p.requires_grad for p in branch.encoder.parameters())
        trains = enc_trains or any(p.requires_grad for p in branch.projector.parameters())
        upstream_trains |= trains
        if branch.modality == "audio":
            n = arch.item_len
            fixed = arch.layers * (per_token * n + per_pair * n * n)
            coeffs[name] = ModuleCostCoeffs(linear=0.0, fixed=fixed, trainable=enc_trains, needs_input_grad=enc_trains)
        else:
            coeffs[name] = ModuleCostCoeffs(linear=arch.layers * per_token, quadratic=arch.layers * per_pair,
                                            trainable=enc_trains, needs_input_grad=enc_trains)
    llm_arch = arch_from_config(model.language_model.config)
    per_token, per_pair = _layer_flops(llm_arch)
    llm_trains = any(p.requires_grad for p in model.language_model.parameters())
    coeffs["llm"] = ModuleCostCoeffs(
        linear=llm_arch.layers * per_token + 2 * llm_arch.hidden * llm_arch.vocab,
        quadratic=llm_arch.layers * per_pair / 2,
        trainable=llm_trains,
        needs_input_grad=llm_trains or upstream_trains,
    )
    return coeffs
