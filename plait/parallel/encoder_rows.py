"""Rows of a replicated encoder stage (``Stage.replicas`` > 1: an encoder branch with its own data-parallel degree
inside a pipeline): each replica of a branch's stages takes one contiguous slice of every microbatch's items of
that branch (:func:`replica_inputs`, cost-balanced by :func:`plait.planner.pipeline.replicas.plan_replica_rows` on
each item's input size); the first LLM stage concatenates the replicas' projected features in replica order, which
is item order (:func:`merge_replica_features`), so the feature placement sees exactly the features one stage would
have sent, and autograd splits their gradient back per replica.

A tensor-parallel encoder stage (``Stage.tensor_parallel``: its copies one TP group) runs every item on every copy;
only the leader's features travel into the first LLM stage (:func:`sent_payload`: the others send an empty
payload), and the first LLM stage sends the gradient of the leader's features to every copy
(:func:`gradient_source`), so each TP rank back-propagates the same output gradient through its shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from plait.planner.pipeline.replicas import plan_replica_rows
from plait.planner.pipeline.types import PipelinePlan

Payload = dict[str, list[torch.Tensor]]  # per module, its tensors (plait.parallel.stages.Payload)

__all__ = ["gradient_source", "merge_replica_features", "replica_inputs", "sent_payload"]


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


def sent_payload(plan: PipelinePlan, sender: int, receiver: int, payload: Payload) -> Payload:
    """What stage ``sender`` sends to stage ``receiver`` after its forward: ``payload`` itself, or, from a
    follower copy of a tensor-parallel encoder stage (``Stage.tp_follower``) to an LLM stage, an empty list per
    module (the leader's identical features are the ones used)."""
    if plan.stages[sender].tp_follower and plan.stages[receiver].is_llm:
        return {module: [] for module in payload}
    return payload


def gradient_source(plan: PipelinePlan, sender: int, receiver: int) -> int:
    """Whose received features' gradient LLM stage ``receiver`` sends back to predecessor ``sender``: the
    leader's (the copy 0 of its tensor-parallel group) for a follower copy, ``sender`` itself otherwise."""
    stage = plan.stages[sender]
    return stage.first_replica if stage.tp_follower and plan.stages[receiver].is_llm else sender
