"""Plan data shared by every planner: pipeline units and their costs.

Everything here is a frozen dataclass that round-trips through JSON (``to_dict`` / ``from_dict`` from
``serialize.JsonDataclass``), so plans can be cached on disk, compared in tests and read by the runtime,
the simulator and the plots alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from plait.planner.serialize import JsonDataclass

__all__ = ["LLM_MODULE", "Unit", "UnitCost"]

LLM_MODULE = "llm"
"""``Unit.module`` of the language model's units; every other module is an encoder branch feeding it."""
UNIT_KINDS = ("embed", "layer", "norm", "projector", "head")


@dataclass(frozen=True)
class Unit(JsonDataclass):
    """One pipeline unit: the smallest piece of a model a stage boundary may fall around.

    Attributes:
        name: fully qualified module name inside the composite model, e.g.
            ``"encoders.vision.encoder.vision_model.encoder.layers.3"``.
        module: the model part the unit belongs to: an encoder name (``"vision"``, ``"audio"``) or ``"llm"``.
        kind: one of ``"embed"``, ``"layer"``, ``"norm"``, ``"projector"``, ``"head"``.
        trainable: the unit owns at least one parameter with ``requires_grad``: its backward computes a
            weight gradient (dW) and it needs gradient and optimizer-state memory.
        needs_input_grad: some unit upstream of this one (in its own chain or in a chain feeding it) is
            trainable, so the gradient must flow through this unit's input (dX) and its activations must
            be kept. A unit with neither flag runs forward only, under ``torch.no_grad``
           .
        trainable_fraction: the share (0-1] of the unit's parameters, by count, that train when it is
            ``trainable``: 1 for a fully trainable unit; the adapters' parameters over all of the unit's for a
            LoRA unit (frozen base + adapters, :attr:`adapter`), whose dW work, gradients and optimizer state
            are that share of a full unit's (its dX through the frozen base is whole).
        joined: the unit stays in the stage of the unit before it (no stage boundary right before it): the units
            of a Qwen3-VL tower, whose DeepStack mergers read blocks inside it.

    Raises:
        ValueError: on an unknown ``kind``, an empty ``name``/``module`` or a fraction outside (0, 1].
    """

    name: str
    module: str
    kind: str
    trainable: bool
    needs_input_grad: bool
    trainable_fraction: float = 1.0
    joined: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.module:
            raise ValueError(f"Unit needs a non-empty name and module, got {self.name!r}/{self.module!r}")
        if not 0 < self.trainable_fraction <= 1:
            raise ValueError(f"Unit {self.name!r}: trainable_fraction must be in (0, 1], got "
                             f"{self.trainable_fraction}")
        if self.kind not in UNIT_KINDS:
            raise ValueError(f"Unit {self.name!r}: kind must be one of {UNIT_KINDS}, got {self.kind!r}")

    @property
    def runs_backward(self) -> bool:
        """True when the unit's backward does any work (dX, dW or both)."""
        return self.trainable or self.needs_input_grad

    @property
    def adapter(self) -> bool:
        """True for a LoRA unit: it trains, but only a share of its parameters (a frozen base with adapters)."""
        return self.trainable and self.trainable_fraction < 1

    @property
    def trained_fraction(self) -> float:
        """The share of the unit's parameters with a gradient and optimizer state: 0 when it does not train."""
        return self.trainable_fraction if self.trainable else 0.0


