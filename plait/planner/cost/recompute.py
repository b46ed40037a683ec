"""Activation checkpointing as a plan: which pipeline units recompute their forward, and what that costs.

One rule decides the checkpointed units for the runtime (``plait.parallel.activation_checkpointing``) and for the planner
(:func:`checkpointed_costs`), so the two never disagree:

- only ``layer`` units are checkpointed (transformer blocks of an encoder or the LLM): they hold almost all of
  a model's saved activations, while an embedding, norm, projector or head saves about its input or output,
  which a checkpoint would keep anyway;
- frozen-aware: a unit that runs no backward (neither ``trainable`` nor
  ``needs_input_grad``) is never checkpointed: it runs under ``no_grad`` and keeps nothing already; a unit that
  needs an input gradient but trains nothing (a frozen LLM after a trainable projector) is checkpointed like
  any other, since its activations are kept for the dX backward;
- per policy of the unit's module: ``"none"`` none of its layers; ``"full"`` every layer; ``"selective"`` every
  other layer: the layer units at even positions (0th, 2nd, ...) of the module's chain of layer units. This is
  layer-level selective checkpointing (torchtitan's ``selective`` with frequency 2): about half the saved
  activations for half the recomputation, with costs the analytic model prices exactly from per-unit costs.
  (PyTorch's op-level policy, ``torch.utils.checkpoint.create_selective_checkpoint_contexts``, keeps chosen op
  outputs such as matmuls: its savings depend on per-op outputs that a ``UnitCost`` does not carry.)

Cost of a checkpointed unit (:func:`checkpointed_costs`): the forward runs under the checkpoint keeping only
the unit's input (a layer's input has the shape of its output: ``output_bytes``), and the backward first runs
the forward again (``UnitCost.recompute_s = forward_s``, charged by ``UnitCost.backward_s`` when the unit runs
a backward). With a split backward (zero-bubble schedules: dX then dW over the retained graph) the runtime
recomputes once per pass, so the simulator charges it in both ``B`` and ``W``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from plait.planner.cost.types import CHECKPOINT_POLICIES
from plait.planner.types import Unit, UnitCost

__all__ = ["checkpointed_costs", "plan_checkpointing"]


def plan_checkpointing(units: Sequence[Unit], policy: str = "none",
                       overrides: Mapping[str, str] | None = None) -> tuple[bool, ...]:
    """Which of ``units`` are activation-checkpointed (module docstring), in unit order.

    Args:
        units: a model's pipeline units in model order, flags consistent (``planner.graph.consistent_units``).
        policy: the default policy, one of :data:`CHECKPOINT_POLICIES`.
        overrides: per module (``Unit.module``: an encoder name or ``"llm"``) a policy replacing ``policy``.

    Raises:
        ValueError: on an unknown policy (naming the module it was given for).
    """
    overrides = dict(overrides or {})
    for module, value in [("default", policy), *overrides.items()]:
        if value not in CHECKPOINT_POLICIES:
            raise ValueError(f"activation checkpointing of {module}: {value!r} is not one of {CHECKPOINT_POLICIES}")
    position: dict[str, int] = {}
    out = []
    for unit in units:
        if unit.kind != "layer":
            out.append(False)
            continue
        index = position.get(unit.module, 0)
        position[unit.module] = index + 1
        chosen = overrides.get(unit.module, policy)
        selected = chosen == "full" or (chosen == "selective" and index % 2 == 0)
        out.append(selected and unit.runs_backward)
    return tuple(out)


def checkpointed_costs(costs: Sequence[UnitCost], checkpointed: Sequence[bool]) -> list[UnitCost]:
    """``costs`` with each checkpointed unit's recomputation and kept bytes (module docstring):
    ``recompute_s = forward_s`` and ``activation_bytes = output_bytes`` (the layer's input); others unchanged.

    Raises:
        ValueError: when the lengths differ.
    """
    if len(costs) != len(checkpointed):
        raise ValueError(f"{len(costs)} costs but {len(checkpointed)} checkpointing flags")
    return [dataclasses.replace(c, recompute_s=c.forward_s, activation_bytes=min(c.output_bytes, c.activation_bytes))
            if flag else c for c, flag in zip(costs, checkpointed)]
