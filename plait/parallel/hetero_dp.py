"""Heterogeneous data parallelism: pipelines with different stage boundaries train as replicas of one model
(Oobleck, Jang et al., SOSP 2023; the plans are ``plait.planner.resilience.templates``).

Each pipeline runs its own plan with the pipeline runtime unchanged (``run_pipeline_step`` on a
:class:`~plait.parallel.pipeline.comm.PipelineComm` of DP degree 1: deferral, frozen stages, split backward and
tied embeddings inside the pipeline work as they do alone). Pipeline ``p`` runs its share of the global batch's
microbatches; every microbatch's loss is scaled by ``1 / target tokens of the whole global batch``, so the sum
over pipelines of their gradients is the single-process gradient of the global batch whatever the split.

Gradients are then summed per parameter among exactly the ranks that hold it, one per pipeline (per-unit
groups: a unit's parameters live on one rank of each pipeline, and units with the same holders share one group
and one bucketed all-reduce). A weight tied between the input and output embeddings counts once per pipeline:
the pipeline's copy on the embedding rank contributes (``run_pipeline_step`` already summed the two copies of a
pipeline that splits them), the ``lm_head`` rank's mirror contributes zeros and receives the sum.

A step is ``run_pipeline_step(..., sync=HeteroSync(hetero))`` (:class:`~plait.parallel.grad_sync.HeteroSync`:
:meth:`HeteroDP.reduce` after the pipeline's backward, the loss summed over every rank).

Collectives: :func:`build_hetero_dp` gathers every rank's parameter names and creates the groups (all ranks, the
same order); the step and :func:`clip_grad_norm_hetero` are called by every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.data_parallel import sum_gradients
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.stages import RankStages
from plait.parallel.tensor_parallel import check_max_norm, clip_by_square_sum_

__all__ = ["HeteroDP", "build_hetero_dp", "clip_grad_norm_hetero", "hetero_pipeline_comm"]


def hetero_pipeline_comm(pipelines: Sequence[Sequence[int]], rank: int | None = None,
                         device: torch.device | str = "cpu") -> PipelineComm:
    """This rank's :class:`PipelineComm` in its own pipeline: ``pp_ranks`` = the pipeline's global ranks,
    ``dp_rank`` = the pipeline's index, DP degree 1 (the reduction across pipelines is :class:`HeteroDP`'s).

    Args:
        pipelines: per pipeline, the global rank of each of its plan ranks (``ranks[i]`` runs plan rank ``i``).
        rank: this process's global rank (default: ``dist.get_rank()``).

    Raises:
        ValueError: when ranks repeat or ``rank`` is in no pipeline.
    """
    rank = dist.get_rank() if rank is None else rank
    flat = [int(r) for p in pipelines for r in p]
    if len(set(flat)) != len(flat):
        raise ValueError(f"pipelines share ranks: {[list(p) for p in pipelines]}")
    for index, ranks in enumerate(pipelines):
        if rank in ranks:
            return PipelineComm(pp_rank=list(ranks).index(rank), pp_ranks=tuple(int(r) for r in ranks),
                                dp_rank=index, dp_size=1, device=torch.device(device))
    raise ValueError(f"rank {rank} is in no pipeline of {[list(p) for p in pipelines]}")


@dataclass
class _Group:
    """One reduction group: the ranks holding the same parameters, and this rank's copies of them."""

    ranks: tuple[int, ...]
    group: Any
    params: list[nn.Parameter]
    mirrors: list[bool]


@dataclass
class HeteroDP:
    """The per-parameter gradient groups of this rank (built by :func:`build_hetero_dp`).

    Attributes:
        comm: this rank's pipeline coordinates.
        groups: the groups this rank belongs to, in the global order every rank uses.
        counted: this rank's trainable parameters counted in the global gradient norm (pipeline 0's, the
            tied mirror left out).
        params: every trainable parameter of this rank.
    """

    comm: PipelineComm
    groups: list[_Group]
    counted: list[nn.Parameter]
    params: list[nn.Parameter]

    def reduce(self) -> None:
        """Sum every held parameter's gradient over its holders, one contribution per pipeline (in place)."""
        for g in self.groups:
            for param, mirror in zip(g.params, g.mirrors):
                if mirror and param.grad is not None:
                    param.grad = torch.zeros_like(param.grad)
            sum_gradients(g.params, g.group)