@dataclass(frozen=True)
class UnitCost(JsonDataclass):
    """Measured or modelled cost of one unit for one microbatch shape.

    Times are seconds, memory is bytes. ``input_grad_s`` is the dX part of the backward, ``weight_grad_s``
    the dW part; a planner decides which of them apply from the unit's flags (``backward_s``).

    Attributes:
        forward_s: forward time (s).
        input_grad_s: time of the input-gradient backward (s), paid when ``needs_input_grad``.
        weight_grad_s: time of the weight-gradient backward of all the unit's parameters (s); a unit pays
            ``weight_grad_s * unit.trained_fraction`` (all of it when fully trainable, the adapters' share for
            a LoRA unit, nothing when frozen).
        param_bytes: parameter memory (bytes).
        activation_bytes: memory of the activations the forward saves for backward (bytes).
        output_bytes: size of the unit's output tensor (bytes), i.e. what a stage boundary after it sends.
        recompute_s: extra forward time (s) its backward pays when the unit is activation-checkpointed (its
            forward runs again before its backward; 0 when not checkpointed; ``planner.recompute``).
        expert_param_bytes: of ``param_bytes``, those of a mixture-of-experts layer's routed experts, which
            expert parallelism divides over its ranks (``cost.experts``; 0: none).
        split_input_grad_s, split_weight_grad_s: the runtime's split backward of zero-bubble schedules (Qi et al.,
            ICLR 2024, section 2; ``plait.parallel.pipeline.split_backward``), measured: ``B`` (dX, keeping the
            gradients at the weights' intermediates) and ``W`` (the weights' gradients from those, a backward of
            its own, dearer than the fused backward's extra over dX). None (modelled costs, older profiles): a
            split schedule charges dX and dW (:meth:`split_backward_s`). Cost transforms map them as they map
            dX and dW (:meth:`split_mapped`).
    """

    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    param_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    recompute_s: float = 0.0
    expert_param_bytes: int = 0
    split_input_grad_s: float | None = None
    split_weight_grad_s: float | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise ValueError(f"UnitCost.{field.name} must be >= 0, got {value}")
        if (self.split_input_grad_s is None) != (self.split_weight_grad_s is None):
            raise ValueError("UnitCost: split_input_grad_s and split_weight_grad_s are given together or not at all")
        if self.expert_param_bytes > self.param_bytes:
            raise ValueError(f"UnitCost.expert_param_bytes ({self.expert_param_bytes}) exceeds param_bytes "
                             f"({self.param_bytes})")

    def split_backward_s(self, unit: Unit) -> tuple[float, float]:
        """``(B, W)`` seconds of ``unit`` under a split-backward schedule, on a stage whose input needs a gradient
        (recomputation apart): the measured split ``B`` and the trained share of the split ``W`` for a unit that
        needs an input gradient and trains; else, and without split fields, dX where it needs an input gradient
        and its trained share of dW (a frozen unit's ``B`` keeps no gradient for weights: plain dX)."""
        if self.split_input_grad_s is not None and unit.needs_input_grad and unit.trainable:
            return self.split_input_grad_s, (self.split_weight_grad_s or 0.0) * unit.trained_fraction
        return (self.input_grad_s if unit.needs_input_grad else 0.0), self.weight_grad_s * unit.trained_fraction

    def split_mapped(self, input_grad: Callable[[float], float],
                     weight_grad: Callable[[float], float]) -> dict[str, float | None]:
        """``dataclasses.replace`` keywords mapping the split fields as a cost transform maps dX (``input_grad``)
        and dW (``weight_grad``): e.g. TP divides both and adds its all-reduce to dX; None stays None."""
        if self.split_input_grad_s is None or self.split_weight_grad_s is None:
            return {}
        return {"split_input_grad_s": input_grad(self.split_input_grad_s),
                "split_weight_grad_s": weight_grad(self.split_weight_grad_s)}

    def backward_s(self, unit: Unit, frozen_aware: bool = True) -> float:
        """Backward time (s) of ``unit``: dX if it needs an input gradient, plus its trained share of dW
        (``Unit.trained_fraction``: all of it, a LoRA unit's adapters' share, or none), plus the
        recomputation ``recompute_s`` of a checkpointed unit when it runs any backward.

        With ``frozen_aware=False`` every unit pays dX + dW (+ recomputation) whatever its flags (the
        frozen-unaware model that Cornstarch compares against).
        """
        if not frozen_aware:
            return self.input_grad_s + self.weight_grad_s + self.recompute_s
        return (self.input_grad_s if unit.needs_input_grad else 0.0) + (
            self.weight_grad_s * unit.trained_fraction
        ) + (self.recompute_s if unit.runs_backward else 0.0)
