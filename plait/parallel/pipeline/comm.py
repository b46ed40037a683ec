"""This process's place in a DP x PP x CP pipeline job (:class:`PipelineComm`), the process groups it uses and the
state its channels keep across steps (:class:`ChannelCapacities`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.dims import ParallelDims, new_groups

__all__ = ["ChannelCapacities", "MIN_CAPACITY", "PipelineComm", "build_pipeline_comm", "pipeline_comm_from_mesh"]

MIN_CAPACITY = 1 << 16
"""Bytes of the first pre-posted receive of a channel (gloo packed messages)."""


class ChannelCapacities:
    """Bytes a packed message may put in its pre-posted receive, per ``(sender, receiver)`` global ranks.

    Sender and receiver each hold one (in their :class:`PipelineComm`, so it lasts across steps) and the transport
    (:mod:`plait.parallel.pipeline.transport`) grows both by the same rule from the same messages, so they always
    agree.
    """

    def __init__(self) -> None:
        self.table: dict[tuple[int, int], int] = {}

    def get(self, src: int, dst: int) -> int:
        """Capacity (bytes) of the channel ``src -> dst``."""
        return self.table.get((src, dst), MIN_CAPACITY)

    def grow(self, src: int, dst: int, total: int) -> None:
        """After a message of ``total`` bytes from ``src`` to ``dst``: room for it (next power of two) from now on."""
        self.table[(src, dst)] = max(self.get(src, dst), 1 << max(0, total - 1).bit_length())


@dataclass(frozen=True)
class PipelineComm:
    """This process's place in a DP x PP x CP job.

    Rank layout: :class:`~plait.parallel.dims.ParallelDims` (the CP axis innermost, then the pipeline axis). A
    pipeline is the ``pp`` ranks with one ``(dp_rank, cp_rank)``: its P2P messages carry the hidden states of that
    CP rank's tokens only. With FSDP2 (``dp_shard`` > 1) every shard rank has its own pipeline and share of the
    batch: the DP axis here is the batch axis ``dp x dp_shard`` (``ParallelDims.batch``).

    Attributes:
        pp_rank: coordinate on the pipeline axis (the plan's rank numbering).
        pp_ranks: global rank of every pipeline rank of this process's pipeline (same ``dp_rank``/``cp_rank``).
        dp_rank: index of this pipeline's share of the batch among the DP x FSDP2 pipelines
            (``ParallelDims.batch_rank``).
        dp_size: number of such pipelines (``dp x dp_shard``).
        dp_group: process group of the ranks with this ``pp_rank`` and ``cp_rank`` in every pipeline (None when
            ``dp_size == 1``).
        device: device of this rank's stages (P2P buffers live there: CPU for gloo, CUDA for NCCL).
        cp_rank: index of this rank in its stage's CP group.
        cp_size: CP degree (ranks sharing the tokens of every microbatch of one stage).
        cp_group: process group of this stage's CP ranks (None when ``cp_size == 1``); plait attention gathers
            K/V over it.
        grad_group: process group of every rank holding this ``pp_rank``'s stages (DP x CP ranks), over which
            gradients are summed (None when ``dp_size * cp_size == 1``; the DP group when ``cp_size == 1``).
        capacities: the receive capacities of the packed gloo transport, per channel, kept across steps
            (:class:`ChannelCapacities`; both ends of a channel grow theirs alike).
        tp_rank: index of this rank among its stage's TP ranks (same other coordinates).
        tp_size: TP degree (ranks holding a shard of this rank's stages' split modules; each has its own
            pipeline of the same-``tp_rank`` ranks).
        replica_groups: per plan (its JSON), the gradient group of each replicated encoder stage this rank runs
            (:mod:`plait.parallel.pipeline.replicas`), made on the first step that needs them.
    """

    pp_rank: int = 0
    pp_ranks: tuple[int, ...] = (0,)
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    grad_group: Any = None
    capacities: ChannelCapacities = field(default_factory=ChannelCapacities, compare=False, repr=False)
    tp_rank: int = 0
    tp_size: int = 1
    replica_groups: dict[str, dict[int, Any]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        """True when this pipeline spans several processes (a default process group exists and there is more
        than one pipeline rank or stage copy). A one-process comm (the default) stays local even inside a
        distributed job, e.g. the profiler timing the runtime on rank 0 alone."""
        spans = len(self.pp_ranks) * self.stage_replicas > 1
        return spans and dist.is_available() and dist.is_initialized()

    @property
    def stage_replicas(self) -> int:
        """Ranks holding a copy of this rank's stages (``dp_size * cp_size``): the gradient sum runs over them."""
        return self.dp_size * self.cp_size

    @property
    def reduce_group(self) -> Any:
        """The group of the gradient sum (``grad_group``, falling back to ``dp_group`` for comms built without
        CP)."""
        return self.grad_group if self.grad_group is not None else self.dp_group


def build_pipeline_comm(pp_size: int, device: torch.device | str = "cpu", cp_size: int = 1,
                        dp_size: int = 0, dp_shard: int = 1, tp: int = 1, rank_order: str = "dp_outer") -> PipelineComm:
    """Coordinates of this process in a DP x PP x CP job laid out by :class:`~plait.parallel.dims.ParallelDims`
    (see :class:`PipelineComm`); creates the DP, CP and gradient (DP x CP) groups. Collective: every rank must
    call it, with the same degrees (``dp_size`` = 0: from the world size). ``dp_shard`` and ``tp``: the FSDP2 and
    TP degrees; every (shard, TP) coordinate has its own pipelines and groups; ``rank_order``: the layout's axis
    order (``ParallelDims.rank_order``).

    Raises:
        ValueError: when the degrees do not fit the world size (:meth:`ParallelDims.from_world`).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims = ParallelDims.from_world(world, pp_size, cp_size, dp_size, dp_shard, tp, rank_order)
    at = dims.coords(rank)
    dp_group = dims.new_group(("dp", "dp_shard"), rank, dims.batch > 1)
    cp_group = dims.new_group(("cp",), rank, dims.cp > 1)
    grad_group = dp_group
    if dims.cp > 1:
        grad_group = dims.new_group(("dp", "dp_shard", "cp"), rank, dims.batch > 1)
        grad_group = cp_group if grad_group is None else grad_group  # dp = 1: the CP group holds every copy
    if dist.is_initialized():
        dist.barrier()  # NCCL: the default communicator exists before the first batched P2P call
    return PipelineComm(at.pp, dims.pipeline_ranks(rank), dims.batch_rank(rank), dims.batch, dp_group,
                        torch.device(device), at.cp, dims.cp, cp_group, grad_group, tp_rank=at.tp, tp_size=dims.tp)


def pipeline_comm_from_mesh(mesh: Any, device: torch.device | str = "cpu") -> PipelineComm:
    """:class:`PipelineComm` from a ``DeviceMesh`` with a ``"pp"`` axis and optionally ``"dp"`` and ``"cp"`` axes.
    With a ``"cp"`` axis of size > 1 the gradient groups (the ``"dp"`` x ``"cp"`` ranks of each pipeline
    coordinate) are created here: collective, every rank must call it.

    Raises:
        ValueError: when the mesh has no ``"pp"`` axis.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ValueError(f"the device mesh has axes {names}; a pipeline needs a 'pp' axis")
    pp_mesh = mesh["pp"]
    ranks = tuple(int(r) for r in pp_mesh.mesh.flatten().tolist())
    dp_size, dp_rank, group = 1, 0, None
    if "dp" in names and mesh["dp"].size() > 1:
        dp_size, dp_rank, group = mesh["dp"].size(), mesh.get_local_rank("dp"), mesh["dp"].get_group()
    cp_size, cp_rank, cp_group, grad_group = 1, 0, None, group
    if "cp" in names and mesh["cp"].size() > 1:
        cp_size, cp_rank, cp_group = mesh["cp"].size(), mesh.get_local_rank("cp"), mesh["cp"].get_group()
        grad_group = cp_group
        if dp_size > 1:
            grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1).tolist()
            grad_group = new_groups(grid, dist.get_rank(), True)
    return PipelineComm(mesh.get_local_rank("pp"), ranks, dp_rank, dp_size, group, torch.device(device), cp_rank,
                        cp_size, cp_group, grad_group)