def _canonical_names(stages: RankStages) -> list[tuple[str, nn.Parameter, bool]]:
    """``(key, parameter, mirror)`` of this rank's trainable parameters; a weight tied between the input and
    output embeddings is keyed by the input embedding's name on every rank (which name ``named_parameters``
    reports depends on which of the two modules the rank kept)."""
    llm = stages.model.language_model
    rename: dict[str, str] = {}
    if getattr(llm.config, "tie_word_embeddings", False):
        paths = {id(m): n for n, m in llm.named_modules(remove_duplicate=False)}
        head, embed = paths.get(id(llm.get_output_embeddings())), paths.get(id(llm.get_input_embeddings()))
        if head is not None and embed is not None:
            rename[f"language_model.{head}.weight"] = f"language_model.{embed}.weight"
    mirror = stages.tied.param if stages.tied is not None and stages.tied.mirror else None
    return [(rename.get(n, n), p, p is mirror) for n, p in stages.trainable_parameters()]


def build_hetero_dp(stages: RankStages, comm: PipelineComm, timeout: datetime.timedelta | None = None) -> HeteroDP:
    """Gather every rank's trainable parameter names and create one process group per distinct set of holders
    (collective over the whole job: every rank calls it once, after building its stages). ``timeout``: the
    groups' collective timeout (None: torch's default for ``new_group``).

    Raises:
        ValueError: when a parameter has two holders in one pipeline other than a tied embedding's pair, or
            not one holder in every pipeline (the pipelines are not replicas of one model).
    """
    mine = _canonical_names(stages)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (comm.dp_rank, [(k, m) for k, _, m in mine]))
    holders: dict[str, list[tuple[int, int, bool]]] = {}
    for rank, (pipeline, names) in enumerate(gathered):
        for key, mirror in names:
            holders.setdefault(key, []).append((pipeline, rank, mirror))
    pipelines = {p for p, _ in gathered}
    by_set: dict[tuple[int, ...], list[str]] = {}
    for key, held in sorted(holders.items()):
        per_pipeline = [p for p, _, m in held if not m]
        if sorted(per_pipeline) != sorted(pipelines):
            raise ValueError(f"parameter {key} is held by pipelines {sorted(per_pipeline)} (one copy each "
                             f"expected in pipelines {sorted(pipelines)})")
        by_set.setdefault(tuple(sorted(r for _, r, _ in held)), []).append(key)
    own = {k: (p, m) for k, p, m in mine}
    groups = []
    for ranks, keys in sorted(by_set.items()):
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        if dist.get_rank() in ranks and len(ranks) > 1:
            groups.append(_Group(ranks, group, [own[k][0] for k in keys], [own[k][1] for k in keys]))
    counted = [p for _, p, m in mine if not m] if comm.dp_rank == 0 else []
    return HeteroDP(comm, groups, counted, [p for _, p, _ in mine])


def clip_grad_norm_hetero(hetero: HeteroDP, max_norm: float) -> float:
    """Clip every rank's gradients to a global L2 norm of ``max_norm`` after the step's :meth:`HeteroDP.reduce`
    (every copy then holds the same gradients; each parameter counted once: pipeline 0's copy); returns the norm
    before clipping, the same on every rank. Collective.

    Raises:
        ValueError: on a negative ``max_norm``.
    """
    check_max_norm(max_norm)
    sumsq = torch.zeros((), dtype=torch.float64, device=hetero.comm.device)  # plain gradients: summed on the device
    for p in hetero.counted:
        if p.grad is not None:
            sumsq += p.grad.detach().double().pow(2).sum()
    return clip_by_square_sum_([p.grad for p in hetero.params if p.grad is not None], sumsq, max_norm, reduce=True)
