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

**FSDP2 inside the pipelines** (``dp_shard`` > 1, ``plait.planner.resilience.shards``): each plan rank of a
pipeline runs on a shard group of ``dp_shard`` ranks, every one its own copy of the pipeline (a shard row, its own
microbatches) with the rank's trainable units sharded over the group (:func:`shard_stages`: ``apply_fsdp``, the one
FSDP2 wrapper, on a 1-D mesh of the group; the pipeline runtime gathers them once per step and reduce-scatters each
stage's gradients after its last backward, as under ``plait train``). A sharded parameter's gradient is then summed
among the ranks holding the same shard of it, one per pipeline (its local shards); a parameter left whole (a
frozen one has none; an embedding tied to a head on another plan rank) among every row's copy.

A step is ``run_pipeline_step(..., sync=HeteroSync(hetero))`` (:class:`~plait.parallel.grad_sync.HeteroSync`:
:meth:`HeteroDP.reduce` after the pipeline's backward, the loss summed over every rank).

Collectives: :func:`build_hetero_dp` gathers every rank's parameter names and creates the groups (all ranks, the
same order); the step and :func:`clip_grad_norm_hetero` are called by every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from plait.models.units import UnitSpec
from plait.parallel.fsdp import ShardedModel, apply_fsdp
from plait.parallel.pipeline.comm import PipelineComm
from plait.parallel.stages import RankStages
from plait.parallel.tensor_parallel import check_max_norm, clip_by_square_sum_, local_tensor, sum_local_gradients

__all__ = ["HeteroDP", "build_hetero_dp", "clip_grad_norm_hetero", "hetero_pipeline_comm", "place_parts",
           "receive_parts", "shard_stages", "tied_embedding_names", "unit_parts"]


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
        """Sum every held parameter's gradient over its holders, one contribution per pipeline (per shard row for a
        parameter left whole under FSDP2; a sharded one by its local shard), in place."""
        for g in self.groups:
            for param, mirror in zip(g.params, g.mirrors):
                if mirror and param.grad is not None:
                    param.grad = torch.zeros_like(param.grad)
            sum_local_gradients(g.params, g.group)


def _canonical_names(stages: RankStages) -> list[tuple[str, nn.Parameter, bool]]:
    """``(key, parameter, mirror)`` of this rank's trainable parameters; a weight tied between the input and
    output embeddings is keyed by the input embedding's name on every rank (which name ``named_parameters``
    reports depends on which of the two modules the rank kept)."""
    tied = tied_embedding_names(stages.model)
    rename = {tied[1]: tied[0]} if len(tied) == 2 else {}
    mirror = stages.tied.param if stages.tied is not None and stages.tied.mirror else None
    return [(rename.get(n, n), p, p is mirror) for n, p in stages.trainable_parameters()]


