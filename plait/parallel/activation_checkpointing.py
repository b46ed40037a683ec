"""Activation checkpointing of a model's pipeline units, with PyTorch's non-reentrant checkpoint.

Which units are checkpointed is the planner's rule (:func:`plait.planner.cost.recompute.plan_checkpointing`: layer
units only, frozen-aware, ``none`` / ``full`` / ``selective`` per module), so the runtime recomputes exactly what
the cost model charges. Each chosen unit's modules get an instance ``forward`` that runs the class's forward
through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:

- the module tree is untouched (``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every
  parameter name, breaking plait's FQN-keyed checkpoints, optimizer groups and stage pruning), so one call works
  for the single-process model and for a pipeline rank's pruned composite alike;
- non-reentrant checkpointing passes keyword arguments through (HF attention masks, rotary tables, plait's
  ``plait_mask`` / ``plait_cp`` objects), handles inputs without ``requires_grad`` (a trainable layer after frozen
  ones, deferred encoder outputs re-injected as detached leaves) and recomputes once per backward pass over a
  retained graph, so the pipeline executor's split backward (dX with ``retain_graph``, then dW) is correct and
  pays the recomputation in both passes (the simulator charges it so);
- with autograd off (evaluation, frozen chunks under ``no_grad``) the forward runs plainly.

The composable ``torch.distributed._composable.checkpoint`` keeps names too, but fails on the second recompute
over a retained graph (its context managers are single-use), i.e. on split backward: hence the forward wrapper.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.config.schema import JobConfig
from plait.models.multimodal import MultimodalModel
from plait.models.units import UnitSpec, unit_specs
from plait.planner.cost.recompute import plan_checkpointing
from plait.planner.types import LLM_MODULE

__all__ = ["apply_activation_checkpointing", "checkpoint_policy", "is_checkpointed"]

_MARK = "_plait_checkpointed"


def checkpoint_policy(cfg: JobConfig) -> tuple[str, dict[str, str]]:
    """``(default policy, per-module overrides)`` of a job: ``train.activation_checkpointing`` and the
    ``activation_checkpointing`` fields of ``[model.llm]`` (module ``"llm"``) and ``[model.encoders.<name>]``."""
    overrides = {name: enc.activation_checkpointing for name, enc in cfg.model.encoders.items()
                 if enc.activation_checkpointing is not None}
    if cfg.model.llm.activation_checkpointing is not None:
        overrides[LLM_MODULE] = cfg.model.llm.activation_checkpointing
    return cfg.train.activation_checkpointing, overrides


def apply_activation_checkpointing(model: MultimodalModel, policy: str = "none",
                                   overrides: Mapping[str, str] | None = None,
                                   specs: Sequence[UnitSpec] | None = None) -> list[str]:
    """Checkpoint, in place, the units of ``model`` that ``plan_checkpointing`` chooses.

    Args:
        model: the composite (whole, or a pipeline rank's pruned composite: modules of units it does not hold
            are skipped); its ``requires_grad`` flags final (freezing applied), as ``specs`` were taken.
        policy, overrides: as :func:`plait.planner.cost.recompute.plan_checkpointing` (see :func:`checkpoint_policy`).
        specs: ``plait.models.units.unit_specs`` of the whole model; None: taken from ``model`` now (pass them
            for an already pruned composite).

    Returns:
        The names (``Unit.name``) of the units checkpointed on this model.

    Raises:
        ValueError: on an unknown policy, or a module already checkpointed (apply once per model).
    """
    specs = unit_specs(model) if specs is None else specs
    flags = plan_checkpointing([s.unit for s in specs], policy, overrides)
    done = []
    for spec, flag in zip(specs, flags):
        modules = [_held(model, path) for path in spec.modules] if flag else []
        modules = [m for m in modules if m is not None and not isinstance(m, nn.Identity)]
        for module in modules:
            if is_checkpointed(module):
                raise ValueError(f"unit {spec.unit.name!r} is already activation-checkpointed")
            module.forward = types.MethodType(_checkpointed_forward, module)  # type: ignore[method-assign]
            setattr(module, _MARK, True)
        if modules:
            done.append(spec.unit.name)
    return done


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` wrapped ``module``'s forward."""
    return bool(getattr(module, _MARK, False))


def _held(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # a pipeline rank's pruned composite holds only its own layers
        return None


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # names of HF layers' KV cache


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The class's forward under the non-reentrant checkpoint when autograd records, else plainly.

    A Hugging Face KV cache in the kwargs is dropped under autograd: a training forward starts from an empty
    cache that nothing reads (generation runs without autograd), and the recomputation would append the layer's
    keys and values to it a second time (an HF causal LM builds one when ``use_cache`` is not False). The same rule
    as transformers' own ``GradientCheckpointingLayer`` for layers that write the cache."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    kwargs = {k: (None if k in _CACHE_KWARGS else False if k == "use_cache" else v) for k, v in kwargs.items()}
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
