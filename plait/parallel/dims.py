"""The one rank layout of a job: parallel degrees, rank <-> coordinates, the named DeviceMesh and process groups.

Every trainer, the pipeline runtime and the mesh code take their coordinates from :class:`ParallelDims`; the layout
formula lives only here. Axes, outermost first: ``dp`` (replicas), ``dp_shard`` (FSDP2 shard ranks; HSDP when both
are above 1), ``pp`` (pipeline), ``cp`` (context), ``tp`` (tensor parallelism)::

    rank = ((((dp * dp_shard + shard) * pp + pp_rank) * cp + cp_rank) * tp + tp_rank)

TP innermost (a collective in every layer: its ranks are consecutive, on one node), then CP (the all-gather of K/V
in every attention layer), then the pipeline axis, the data-parallel axes outermost. With ``dp_shard = tp = 1`` this
is ``(dp * pp + pp_rank) * cp + cp_rank``. The data-parallel "batch" axis (ranks that get their own share of the
samples) is ``dp x dp_shard``; the CP and TP ranks of one batch shard see the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import product
from typing import Any

import torch.distributed as dist

__all__ = ["AXES", "ParallelDims", "RankCoords", "new_groups"]

AXES = ("dp", "dp_shard", "pp", "cp", "tp")
"""Axis names, outermost first (the order of the rank layout and of the DeviceMesh dimensions)."""


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

    Raises:
        ValueError: on a degree below 1.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if min(self.sizes) < 1:
            raise ValueError(f"parallel degrees must be >= 1, got {self._describe()}")

    def _describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def from_world(cls, world_size: int, pp: int = 1, cp: int = 1, dp: int = 0, dp_shard: int = 1,
                   tp: int = 1) -> "ParallelDims":
        """The degrees of a job of ``world_size`` processes; ``dp`` = 0 takes the replica degree from the world size.

        Raises:
            ValueError: when ``dp x dp_shard x pp x cp x tp`` (``dp`` given) is not ``world_size``, or
                ``world_size`` is not a multiple of ``dp_shard x pp x cp x tp``; the message says how many
                processes to launch.
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
        return cls(world_size // per_replica, pp, cp, dp_shard, tp)

    @property
    def world_size(self) -> int:
        """Processes of the job: ``dp * dp_shard * pp * cp * tp``."""
        out = 1
        for size in self.sizes:
            out *= size
        return out

    @property
    def sizes(self) -> tuple[int, ...]:
        """Degrees in :data:`AXES` order."""
        return (self.dp, self.dp_shard, self.pp, self.cp, self.tp)

    @property
    def batch(self) -> int:
        """Ranks with their own share of every global batch: ``dp * dp_shard``."""
        return self.dp * self.dp_shard

    def batch_rank(self, rank: int) -> int:
        """Index of ``rank``'s share of the batch in ``[0, batch)``: ``dp * dp_shard + shard``."""
        c = self.coords(rank)
        return c.dp * self.dp_shard + c.dp_shard

    def rank(self, dp: int, pp: int, cp: int, dp_shard: int = 0, tp: int = 0) -> int:
        """Global rank of coordinates (module docstring for the formula).

        Raises:
            ValueError: on a coordinate outside its degree.
        """
        at = (dp, dp_shard, pp, cp, tp)
        out = 0
        for name, value, size in zip(AXES, at, self.sizes):
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
        for name, size in zip(reversed(AXES), reversed(self.sizes)):
            rank, at[name] = divmod(rank, size)
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
        for outer in product(*(range(self.sizes[AXES.index(a)]) for a in fixed)):
            at = dict(zip(fixed, outer))
            ranks = []
            for inner in product(*(range(self.sizes[AXES.index(a)]) for a in axes)):
                at.update(zip(axes, inner))
                ranks.append(self.rank(**at))
            out.append(sorted(ranks))
        return out

    def pipeline_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the pipeline of ``rank`` (its other coordinates fixed), by pipeline rank."""
        c = self.coords(rank)
        return tuple(self.rank(c.dp, q, c.cp, c.dp_shard, c.tp) for q in range(self.pp))

    def build_mesh(self, device_type: str, axes: Sequence[str] = AXES) -> Any:
        """The named DeviceMesh of this layout over ``axes`` (a subset of :data:`AXES` whose other degrees are
        1, kept in :data:`AXES` order); slice it by name (``mesh["dp", "dp_shard"]``, ``mesh["tp"]``) for the
        groups of one axis or several. Collective: every rank calls it.

        Raises:
            ValueError: when a left-out axis has a degree above 1 or the world size differs from the process
                group's.
        """
        from torch.distributed.device_mesh import init_device_mesh

        left_out = [a for a in AXES if a not in axes and self.sizes[AXES.index(a)] > 1]
        if left_out:
            raise ValueError(f"a mesh over {tuple(axes)} leaves out axes {left_out} of degree > 1")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"the layout has {self.world_size} ranks, the process group {dist.get_world_size()}")
        names = tuple(a for a in AXES if a in axes)
        return init_device_mesh(device_type, tuple(self.sizes[AXES.index(a)] for a in names), mesh_dim_names=names)

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
