"""Executing a reconfiguration's copies (``plait.planner.resilience.types.Reconfiguration.transfers``): each unit's
parameters and optimizer state go from a surviving holder to the rank that now runs the unit, point to point in
the re-formed process group (``plait.parallel.membership``); what a rank already held it copies locally.

The caller builds its new stages on a freshly built model (``build_rank_stages`` for its new plan rank), then
:func:`move_units` fills them: parameters (``.data``) and, for trainable ones, the AdamW state (``step``,
``exp_avg``, ``exp_avg_sq``, or whatever tensors the optimizer keeps per parameter). Transfers run in the plan's
order on every rank with blocking ``send``/``recv``: the earliest unfinished transfer always has both its ends
waiting on it, so they cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.models.multimodal import MultimodalModel
from plait.models.units import unit_specs
from plait.planner.resilience.types import Transfer

__all__ = ["UnitState", "move_units", "unit_parameter_names"]

UnitState = dict[str, tuple[nn.Parameter, dict[str, Any]]]
"""Per parameter FQN: the parameter and its optimizer state (empty for a frozen parameter or before any step)."""


def unit_parameter_names(model: MultimodalModel) -> dict[str, tuple[str, ...]]:
    """Per unit name, the FQNs of its parameters in ``model`` (a full model, not yet pruned), sorted; a weight
    tied between the embedding and ``lm_head`` appears under both units, each with its own FQN."""
    out = {}
    for spec in unit_specs(model):
        names = set()
        for path in spec.modules:
            module = model.get_submodule(path)
            names.update(f"{path}.{n}" for n, _ in module.named_parameters(remove_duplicate=False))
        out[spec.unit.name] = tuple(sorted(names))
    return out


def _state_tensors(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return sorted((k, v) for k, v in state.items() if isinstance(v, torch.Tensor))


def move_units(
    old: UnitState,
    new: Mapping[str, nn.Parameter],
    names: Mapping[str, Sequence[str]],
    transfers: Sequence[Transfer],
    worker: int,
    rank_of: Mapping[int, int],
    template_state: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Fill this rank's new parameters from what it held (``old``) and from the transfers, and return their
    optimizer state by FQN. Collective over the ranks named in ``transfers`` (every rank passes the same list).

    Args:
        old: what this rank held before, by FQN (parameters and optimizer state); every FQN of a shared (tied)
            parameter (``named_parameters(remove_duplicate=False)``).
        new: this rank's new parameters by FQN, alike (its new stages' model).
        names: FQNs per unit (:func:`unit_parameter_names`, the same on every rank).
        transfers: the reconfiguration's copies, with worker ids (the ranks of the plan).
        worker: this process's worker id; rank_of: worker id -> rank in the current process group.
        template_state: the optimizer state keys and shapes of a trainable parameter when this rank receives
            state (e.g. ``{"step": tensor(0.), "exp_avg": ..., "exp_avg_sq": ...}`` from one AdamW step;
            tensors of the parameter's shape are resized per parameter). None: parameters only. Every rank
            passes a state or every rank None.

    Raises:
        ValueError: when a new parameter is neither held before nor received, or a sent trainable parameter has
            no optimizer state.
    """
    state: dict[str, dict[str, Any]] = {}
    for fqn, param in new.items():
        if fqn in old:
            held, held_state = old[fqn]
            with torch.no_grad():
                param.copy_(held)
            state[fqn] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in held_state.items()}
    received = set()
    for t in transfers:
        if worker not in (t.src, t.dst):
            continue
        for fqn in names[t.unit]:
            if worker == t.src and fqn in old:
                _send(fqn, *old[fqn], template_state is not None, rank_of[t.dst])
            elif worker == t.dst and fqn in new:
                state[fqn] = _receive(new[fqn], template_state, rank_of[t.src])
                received.add(fqn)
    missing = sorted(set(new) - set(old) - received)
    if missing:
        raise ValueError(f"worker {worker}: parameters {missing[:5]} were neither held nor received")
    return state


def _send(fqn: str, param: nn.Parameter, pstate: Mapping[str, Any], with_state: bool, dst: int) -> None:
    """Send one parameter and (when it trains and states move) its optimizer state to rank ``dst``."""
    dist.send(param.detach().contiguous(), dst)
    if not param.requires_grad or not with_state:
        return
    tensors = _state_tensors(pstate)
    if not tensors:
        raise ValueError(f"{fqn} trains but has no optimizer state to send (move units after a step)")
    for _, tensor in tensors:
        dist.send(tensor.contiguous(), dst)


def _receive(param: nn.Parameter, template_state: Mapping[str, Any] | None, src: int) -> dict[str, Any]:
    """Receive one parameter and (when it trains) its optimizer state from rank ``src``."""
    with torch.no_grad():
        buf = torch.empty_like(param.data)
        dist.recv(buf, src)
        param.copy_(buf)
    if not param.requires_grad or not template_state:
        return {}
    out: dict[str, Any] = {}
    for key, like in _state_tensors(template_state):
        tensor = torch.empty_like(param.data) if like.dim() else torch.empty_like(like)
        dist.recv(tensor, src)
        out[key] = tensor
    return out
