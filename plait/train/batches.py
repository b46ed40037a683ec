"""A step's batches, planned before the step runs: per microbatch of a DP replica's
:class:`~plait.planner.microbatch.routing.FeatureRouting`, the LLM view's collated batch, the encoder view's batch and the
LLM keyword arguments (:class:`StepBatches`; built by ``Trainer.plan_batches``).

Each sample is collated once, into the batch of its LLM microbatch. An encoder microbatch with the same samples
reuses that batch; one that differs (deferred samples) takes each sample's media items from the LLM batch that
holds the sample (:func:`encoder_view_batch`), in encoder order, without collating anything again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.config.schema import JobConfig
from plait.data.collate import Batch
from plait.planner.microbatch.types import ModuleCostCoeffs
from plait.planner.microbatch import (MicrobatchPlan, MicrobatchPolicy, SampleCost, plan_microbatches,
                                      sample_costs_from_metadata)
from plait.planner.microbatch.routing import FeatureRouting

__all__ = ["StepBatches", "encoder_view_batch", "plan_global_batch"]


def plan_global_batch(cfg: JobConfig, metas: Sequence[Any], coeffs: Mapping[str, ModuleCostCoeffs], dp: int,
                      num_microbatches: int, step: int, allow_deferral: bool = True
                      ) -> tuple[MicrobatchPlan, tuple[SampleCost, ...]]:
    """The assignment of a global batch to ``dp`` replicas of ``num_microbatches`` microbatches each by the job's
    ``train.microbatch_policy`` (Entrain's workload balance; ``plan_microbatches``), from the samples' metadata
    (``metas``, one per sample in arrival order: ``SampleMeta``) and the modules' cost coefficients (``coeffs``,
    :func:`~plait.train.cost_coeffs.microbatch_cost_coeffs`), seeded by ``train.seed`` and ``step``: the same plan
    on every rank, without communication, for ``plait train``'s replicas and ``plait launch``'s pipelines alike.
    ``allow_deferral``: a sample's LLM work may run in a later microbatch than its encoder work. Returns the plan
    (entries are positions in the batch) and the per-sample costs it balanced.

    Raises:
        ValueError: as ``plan_microbatches`` (inconsistent costs, a negative step).
    """
    costs = sample_costs_from_metadata(metas, coeffs)
    policy = MicrobatchPolicy(method=cfg.train.microbatch_policy, dp=dp, num_microbatches=num_microbatches,
                              seed=cfg.train.seed, allow_deferral=allow_deferral)
    return plan_microbatches(costs, policy, step), costs


@dataclass(frozen=True)
class StepBatches:
    """One DP replica's share of a step, planned before any of it runs.

    Attributes:
        routing: the replica's feature routing (sample keys: positions in the global batch); no microbatch when
            the replica has no sample.
        encoder_batches: per microbatch, the batch of the encoder view (None: no sample); only its
            ``modality_inputs`` are read.
        llm_batches: per microbatch, the batch of the LLM view (None: no sample).
        llm_kwargs: per microbatch, the LLM's extra keyword arguments (attention metadata, this rank's CP shard
            from ``plan_tokens``; ``{}`` for an empty microbatch).
    """

    routing: FeatureRouting
    encoder_batches: tuple[Batch | None, ...]
    llm_batches: tuple[Batch | None, ...]
    llm_kwargs: tuple[dict[str, Any], ...]


def encoder_view_batch(i: int, routing: FeatureRouting, llm_batches: Sequence[Batch | None],
                       items: Mapping[int, Mapping[str, int]]) -> Batch:
    """The batch of encoder microbatch ``i``: the media items of its samples (in encoder order) taken from the
    LLM batches holding them. Its token tensors are empty (``[samples, 0]``) and it has no ``meta``: encoders
    read only ``modality_inputs``, per branch the items in row-major order, as ``collate`` lays them out.

    Args:
        i: the encoder microbatch.
        routing: the replica's routing.
        llm_batches: the LLM view's batches (per microbatch; the one of every sample of ``i`` is not None).
        items: per sample key, per encoder branch, its media items.
    """
    llm_of = {k: j for j, keys in enumerate(routing.llm_samples) for k in keys}
    parts: dict[str, list[dict[str, Any]]] = {}
    for k in routing.encoder_samples[i]:
        j = llm_of[k]
        before = routing.llm_samples[j][: routing.llm_samples[j].index(k)]
        for branch, n in items[k].items():
            if n:
                start = sum(items[b].get(branch, 0) for b in before)
                source = llm_batches[j].modality_inputs[branch]  # type: ignore[union-attr]
                parts.setdefault(branch, []).append({name: v[start : start + n] for name, v in source.items()})
    inputs = {branch: _join(parts[branch]) for branch in sorted(parts)}
    device = next((b.input_ids.device for b in llm_batches if b is not None), torch.device("cpu"))
    empty = torch.empty(len(routing.encoder_samples[i]), 0, dtype=torch.long, device=device)
    return Batch(empty, empty, empty, empty, empty, empty, inputs, ())


def _join(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per input name, the items of ``parts`` concatenated (tensors along dim 0, lists joined)."""
    return {name: torch.cat([p[name] for p in parts]) if isinstance(parts[0][name], torch.Tensor)
            else [x for p in parts for x in p[name]] for name in parts[0]}
