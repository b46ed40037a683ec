"""Bytes of real tensor storages, shared by the memory benches (``bench/memory.py``,
``bench/activation_checkpointing.py``, ``bench/gpu_check.py``): the one saved-activation counter.

- :func:`storage_bytes`: bytes of the distinct storages of some tensors (a DTensor by its local shard), so tied and
  shared tensors count once.
- :func:`saved_activation_bytes`: what one forward/backward keeps for its backward: every tensor autograd saves
  (``torch.autograd.graph.saved_tensors_hooks``) plus the tensor arguments an activation-checkpointed layer holds for
  its recomputation (its input hidden states, masks: a forward pre-hook), each storage once, **parameters
  excluded**: a matmul saves its weight for the input gradient, but that is parameter memory, counted as such
  (a tensor that is an ``nn.Parameter``, a view of one, or shares a storage with one of the model's parameters,
  FSDP2's all-gathered parameters included, since they are ``nn.Parameter`` objects while unsharded). Under
  autocast, the low-precision copy of a weight that autocast makes for a matmul is a new tensor and is counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["local_tensor", "saved_activation_bytes", "storage_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (FSDP2, TP), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (DTensors by their local shard), each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def _is_parameter(t: torch.Tensor, params: set[int]) -> bool:
    """Whether ``t`` is a parameter, a view of one, or shares a storage with one (``params``: storage pointers)."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    return local_tensor(t).untyped_storage().data_ptr() in params


def saved_activation_bytes(model: torch.nn.Module, forward_backward: Callable[[], Any]) -> int:
    """Bytes of the distinct storages kept for the backward while ``forward_backward()`` (one forward/backward of
    ``model``) runs, parameters excluded (module docstring). Every counted tensor is held until the end, so no
    freed address is reused and counted twice: call it on a step whose peak memory is not measured.

    Args:
        model: the model whose parameters are excluded and whose checkpointed layers' arguments are counted
            (``plait.parallel.activation_checkpointing.is_checkpointed``).
        forward_backward: runs one forward and backward of ``model``.
    """
    from plait.parallel.activation_checkpointing import is_checkpointed

    params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t, params):
            storage = local_tensor(t).untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
            alive.append(t)
        return t

    def held(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    pack(value)

    hooks = [m.register_forward_pre_hook(held, with_kwargs=True) for m in model.modules() if is_checkpointed(m)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_backward()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(seen.values())
