"""The one rank layout of a job: parallel degrees, rank <-> coordinates, the named DeviceMesh and process groups.

Every trainer, the pipeline runtime and the mesh code take their coordinates from :class:`ParallelDims`; the layout
formula lives only here. Axes: ``dp`` (replicas), ``dp_shard`` (FSDP2 shard ranks; HSDP when both are above 1),
``pp`` (pipeline), ``cp`` (context), ``tp`` (tensor parallelism), numbered row-major in the layout's ``order``
(outermost first; ``plait.planner.cost.topology.RANK_ORDERS``). The default, ``dp_outer``::

    rank = ((((dp * dp_shard + shard) * pp + pp_rank) * cp + cp_rank) * tp + tp_rank)

TP innermost (a collective in every layer: its ranks are consecutive, on one node), then CP (the all-gather of K/V
in every attention layer), then the pipeline axis, the data-parallel axes outermost. With ``dp_shard = tp = 1`` this
is ``(dp * pp + pp_rank) * cp + cp_rank``. ``pp_outer`` puts the pipeline outermost
(``((((pp_rank * dp + dp) * dp_shard + shard) * cp + cp_rank) * tp + tp_rank)``), so the FSDP2 shard and TP groups
of one pipeline rank are consecutive ranks, on one node when they fit (``topology.plan_rank_order`` picks it). The
data-parallel "batch" axis (ranks that get their own share of the samples) is ``dp x dp_shard``; the CP and TP ranks
of one batch shard see the same samples.

Expert parallelism (``ep``) is no axis of its own: as in Megatron-Core and torchtitan it splits the batch axis. The
``ep`` consecutive batch ranks ``b`` with the same ``b // ep`` (same pipeline, CP and TP coordinates) form one EP
group, each holding ``1/ep`` of every MoE layer's experts; the batch ranks with the same ``b % ep`` hold the same
experts and sum their gradients (the expert-data-parallel group, ``batch / ep`` ranks). Under CP an EP group is
the ranks of one CP index (each routes its own share of its batch rank's tokens, a MoE layer acting on each token
alone), and the expert-data-parallel group spans the CP axis too (``cp x batch / ep`` ranks: the CP ranks of one
batch rank hold the same experts, each with the gradient of its share of the tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass, fields
from itertools import product
from typing import Any

import os

import torch.distributed as dist

from plait.planner.cost.topology import RANK_AXES, RANK_ORDERS, plan_rank_order

__all__ = ["AXES", "ParallelDims", "RankCoords", "new_groups"]

AXES = RANK_AXES
"""Axis names in the default order, outermost first (``dp_outer``; a layout's own order is ``ParallelDims.order``)."""


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates: DP replica, pipeline rank, CP rank, FSDP2 shard rank, TP rank."""

    dp: int
    pp: int
    cp: int
    dp_shard: int = 0
    tp: int = 0


@dataclass(frozen=True)
class ParallelDims:
    """Validated degrees of a job (module docstring for the layout).

    Attributes:
        dp: DP replicas (full model copies, or HSDP replica groups, trained on different samples).
        pp: pipeline ranks per replica (``parallel.pp.degree``; 1 without pipeline parallelism).
        cp: CP ranks per stage (``parallel.cp``), sharing the tokens of every microbatch.
        dp_shard: FSDP2 shard degree (``parallel.dp_shard``): ranks holding a shard of every parameter, each
            training on its own samples.
        tp: tensor-parallel degree (``parallel.tp``): ranks splitting the heads and MLPs of every layer.
        rank_order: the name of the axis order ranks are numbered in (``topology.RANK_ORDERS``: ``"dp_outer"``,
            the default, or ``"pp_outer"``; module docstring).
        ep: expert-parallel degree (``parallel.ep``): ranks of the batch axis splitting every MoE layer's experts
            (module docstring); it divides ``dp x dp_shard``.

    Raises:
        ValueError: on a degree below 1, an unknown rank order or an ``ep`` that does not divide ``dp x dp_shard``.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    dp_shard: int = 1
    tp: int = 1
    rank_order: str = "dp_outer"
    ep: int = 1

    def __post_init__(self) -> None:
        if min(self.sizes) < 1 or self.ep < 1:
            raise ValueError(f"parallel degrees must be >= 1, got {self._describe()}")
        if self.batch % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the data-parallel ranks dp x dp_shard = "
                             f"{self.dp} x {self.dp_shard} (expert parallelism splits the batch axis)")
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"rank_order must be one of {sorted(RANK_ORDERS)}, got {self.rank_order!r}")

    @property
    def order(self) -> tuple[str, ...]:
        """The axes in the order ranks are numbered, outermost first."""
        return RANK_ORDERS[self.rank_order]

    def size(self, axis: str) -> int:
        """The degree of ``axis`` (one of :data:`AXES`)."""
        return self.sizes[AXES.index(axis)]

    def _describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def from_world(cls, world_size: int, pp: int = 1, cp: int = 1, dp: int = 0, dp_shard: int = 1,
                   tp: int = 1, rank_order: str = "dp_outer", ep: int = 1) -> "ParallelDims":
        """The degrees of a job of ``world_size`` processes; ``dp`` = 0 takes the replica degree from the world size.

        Raises:
            ValueError: when ``dp x dp_shard x pp x cp x tp`` (``dp`` given) is not ``world_size``, or
                ``world_size`` is not a multiple of ``dp_shard x pp x cp x tp``; the message says how many
                processes to launch; when ``ep`` does not divide ``dp x dp_shard``.
        """
        if min(pp, cp, dp_shard, tp) < 1 or dp < 0:
            raise ValueError(f"parallel degrees must be >= 1, got dp={dp}, pp={pp}, cp={cp}, dp_shard={dp_shard}, "
                             f"tp={tp}")
        per_replica = dp_shard * pp * cp * tp
        extra = "".join(f" x parallel.{name}={v}" for name, v in (("dp_shard", dp_shard), ("tp", tp)) if v > 1)
        if dp and dp * per_replica != world_size:
            n = dp * per_replica
            raise ValueError(
                f"parallel.dp={dp} x parallel.pp.degree={pp} x parallel.cp={cp}{extra} = {n} processes does not fit "
                f"the world size {world_size}: launch exactly {n} processes, e.g. torchrun --nproc_per_node {n} (or "
                f"leave parallel.dp unset for any multiple of {per_replica})"
            )
        if world_size % per_replica or world_size < 1:
            raise ValueError(
                f"parallel.pp.degree={pp} x parallel.cp={cp}{extra} does not fit the world size {world_size}: launch "
                f"a multiple of {per_replica} processes, e.g. torchrun --nproc_per_node {per_replica}"
            )
        return cls(world_size // per_replica, pp, cp, dp_shard, tp, rank_order, ep)

    def ordered(self, setting: str, gpus_per_node: int = 0) -> "ParallelDims":
        """This layout numbered in the order ``setting`` names (``parallel.rank_order``): a ``RANK_ORDERS`` key, or
        ``"auto"``: the order ``topology.plan_rank_order`` picks for nodes of ``gpus_per_node`` processes (0:
        ``torchrun``'s ``LOCAL_WORLD_SIZE``, or every process on one node when it is not set).

        Raises:
            ValueError: on an unknown setting, a negative ``gpus_per_node``, or one that disagrees with torchrun's
                ``LOCAL_WORLD_SIZE`` under ``"auto"``.
        """
        if gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
        if setting != "auto":
            return dataclasses.replace(self, rank_order=setting)
        launched = os.environ.get("LOCAL_WORLD_SIZE")
        if gpus_per_node and launched is not None and int(launched) != gpus_per_node:
            raise ValueError(f"parallel.gpus_per_node={gpus_per_node} but torchrun runs {launched} processes per node "
                             "(LOCAL_WORLD_SIZE): leave parallel.gpus_per_node at 0 (torchrun's) or make them agree")
        per_node = gpus_per_node or int(launched or self.world_size)
        sizes = {a: self.size(a) for a in AXES}
        return dataclasses.replace(self, rank_order=plan_rank_order(sizes, max(per_node, 1), self.ep))

    @property
    def world_size(self) -> int:
        """Processes of the job: ``dp * dp_shard * pp * cp * tp``."""
        out = 1
        for size in self.sizes:
            out *= size
        return out

    @property
    def sizes(self) -> tuple[int, ...]:
        """Degrees in :data:`AXES` order (not the layout's ``order``)."""
        return (self.dp, self.dp_shard, self.pp, self.cp, self.tp)

    @property
    def batch(self) -> int:
        """Ranks with their own share of every global batch: ``dp * dp_shard``."""
        return self.dp * self.dp_shard

    def batch_rank(self, rank: int) -> int:
        """Index of ``rank``'s share of the batch in ``[0, batch)``: ``dp * dp_shard + shard``."""
        c = self.coords(rank)
        return c.dp * self.dp_shard + c.dp_shard

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """The EP groups (``ep`` ranks of one CP index splitting the experts) and the expert-data-parallel groups
        (``cp x batch / ep`` ranks holding the same experts, summing their gradients) of this layout (module
        docstring), each a partition of the ranks, ranks ascending within a group."""
        ep_groups: dict[tuple[int, ...], list[int]] = {}
        replica_groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c, b = self.coords(r), self.batch_rank(r)
            ep_groups.setdefault((c.pp, c.cp, c.tp, b // self.ep), []).append(r)
            replica_groups.setdefault((c.pp, c.tp, b % self.ep), []).append(r)
        return ([sorted(g) for _, g in sorted(ep_groups.items())],
                [sorted(g) for _, g in sorted(replica_groups.items())])

    def ep_rank(self, rank: int) -> int:
        """``rank``'s index in its EP group (which ``1/ep`` of the experts it holds): ``batch_rank % ep``."""
        return self.batch_rank(rank) % self.ep

    def rank(self, dp: int, pp: int, cp: int, dp_shard: int = 0, tp: int = 0) -> int:
        """Global rank of coordinates (module docstring for the formula of each order).

        Raises:
            ValueError: on a coordinate outside its degree.
        """
        at = {"dp": dp, "dp_shard": dp_shard, "pp": pp, "cp": cp, "tp": tp}
        out = 0
        for name in self.order:
            value, size = at[name], self.size(name)
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} outside [0, {size})")
            out = out * size + value
        return out

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank`` (inverse of :meth:`rank`).

        Raises:
            ValueError: on a rank outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        at = {}
        for name in reversed(self.order):
            rank, at[name] = divmod(rank, self.size(name))
        return RankCoords(**at)

    def groups(self, axes: Sequence[str]) -> list[list[int]]:
        """The partition of the ranks into the groups spanning ``axes`` (the other coordinates fixed): e.g.
        ``("cp",)`` gives every stage's CP group, ``("dp", "cp")`` every pipeline rank's gradient group. Groups in
        the order of the fixed coordinates, ranks ascending within a group.

        Raises:
            ValueError: on an unknown axis name.
        """
        unknown = set(axes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; axes are {AXES}")
        fixed = [a for a in AXES if a not in axes]
        out = []
        for outer in product(*(range(self.size(a)) for a in fixed)):
            at = dict(zip(fixed, outer))
            ranks = []
            for inner in product(*(range(self.size(a)) for a in axes)):
                at.update(zip(axes, inner))
                ranks.append(self.rank(**at))
            out.append(sorted(ranks))
        return out

    def pipeline_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the pipeline of ``rank`` (its other coordinates fixed), by pipeline rank."""
        c = self.coords(rank)
        return tuple(self.rank(c.dp, q, c.cp, c.dp_shard, c.tp) for q in range(self.pp))

    def build_mesh(self, device_type: str, axes: Sequence[str] | None = None) -> Any:
        """The named DeviceMesh of this layout over ``axes`` (default all; a subset whose other degrees are 1), its
        dimensions in the layout's ``order``; slice it by name (``mesh["dp", "dp_shard"]``, ``mesh["tp"]``) for the
        groups of one axis or several. Collective: every rank calls it.

        Raises:
            ValueError: when a left-out axis has a degree above 1 or the world size differs from the process
                group's.
        """
        from torch.distributed.device_mesh import init_device_mesh

        axes = self.order if axes is None else tuple(axes)
        left_out = [a for a in AXES if a not in axes and self.size(a) > 1]
        if left_out:
            raise ValueError(f"a mesh over {tuple(axes)} leaves out axes {left_out} of degree > 1")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"the layout has {self.world_size} ranks, the process group {dist.get_world_size()}")
        names = tuple(a for a in self.order if a in axes)
        return init_device_mesh(device_type, tuple(self.size(a) for a in names), mesh_dim_names=names)

    def new_group(self, axes: Sequence[str], rank: int, needed: bool = True) -> Any:
        """The process group of ``rank`` spanning ``axes`` (every group of :meth:`groups` is created, in the same
        order on every rank: collective); None when not ``needed``."""
        return new_groups(self.groups(axes), rank, needed)


def new_groups(partition: Sequence[Sequence[int]], rank: int, needed: bool = True) -> Any:
    """Create one process group per list of ``partition`` (every rank creates all of them, in the same order:
    ``new_group`` is collective) and return the one holding ``rank``; None when ``needed`` is False."""
    if not needed:
        return None
    mine = None
    for ranks in partition:
        group = dist.new_group(list(ranks))
        mine = group if rank in ranks else mine
    return mine
