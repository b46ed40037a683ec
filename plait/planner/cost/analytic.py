"""Analytic, frozen-aware cost model: FLOPs, bytes and time of each pipeline unit from Hugging Face configs.

For models too big to profile (a 70B plan on a laptop), every unit's cost is derived from config fields
alone (``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ...); no model is built and no
weights are read. The architecture facts (the families covered, per-layer parameters and FLOPs, the units
of a config-described model) are in ``planner.arch``; this module turns them into per-unit FLOPs, bytes and
time (``unit_estimates``, ``unit_costs``) and holds the frozen-aware work and memory rules.

Conventions (all formulas below use them):

- ``H`` hidden size, ``I`` MLP intermediate size, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``,
  ``V`` vocabulary, ``E`` experts, ``k`` experts per token, ``T`` tokens of the module in the microbatch,
  ``P`` attended (query, key) pairs of one layer summed over the microbatch, ``b`` bytes per element of
  the training dtype.
- FLOPs count one multiply-accumulate as 2 FLOPs and include only matmuls and convolutions: *weight
  FLOPs* ``2 * T * MACs-per-token`` of the weight matmuls, *attention FLOPs* ``4 * P * q`` (``Q K^T``
  and ``softmax(.) V``). Elementwise work (norms, activations, softmax, rotary, residual adds, the loss)
  is counted in bytes moved instead.
- Time is a roofline on one device (``DeviceSpec``): ``t = max(FLOPs / (peak_flops * efficiency),
  bytes / hbm_bandwidth)``, separately for forward, input gradient (dX) and weight gradient (dW):
  forward ``W + A`` FLOPs, dX ``W + 2A`` FLOPs (the attention backward runs four matmuls for the
  forward's two), dW ``W`` FLOPs (attention score/value matmuls have no weights). Each backward part
  moves about the forward's bytes. Embeddings have no dX (their input is token ids, pixels or mel
  frames). Hence ``dX + dW = 2 (W + A) = 2 f`` for compute-bound units: a frozen-unaware planner that
  charges ``f + dX + dW`` weighs a fully frozen encoder 3x and a frozen LLM after a trainable projector
  ``(3W + 3A) / (2W + 3A)``, about 1.5x (Cornstarch).
- Memory of a unit: parameters (``b`` bytes each), plus
  gradients and optimizer state if trainable (``OptimizerSpec``; AdamW with fp32 master, m and v is 12
  bytes per parameter), plus saved activations per microbatch in flight if the unit runs a backward.
  Activation checkpointing (``planner.recompute.checkpointed_costs``) turns a checkpointed unit's saved
  activations into its input only and adds a forward's time to its backward (``UnitCost.recompute_s``).
  Saved activations assume fused (flash/SDPA) attention, so no ``T x T`` term; see
  ``_decoder_layer_saved`` and ``_encoder_layer_saved`` for the per-token element counts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.cost.arch import Arch, DecoderArch, EncoderArch, ProjectorArch, projector_arch, split_model_configs
from plait.planner.cost.types import DeviceSpec, MicrobatchShape, OptimizerSpec, UnitEstimate, dtype_bytes
from plait.planner.pipeline.graph import carried_features, feature_receivers
from plait.planner.types import LLM_MODULE, Unit, UnitCost

__all__ = [
    "causal_pairs",
    "full_pairs",
    "stage_work",
    "trained_params",
    "unit_activation_bytes",
    "unit_costs",
    "unit_estimates",
    "unit_memory_bytes",
    "unit_static_bytes",
    "unit_work",
    "windowed_causal_pairs",
]


# --------------------------------------------------------------------------------------------------
# Attention pairs


def causal_pairs(seq_len: int) -> int:
    """(query, key) pairs of a causal mask over ``seq_len`` tokens: ``L (L + 1) / 2``."""
    return seq_len * (seq_len + 1) // 2


def full_pairs(seq_len: int) -> int:
    """(query, key) pairs of a full (bidirectional) mask over ``seq_len`` tokens: ``L^2``."""
    return seq_len * seq_len


def windowed_causal_pairs(seq_len: int, window: int) -> int:
    """Pairs of a causal sliding-window mask where query ``i`` sees keys ``max(0, i - window + 1) .. i``:
    ``L (L + 1) / 2`` if ``L <= w``, else ``w (w + 1) / 2 + (L - w) w``.

    Raises:
        ValueError: on a non-positive ``window``.
    """
    if window <= 0:
        raise ValueError(f"sliding window must be > 0, got {window}")
    if seq_len <= window:
        return causal_pairs(seq_len)
    return causal_pairs(window) + (seq_len - window) * window


# --------------------------------------------------------------------------------------------------
# Per-unit estimates


def _estimate(params: int, weight_flops: float, attention_flops: float, io_bytes: float, saved: float,
              output: float, b: float, input_grad: bool = True, dw_bytes: float | None = None) -> UnitEstimate:
    """Assemble an estimate; forward bytes = weights read (``params b``) + activation traffic ``io_bytes``."""
    forward_bytes = params * b + io_bytes
    return UnitEstimate(params, float(weight_flops), float(attention_flops), float(forward_bytes),
                        float(forward_bytes if dw_bytes is None else dw_bytes), float(saved), float(output),
                        input_grad)


def _sequences(shape: MicrobatchShape, default_len: int) -> tuple[float, int]:
    """(number of sequences / items, tokens per sequence)."""
    length = shape.seq_len or default_len
    return shape.tokens / length, length


def _decoder_layer_io(arch: DecoderArch) -> int:
    """Elements read + written per token by one decoder layer's activations: norms ``2 H`` each, q/k/v
    projection ``H + q + 2 kv``, rotary ``2 (q + kv)``, attention ``2 q + 2 kv``, output projection
    ``q + H``, two residual adds ``3 H`` each, q/k norms ``2 (q + kv)``, MLP (gated ``2 H + 6 I``, plain
    ``2 H + 4 I``, MoE ``2 H + E + k (2 H + 6 I_e)``)."""
    h, q, kv = arch.hidden, arch.q_dim, arch.kv_dim
    attn = (h + q + 2 * kv) + 2 * (q + kv) + (2 * q + 2 * kv) + (q + h) + (2 * (q + kv) if arch.qk_norm_dim else 0)
    if arch.num_experts:
        mlp = 2 * h + arch.num_experts + arch.experts_per_token * (2 * h + 6 * arch.expert_intermediate)
    else:
        mlp = 2 * h + (6 if arch.gated_mlp else 4) * arch.intermediate
    return attn + mlp + 2 * h * arch.norms_per_layer + 6 * h


def _decoder_layer_saved(arch: DecoderArch, b: float) -> float:
    """Bytes saved for backward per token by one decoder layer (fused attention):
    ``b (norms_per_layer H + 2 H + (q + 2 kv) + q + mlp)`` + ``4 heads`` (fp32 log-sum-exp), where the
    terms are: each norm's input, the normed inputs of the attention and MLP matmuls, q/k/v, the attention
    output (input of the output projection); ``mlp`` = ``4 I`` gated (gate, act(gate), up, product),
    ``2 I`` plain (fc1 output, activation output), MoE ``k (H + 4 I_e)`` + ``4 E / b`` (fp32 router logits);
    q/k norms add their inputs ``q + kv``."""
    h, q, kv = arch.hidden, arch.q_dim, arch.kv_dim
    if arch.num_experts:
        mlp = arch.experts_per_token * (h + 4 * arch.expert_intermediate) + 4 * arch.num_experts / b
    else:
        mlp = (4 if arch.gated_mlp else 2) * arch.intermediate
    elements = arch.norms_per_layer * h + 2 * h + (q + 2 * kv) + q + mlp + (q + kv if arch.qk_norm_dim else 0)
    return b * elements + 4 * arch.heads


def _decoder_estimate(arch: DecoderArch, kind: str, layer: int, shape: MicrobatchShape, b: float) -> UnitEstimate:
    """Estimate of one LLM unit. Embedding: ``V H`` params, no FLOPs, reads ids (8 B) and copies ``H``
    rows; its dW writes a dense ``V H`` gradient. Norm: ``H`` (or ``2 H``) params, ``2 H`` elements moved.
    Head: ``V H`` weights (tied to the embedding's with ``tie_word_embeddings``: held by the embedding unit,
    ``UnitEstimate.tied_params``), ``2 T H V`` FLOPs; logits written in dtype, upcast to fp32 and log-softmaxed
    (three fp32 passes), saving ``H`` inputs and ``4 V`` bytes of fp32 log-probabilities per token."""
    t, h, v = shape.tokens, arch.hidden, arch.vocab
    if kind == "embed":
        io = t * (8 + 2 * h * b)
        return _estimate(v * h, 0, 0, io, 8 * t, t * h * b, b, input_grad=False, dw_bytes=v * h * b + io)
    if kind == "norm":
        params = h * (2 if arch.norm_bias else 1)
        return _estimate(params, 0, 0, 2 * t * h * b, t * h * b, t * h * b, b)
    if kind == "head":
        io = t * (h * b + v * b + 12 * v)
        head = _estimate(v * h + arch.head_bias * v, 2 * t * h * v, 0, io, t * (h * b + 4 * v), t * v * b, b)
        return dataclasses.replace(head, tied_params=v * h) if arch.tied_embeddings else head
    if kind != "layer":
        raise ValueError(f"an LLM has no {kind!r} unit")
    sequences, length = _sequences(shape, t)
    pairs = shape.attended_pairs if shape.attended_pairs is not None else sequences * causal_pairs(length)
    if arch.is_sliding(layer):
        pairs = min(pairs, sequences * windowed_causal_pairs(length, arch.sliding_window))
    per_token, per_pair = arch.layer_flops()
    layer = _estimate(arch.layer_params(), t * per_token, pairs * per_pair,
                      t * _decoder_layer_io(arch) * b, t * _decoder_layer_saved(arch, b), t * h * b, b)
    experts = arch.num_experts * 3 * h * arch.expert_intermediate
    return dataclasses.replace(layer, expert_params=experts) if experts else layer


def _encoder_layer_io(arch: EncoderArch) -> int:
    """Elements read + written per token by one encoder layer: norms ``2 H`` each, q/k/v ``H + 3 q``,
    attention ``4 q``, output projection ``q + H``, residual adds ``3 H`` each, layer scales ``2 H`` each,
    q/k norms ``4 q``, MLP (plain ``2 H + 4 I``, gated ``2 H + 6 I``)."""
    h, q = arch.hidden, arch.q_dim
    attn = (h + 3 * q) + 4 * q + (q + h) + (4 * q if arch.qk_norm_dim else 0)
    mlp = 2 * h + (6 if arch.gated_mlp else 4) * arch.intermediate
    return attn + mlp + 4 * h + 6 * h + (4 * h if arch.layer_scale else 0)


def _encoder_layer_saved(arch: EncoderArch, b: float) -> float:
    """Bytes saved for backward per token by one encoder layer (fused attention):
    ``b (2 H + 2 H + 3 q + q + mlp + 2 H [layer scale] + 2 q [q/k norms])`` + ``4 heads`` (fp32
    log-sum-exp); ``mlp`` = ``2 I`` plain, ``4 I`` gated (see ``_decoder_layer_saved``)."""
    h, q = arch.hidden, arch.q_dim
    mlp = (4 if arch.gated_mlp else 2) * arch.intermediate
    elements = 4 * h + 4 * q + mlp + (2 * h if arch.layer_scale else 0) + (2 * q if arch.qk_norm_dim else 0)
    return b * elements + 4 * arch.heads


def _encoder_embed(arch: EncoderArch, shape: MicrobatchShape, b: float) -> UnitEstimate:
    """Encoder embedding. Vision: each patch reads ``C p_h p_w`` pixels and writes ``H``, plus the
    position add (``3 H``) and pre-norm (``2 H``); saves the pixels (and the pre-norm input). Audio:
    ``2 mel`` input frames per output frame, conv1 output, GELU and conv2 (``2 mel + 2 H + 4 H + 3 H +
    2 H + 3 H`` elements); saves conv inputs and GELU inputs (``2 mel + 5 H``)."""
    t, h = shape.tokens, arch.hidden
    items, length = _sequences(shape, arch.item_len)
    if arch.modality == "audio":
        per_token_in, io, saved = 2 * arch.num_mel_bins, 14 * h, 5 * h
        compute_tokens = t
    else:
        per_token_in = arch.num_channels * arch.patch[0] * arch.patch[1]
        io, saved = h + 3 * h + (2 * h if arch.pre_norm else 0), (h if arch.pre_norm else 0)
        compute_tokens = max(items * (length - arch.prefix_tokens), 0.0)
    flops = 2 * compute_tokens * arch.embed_macs_per_token()
    return _estimate(arch.embed_params(), flops, 0, (compute_tokens * per_token_in + t * io) * b,
                     (compute_tokens * per_token_in + t * saved) * b, t * h * b, b, input_grad=False)


def _encoder_estimate(arch: EncoderArch, kind: str, shape: MicrobatchShape, b: float, layer: int = -1) -> UnitEstimate:
    """Estimate of one encoder unit (embeddings, a layer with ``P`` defaulting to full ``n L^2`` and at most
    ``T window`` in a window-attention layer, or the post-norm, which sees ``T / output_pool`` tokens and costs a
    merger's ``2 macs`` per output token)."""
    t, h = shape.tokens, arch.hidden
    if kind == "embed":
        return _encoder_embed(arch, shape, b)
    if kind == "norm":
        if not arch.post_norm:
            raise ValueError("this encoder has no post-norm unit")
        pooled = t / arch.output_pool
        flops = 2 * pooled * arch.norm_macs_per_token()
        out = (1 + arch.deepstack) * arch.merger[1] if arch.deepstack else h  # DeepStack: (1 + k) merger outputs
        return _estimate(arch.norm_params(), flops, 0, (t * h + pooled * out) * b, pooled * h * b, pooled * out * b, b)
    if kind != "layer":
        raise ValueError(f"an encoder has no {kind!r} unit")
    items, length = _sequences(shape, arch.item_len)
    pairs = shape.attended_pairs if shape.attended_pairs is not None else items * full_pairs(length)
    if arch.window and layer not in arch.full_layers:
        pairs = min(pairs, t * arch.window)
    per_token, per_pair = arch.layer_flops()
    return _estimate(arch.layer_params(), t * per_token, pairs * per_pair,
                     t * _encoder_layer_io(arch) * b, t * _encoder_layer_saved(arch, b), t * h * b, b)


def _projector_estimate(arch: ProjectorArch, tokens: float, b: float, deepstack: int = 0) -> UnitEstimate:
    """Projector on ``tokens`` features: ``2 T macs`` FLOPs; moves ``in + out`` (linear) or ``in + 5 out``
    (mlp) elements per token and saves ``in`` (+ ``2 out``: linear_1 output for GELU, GELU output). With
    ``deepstack = k`` the ``k`` DeepStack features of each token pass through (``2 k out`` elements moved) and leave
    with the projected one: ``(1 + k) out`` per token."""
    mlp = arch.kind == "mlp"
    io = arch.in_dim + (5 if mlp else 1) * arch.out_dim + 2 * deepstack * arch.out_dim
    saved = arch.in_dim + (2 * arch.out_dim if mlp else 0)
    return _estimate(arch.params(), 2 * tokens * arch.macs_per_token(), 0, tokens * io * b,
                     tokens * saved * b, tokens * (1 + deepstack) * arch.out_dim * b, b)


def _with_deepstack(estimates: list[UnitEstimate], units: Sequence[Unit], archs: Mapping[str, Arch],
                    shape: MicrobatchShape | Mapping[str, MicrobatchShape], b: float) -> list[UnitEstimate]:
    """The LLM units' DeepStack bytes (``planner.pipeline.graph``: feature edges). Per encoder with ``k`` receivers
    and ``v = tokens / output_pool`` visual tokens in the microbatch: a unit before receiving layers outputs, besides
    its hidden states, ``v H b`` bytes for each receiving layer after it (what a stage boundary there carries on); a
    receiving layer keeps its ``v H b`` features per microbatch in flight (as part of the stage's input) and adds
    them densely (``4 T H + v H`` elements moved)."""
    present = {u.module for u in units}
    deepstack = {m: a.deepstack for m, a in archs.items()
                 if isinstance(a, EncoderArch) and a.deepstack and m in present}
    if not deepstack or LLM_MODULE not in present:  # no receiver among these units
        return estimates
    receivers = feature_receivers(units, deepstack)
    carried = carried_features(units, receivers)
    h = archs[LLM_MODULE].hidden
    visual = {m: _shape_for(shape, m).tokens / archs[m].output_pool for m in deepstack}  # type: ignore[union-attr]
    out = list(estimates)
    for i, unit in enumerate(units):
        if unit.module != LLM_MODULE:
            continue
        extra_out = sum(n * visual[m] for m, n in carried[unit.name].items()) * h * b
        received = sum(visual[m] for m, names in receivers.items() if m in visual and unit.name in names[1:]) * h * b
        tokens = _shape_for(shape, LLM_MODULE).tokens
        io = (4 * tokens * h * b + received) if received else 0.0
        if extra_out or received:
            est = out[i]
            out[i] = dataclasses.replace(est, output_bytes=est.output_bytes + extra_out,
                                         activation_bytes=est.activation_bytes + received,
                                         forward_bytes=est.forward_bytes + io)
    return out


# --------------------------------------------------------------------------------------------------
# Model configs -> units, estimates, costs


_LAYER_INDEX = re.compile(r"(\d+)$")


def _layer_index(unit: Unit, arch: Arch) -> int:
    """Layer index of a ``layer`` unit from its name's trailing number.

    Raises:
        ValueError: when the name has no trailing index or it is out of range.
    """
    match = _LAYER_INDEX.search(unit.name)
    if match is None:
        raise ValueError(f"unit {unit.name!r}: a layer unit's name must end with its layer index")
    index = int(match.group(1))
    if index >= arch.layers:
        raise ValueError(f"unit {unit.name!r}: layer {index} out of range ({arch.layers} layers)")
    return index


def _shape_for(shape: MicrobatchShape | Mapping[str, MicrobatchShape], module: str) -> MicrobatchShape:
    if isinstance(shape, MicrobatchShape):
        return shape
    if module not in shape:
        raise ValueError(f"no MicrobatchShape for module {module!r}; given: {sorted(shape)}")
    return shape[module]


def unit_estimates(units: Sequence[Unit], model_configs: Mapping[str, Any],
                   shape: MicrobatchShape | Mapping[str, MicrobatchShape],
                   dtype: Any = "bfloat16") -> list[UnitEstimate]:
    """Device-independent FLOPs / params / bytes of each unit, in unit order.

    Args:
        units: pipeline units (``Unit.module`` is an encoder name or ``"llm"``; ``kind`` says what it is;
            a layer unit's name ends with its layer index).
        model_configs: module -> HF config (or arch), plus optional ``"<encoder>.projector"`` entries.
        shape: one ``MicrobatchShape`` for every module, or module -> shape (a projector uses its encoder's
            shape, on ``tokens / output_pool`` features).
        dtype: training dtype of parameters and activations.

    Raises:
        ValueError: on a unit whose module has no config or shape, a kind the module lacks, or a bad index.
    """
    archs, projectors = split_model_configs(model_configs)
    b = dtype_bytes(dtype)
    estimates = []
    for unit in units:
        if unit.module not in archs:
            raise ValueError(f"unit {unit.name!r}: no config for module {unit.module!r}")
        arch, mb = archs[unit.module], _shape_for(shape, unit.module)
        if unit.kind == "projector":
            if unit.module == LLM_MODULE:
                raise ValueError(f"unit {unit.name!r}: the LLM has no projector")
            proj = projector_arch(unit.module, archs, projectors)
            estimates.append(_projector_estimate(proj, mb.tokens / arch.output_pool, b,
                                                 getattr(arch, "deepstack", 0)))
        elif isinstance(arch, DecoderArch):
            layer = _layer_index(unit, arch) if unit.kind == "layer" else -1
            estimates.append(_decoder_estimate(arch, unit.kind, layer, mb, b))
        else:
            layer = _layer_index(unit, arch) if unit.kind == "layer" else -1
            estimates.append(_encoder_estimate(arch, unit.kind, mb, b, layer))
    return _with_deepstack(estimates, units, archs, shape, b)


def unit_costs(units: Sequence[Unit], model_configs: Mapping[str, Any],
               shape: MicrobatchShape | Mapping[str, MicrobatchShape], device: DeviceSpec,
               dtype: Any = "bfloat16") -> list[UnitCost]:
    """``UnitCost`` of each unit on ``device`` (roofline, see the module docstring), in unit order.

    The costs do not depend on the units' flags: ``UnitCost.backward_s`` and the memory helpers apply
    them. Raises ``ValueError`` as ``unit_estimates``.
    """
    return [est.to_cost(device, dtype) for est in unit_estimates(units, model_configs, shape, dtype)]


# --------------------------------------------------------------------------------------------------
# Frozen-aware work and memory


def _check_lengths(units: Sequence[Unit], costs: Sequence[UnitCost]) -> None:
    if len(units) != len(costs):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")


def unit_work(units: Sequence[Unit], costs: Sequence[UnitCost], frozen_aware: bool = True) -> list[float]:
    """Per-unit work (s) for one microbatch: ``forward_s + backward_s(unit, frozen_aware)``.

    ``frozen_aware=False`` charges ``dX + dW`` everywhere (about ``2 f``), the frozen-unaware model.

    Raises:
        ValueError: when the lengths differ.
    """
    _check_lengths(units, costs)
    return [c.forward_s + c.backward_s(u, frozen_aware) for u, c in zip(units, costs)]


def stage_work(units: Sequence[Unit], costs: Sequence[UnitCost], frozen_aware: bool = True) -> float:
    """Work (s) of a stage holding ``units``: ``sum(unit_work(units, costs, frozen_aware))``."""
    return math.fsum(unit_work(units, costs, frozen_aware))


def unit_static_bytes(unit: Unit, cost: UnitCost, dtype: Any = "bfloat16",
                      optimizer: OptimizerSpec = OptimizerSpec(), frozen_aware: bool = True) -> float:
    """Memory (bytes) a unit holds whatever the microbatches in flight: ``param_bytes`` plus, if it trains
    (or ``frozen_aware`` is False), ``(param_bytes / b) (grad_bytes_per_param + state_bytes_per_param)`` times the
    share of its parameters that train (``Unit.trained_fraction``: a LoRA unit's adapters only)."""
    if not (unit.trainable or not frozen_aware):
        return float(cost.param_bytes)
    share = unit.trained_fraction if frozen_aware else 1.0
    return cost.param_bytes + cost.param_bytes * share / dtype_bytes(dtype) * (optimizer.grad_bytes(dtype)
                                                                             + optimizer.state_bytes_per_param)


def trained_params(unit: Unit, cost: UnitCost, dtype: Any = "bfloat16") -> float:
    """Parameters of ``unit`` with a gradient and optimizer state (of one rank when ``cost`` is a rank's):
    ``param_bytes / dtype_bytes(dtype) x Unit.trained_fraction`` (0 when frozen; a LoRA unit's adapters)."""
    return cost.param_bytes * unit.trained_fraction / dtype_bytes(dtype)


def unit_activation_bytes(unit: Unit, cost: UnitCost, frozen_aware: bool = True) -> float:
    """Saved-activation bytes per microbatch in flight: ``activation_bytes`` if the unit runs a backward
    (or ``frozen_aware`` is False), else 0 (it runs under ``no_grad``)."""
    return float(cost.activation_bytes) if (unit.runs_backward or not frozen_aware) else 0.0


def unit_memory_bytes(unit: Unit, cost: UnitCost, in_flight: float = 1, dtype: Any = "bfloat16",
                      optimizer: OptimizerSpec = OptimizerSpec(), frozen_aware: bool = True) -> float:
    """Peak memory (bytes) of a unit with ``in_flight`` microbatches' activations kept:
    ``unit_static_bytes + in_flight * unit_activation_bytes``.

    Raises:
        ValueError: on a negative ``in_flight``.
    """
    if in_flight < 0:
        raise ValueError(f"in_flight must be >= 0, got {in_flight}")
    return (unit_static_bytes(unit, cost, dtype, optimizer, frozen_aware)
            + in_flight * unit_activation_bytes(unit, cost, frozen_aware))
