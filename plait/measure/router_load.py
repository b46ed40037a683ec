"""The measured routing of a mixture-of-experts LLM: per MoE layer, how many (token, slot) pairs its router sent
to each expert over the profiled microbatches (``Profile.router_load``; ``planner.cost.experts`` turns it into the
expert load imbalance an EP plan pays).

A router is found through its public module structure: a module with integer ``top_k`` and ``num_experts`` (Hugging
Face's ``*TopKRouter``: Qwen3-MoE, Qwen3-VL-MoE, ...) whose output ends with its top-k expert ids ``[T, k]``
(``(logits, weights, indices)``). A forward hook counts the ids (``torch.bincount``); nothing in the forward changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from plait.models.units import UnitSpec

__all__ = ["measure_router_load", "router_modules", "routed_counts"]


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE routers of ``model`` (name, module): modules with integer ``top_k`` and ``num_experts`` attributes
    and a ``weight`` of ``num_experts`` rows (one logit per expert)."""
    out = []
    for name, m in model.named_modules():
        k, e, w = getattr(m, "top_k", None), getattr(m, "num_experts", None), m._parameters.get("weight")
        if isinstance(k, int) and isinstance(e, int) and w is not None and w.dim() == 2 and w.shape[0] == e:
            out.append((name, m))
    return out


def _indices(name: str, output: Any) -> torch.Tensor:
    """The top-k expert ids (last integer tensor) of router ``name``'s ``output``.

    Raises:
        ValueError: when the output holds no integer tensor.
    """
    items = output if isinstance(output, (tuple, list)) else (output,)
    found = [t for t in items if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if not found:
        raise ValueError(f"router {name} ({type(output).__name__} output) returns no integer expert ids to count")
    return found[-1]


@contextmanager
def routed_counts(model: nn.Module, specs: Sequence[UnitSpec]) -> Iterator[dict[str, list[int]]]:
    """Within: every router forward of ``model`` adds its top-k expert ids' counts to the yielded
    ``{unit name: [count per expert]}`` (the unit of ``specs`` holding the router; a layer's counts sum to its
    tokens x ``top_k`` per forward). Hooks removed on exit.

    Raises:
        ValueError: when a router lies in no unit of ``specs``.
    """
    counts: dict[str, list[int]] = {}
    handles = []
    for name, router in router_modules(model):
        unit = next((s.unit.name for s in specs
                     if any(name == m or name.startswith(m + ".") for m in s.modules)), None)
        if unit is None:
            raise ValueError(f"router {name} lies in no pipeline unit of the model")
        counts.setdefault(unit, [0] * router.num_experts)

        def hook(module: nn.Module, _args: Any, output: Any, unit: str = unit, name: str = name) -> None:
            ids = _indices(name, output).reshape(-1)
            add = torch.bincount(ids, minlength=module.num_experts).tolist()
            counts[unit] = [a + b for a, b in zip(counts[unit], add)]

        handles.append(router.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def measure_router_load(model: nn.Module, specs: Sequence[UnitSpec], microbatches: Sequence[Any],
                        forward: Callable[[Any], Any]) -> dict[str, tuple[float, ...]]:
    """Per MoE layer unit, the tokens its router sent to each expert over one no-grad ``forward(batch)`` of every
    microbatch (``Profile.router_load``); ``{}`` for a model without routers (then nothing runs), or when no
    router ran.

    Raises:
        ValueError: as :func:`routed_counts`.
    """
    if not router_modules(model):
        return {}
    with routed_counts(model, specs) as counts, torch.no_grad():
        for batch in microbatches:
            forward(batch)
    return {unit: tuple(float(c) for c in load) for unit, load in counts.items() if sum(load) > 0}