def build_hetero_dp(stages: RankStages, comm: PipelineComm, timeout: datetime.timedelta | None = None,
                    dp_shard: int = 1) -> HeteroDP:
    """Gather every rank's trainable parameter names and create one process group per distinct set of holders
    (collective over the whole job: every rank calls it once, after building its stages). ``timeout``: the
    groups' collective timeout (None: torch's default for ``new_group``). ``dp_shard`` > 1: FSDP2 inside the
    pipelines (module docstring); ``comm.dp_rank`` is then the shard row ``pipeline * dp_shard + shard``, and a
    sharded parameter (a DTensor) is keyed by its name and shard: its holders are one rank per pipeline.

    Raises:
        ValueError: when a parameter has two holders in one pipeline (shard row) other than a tied embedding's
            pair, or not one holder in every pipeline (the pipelines are not replicas of one model).
    """
    mine = _canonical_names(stages)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (comm.dp_rank, [(k, m, isinstance(p, DTensor)) for k, p, m in mine]))
    holders: dict[tuple[str, int], list[tuple[int, int, bool]]] = {}
    for rank, (row, names) in enumerate(gathered):
        for key, mirror, split in names:  # a shard is held once per pipeline, a whole parameter once per row
            copy, part = (row // dp_shard, row % dp_shard) if split else (row, -1)
            holders.setdefault((key, part), []).append((copy, rank, mirror))
    rows = {r for r, _ in gathered}
    pipelines = {r // dp_shard for r in rows}
    by_set: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    for (key, part), held in sorted(holders.items()):
        per_copy, expected = [c for c, _, m in held if not m], pipelines if part >= 0 else rows
        if sorted(per_copy) != sorted(expected):
            what = f"shard {part} of parameter {key}" if part >= 0 else f"parameter {key}"
            raise ValueError(f"{what} is held by pipelines {sorted(per_copy)} (one copy each expected in "
                             f"pipelines {sorted(expected)})")
        by_set.setdefault(tuple(sorted(r for _, r, _ in held)), []).append((key, part))
    shard = comm.dp_rank % dp_shard
    own = {(k, shard if isinstance(p, DTensor) else -1): (p, m) for k, p, m in mine}
    groups = []
    for ranks, keys in sorted(by_set.items()):
        group = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
        if dist.get_rank() in ranks and len(ranks) > 1:
            groups.append(_Group(ranks, group, [own[k][0] for k in keys], [own[k][1] for k in keys]))
    # the norm counts pipeline 0's copy: every shard of a sharded parameter, row 0's of a whole one
    counted = [p for _, p, m in mine if not m and (comm.dp_rank // dp_shard == 0 if isinstance(p, DTensor)
                                                   else comm.dp_rank == 0)]
    return HeteroDP(comm, groups, counted, [p for _, p, _ in mine])


def shard_stages(stages: RankStages, specs: Sequence[UnitSpec], groups: Sequence[Sequence[int]],
                 timeout: datetime.timedelta | None = None) -> ShardedModel | None:
    """FSDP2 inside the pipelines (module docstring): create one process group per shard group (``groups``: the
    global ranks of each, every rank passing the same list: collective over the job) and shard this rank's stages'
    trainable units over its own group's 1-D ``("dp_shard",)`` mesh with :func:`~plait.parallel.fsdp.apply_fsdp`
    (an embedding tied to a head on another plan rank stays whole: ``RankStages.tied``). ``specs``: the whole
    model's ``unit_specs`` (taken before pruning). Returns the groups made, or None when the groups have one rank.

    Raises:
        ValueError: when this rank is in no group, or as ``apply_fsdp``.
    """
    if all(len(g) == 1 for g in groups):
        return None
    rank, mesh = dist.get_rank(), None
    for ranks in groups:
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            mesh = DeviceMesh.from_group(group, "cpu", mesh=list(ranks), mesh_dim_names=("dp_shard",))
    if mesh is None:
        raise ValueError(f"rank {rank} is in no shard group of {[list(g) for g in groups]}")
    tied = [stages.tied.param] if stages.tied is not None else []  # summed with its peer, whole
    return apply_fsdp(stages.model, specs, mesh, "cpu", replicate=tied)


def tied_embedding_names(model: nn.Module) -> tuple[str, ...]:
    """The FQNs of a weight tied between the LLM's input embedding and its head (``tie_word_embeddings``) that
    ``model`` (a composite, whole or pruned) holds, the embedding's first; empty when untied."""
    llm = model.language_model
    if not getattr(llm.config, "tie_word_embeddings", False):
        return ()
    paths = {id(m): n for n, m in llm.named_modules(remove_duplicate=False)}
    found = (paths.get(id(llm.get_input_embeddings())), paths.get(id(llm.get_output_embeddings())))
    return tuple(f"language_model.{n}.weight" for n in found if n is not None)


def unit_parts(params: dict[str, nn.Parameter], opt: torch.optim.Optimizer | None, whole: Collection[str] = (),
               mesh: DeviceMesh | None = None) -> dict[str, tuple[nn.Parameter, dict[str, Any]]]:
    """Per FQN, what ``plait.parallel.unit_transfer.move_units`` copies and sends of a rank's parameters and their
    optimizer state: plain tensors sharing their storage, a sharded parameter's local shard (the same shard of a
    unit has the same shape in every pipeline). The FQNs in ``whole`` (:func:`tied_embedding_names`: sharded on a
    rank holding both the embedding and the head, whole on one holding one of them) go whole: a sharded one
    gathered over ``mesh`` (this rank's shard group; collective over it, its ranks passing the same FQNs)."""
    out = {}
    for fqn, p in params.items():
        state = opt.state.get(p, {}) if opt is not None else {}
        if not isinstance(p, DTensor):
            out[fqn] = (p, state)
        elif fqn in whole:
            full = {k: _gathered(v, p, mesh) if isinstance(v, DTensor) else v for k, v in state.items()}
            out[fqn] = (nn.Parameter(_gathered(p.detach(), p, mesh), requires_grad=p.requires_grad), full)
        else:
            out[fqn] = (nn.Parameter(local_tensor(p).detach(), requires_grad=p.requires_grad),
                        {k: local_tensor(v) if isinstance(v, DTensor) else v for k, v in state.items()})
    return out


def receive_parts(params: dict[str, nn.Parameter], whole: Collection[str] = ()) -> dict[str, nn.Parameter]:
    """Per FQN, what ``move_units`` fills of a rank's new parameters (:func:`unit_parts`' layout): a sharded
    parameter's local shard sharing its storage, or for the FQNs in ``whole`` a whole buffer (one per parameter)
    that :func:`place_parts` then shards."""
    buffers: dict[int, nn.Parameter] = {}
    out = {}
    for fqn, p in params.items():
        if not isinstance(p, DTensor):
            out[fqn] = p
        elif fqn in whole:
            out[fqn] = buffers.setdefault(id(p), nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                              requires_grad=p.requires_grad))
        else:
            out[fqn] = nn.Parameter(local_tensor(p).detach(), requires_grad=p.requires_grad)
    return out


def place_parts(params: dict[str, nn.Parameter], parts: dict[str, nn.Parameter], states: dict[str, dict[str, Any]],
                opt: torch.optim.Optimizer | None, whole: Collection[str] = ()) -> None:
    """After ``move_units`` filled ``parts`` (:func:`receive_parts`) and returned ``states`` (by FQN, in the same
    layout): the whole buffers sharded into their parameters, and each trainable parameter's state set in ``opt`` in
    its parameter's layout (a sharded one's tensors as DTensors of its mesh and placements; scalars, as AdamW's
    ``step``, stay plain)."""
    for fqn, p in params.items():
        spread = isinstance(p, DTensor) and fqn in whole
        if spread:
            with torch.no_grad():
                local_tensor(p).copy_(_sharded_like(parts[fqn].detach(), p).to_local())
        values = states.get(fqn)
        if not values or not p.requires_grad or opt is None:
            continue
        if isinstance(p, DTensor):
            values = {k: (_sharded_like(v, p) if spread else DTensor.from_local(
                v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()))
                      if isinstance(v, torch.Tensor) and v.dim() else v for k, v in values.items()}
        opt.state[p] = values


def _gathered(t: torch.Tensor, like: DTensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The whole of ``t`` (a DTensor of ``like``'s layout, on a group that may be gone) gathered over ``mesh``, a
    mesh of the same ranks in the same order (collective over it)."""
    if mesh is None:
        raise ValueError("a sharded tied embedding must be gathered, but this rank's new stages shard nothing")
    local = local_tensor(t).detach()
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride()).full_tensor()


def _sharded_like(t: torch.Tensor, like: DTensor) -> DTensor:
    """The whole tensor ``t`` (the same on every rank of ``like``'s mesh) as a DTensor in ``like``'s layout (a local
    slice: no communication)."""
    mesh = like.device_mesh
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, like.placements)


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
        if p.grad is not None:  # a sharded gradient: its local shard (pipeline 0's shard ranks count them all)
            sumsq += local_tensor(p.grad).detach().double().pow(2).sum()
    return clip_by_square_sum_([p.grad for p in hetero.params if p.grad is not None], sumsq, max_norm, reduce=True)

