"""Rows of a replicated encoder stage (``Stage.replicas`` > 1: an encoder branch with its own data-parallel degree
inside a pipeline): each replica of a branch's stages takes one contiguous slice of every microbatch's items of
that branch (:func:`replica_inputs`, cost-balanced by :func:`plait.planner.pipeline.replicas.plan_replica_rows` on
each item's input size); the first LLM stage concatenates the replicas' projected features in replica order, which
is item order (:func:`merge_replica_features`), so the feature placement sees exactly the features one stage would
have sent, and autograd splits their gradient back per replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from plait.planner.pipeline.replicas import plan_replica_rows

__all__ = ["merge_replica_features", "replica_inputs"]


def replica_inputs(inputs: Mapping[str, Any] | None, branch: str, replica: int,
                   replicas: int) -> Mapping[str, Any] | None:
    """The items of one replica in a branch's encoder inputs (``Batch.modality_inputs[branch]``: every field per
    item, a list or a tensor whose first dimension is the item, in placeholder order).

    The ``n`` items are cut into ``replicas`` contiguous slices balanced by each item's input size (elements of
    its first field: pixels, mel frames), :func:`plait.planner.pipeline.replicas.plan_replica_rows`; replica ``k``
    gets slice ``k``.

    Returns:
        the sliced fields, or None when the slice is empty (fewer items than replicas, or no item).

    Raises:
        ValueError: naming the field when a field is not per item (another length, or not a list or tensor).
    """
    if inputs is None or replicas == 1:
        return inputs
    fields = list(inputs.items())
    count = len(fields[0][1]) if fields and isinstance(fields[0][1], (list, tuple, torch.Tensor)) else -1
    for key, value in fields:
        if not isinstance(value, (list, tuple, torch.Tensor)) or len(value) != count:
            raise ValueError(f"encoder {branch!r} runs on {replicas} replicas, but its input field {key!r} is not one "
                             f"entry per item ({count} items); such inputs cannot be split over replicas")
    costs = [float(item.numel()) if isinstance(item, torch.Tensor) else 1.0 for item in fields[0][1]]
    start, end = plan_replica_rows(costs, replicas)[replica]
    if start == end:
        return None
    return {key: value[start:end] for key, value in fields}


def merge_replica_features(received: Sequence[Mapping[str, list[torch.Tensor]]]) -> dict[str, list[torch.Tensor]]:
    """The payloads an LLM stage received, one per predecessor in stage order, as one payload per module: the
    projected features ``[rows_k, hidden]`` of a replicated branch's replicas concatenated in replica order (a
    differentiable ``torch.cat``, so each replica's leaf gets its rows' gradient); other modules as received."""
    out: dict[str, list[torch.Tensor]] = {}
    for payload in received:
        for module, tensors in payload.items():
            if module not in out:
                out[module] = list(tensors)
            elif tensors:
                out[module] = [torch.cat([out[module][0], tensors[0]])] if out[module] else list(tensors)
    return out
