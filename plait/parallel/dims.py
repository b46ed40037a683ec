"""The one rank layout of a job: parallel degrees, rank <-> coordinates, the named DeviceMesh and process groups.

Every trainer, the pipeline runtime and the mesh code take their coordinates from :class:`ParallelDims`; the layout
formula lives only here. Global rank ``= (dp_rank * pp + pp_rank) * cp + cp_rank``: the CP axis innermost (the
ranks of one stage's CP group are consecutive: the all-gather of K/V in every attention layer is the most
frequent collective), then the pipeline axis, the DP replicas outermost. Later degrees (sharded DP, tensor
parallelism, replica groups) are added here as further axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch.distributed as dist

__all__ = ["AXES", "ParallelDims", "RankCoords", "new_groups"]

AXES = ("dp", "pp", "cp")
"""Axis names, outermost first (the order of the rank layout and of the DeviceMesh dimensions)."""


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates: DP replica, pipeline rank, CP rank."""

    dp: int
    pp: int
    cp: int


@dataclass(frozen=True)
class ParallelDims:
    """Validated DP x PP x CP degrees of a job (module docstring for the layout).

    Attributes:
        dp: DP replicas (model copies trained on different samples).
        pp: pipeline ranks per replica (``parallel.pp.degree``; 1 without pipeline parallelism).
        cp: CP ranks per stage (``parallel.cp``), sharing the tokens of every microbatch.

    Raises:
        ValueError: on a degree below 1.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.pp, self.cp) < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp}, pp={self.pp}, cp={self.cp}")

    @classmethod
    def from_world(cls, world_size: int, pp: int = 1, cp: int = 1, dp: int = 0) -> "ParallelDims":
        """The degrees of a job of ``world_size`` processes; ``dp`` = 0 takes the DP degree from the world size.

        Raises:
            ValueError: when ``dp x pp x cp`` (``dp`` given) is not ``world_size``, or ``world_size`` is not a
                multiple of ``pp x cp``; the message says how many processes to launch.
        """
        if min(pp, cp) < 1 or dp < 0:
            raise ValueError(f"parallel degrees must be >= 1, got dp={dp}, pp={pp}, cp={cp}")
        per_replica = pp * cp
        if dp and dp * per_replica != world_size:
            n = dp * per_replica
            raise ValueError(
                f"parallel.dp={dp} x parallel.pp.degree={pp} x parallel.cp={cp} = {n} processes does not fit the "
                f"world size {world_size}: launch exactly {n} processes, e.g. torchrun --nproc_per_node {n} (or "
                f"leave parallel.dp unset for any multiple of {per_replica})"
            )
        if world_size % per_replica or world_size < 1:
            raise ValueError(
                f"parallel.pp.degree={pp} x parallel.cp={cp} does not fit the world size {world_size}: launch a "
                f"multiple of {per_replica} processes, e.g. torchrun --nproc_per_node {per_replica}"
            )
        return cls(world_size // per_replica, pp, cp)

    @property
    def world_size(self) -> int:
        """Processes of the job: ``dp * pp * cp``."""
        return self.dp * self.pp * self.cp

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Degrees in :data:`AXES` order."""
        return (self.dp, self.pp, self.cp)

    def rank(self, dp: int, pp: int, cp: int) -> int:
        """Global rank of coordinates ``(dp, pp, cp)``: ``(dp * pp_degree + pp) * cp_degree + cp``.

        Raises:
            ValueError: on a coordinate outside its degree.
        """
        for name, value, size in zip(AXES, (dp, pp, cp), self.sizes):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} outside [0, {size})")
        return (dp * self.pp + pp) * self.cp + cp

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank`` (inverse of :meth:`rank`).

        Raises:
            ValueError: on a rank outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        rest, cp = divmod(rank, self.cp)
        dp, pp = divmod(rest, self.pp)
        return RankCoords(dp, pp, cp)

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
                ranks.append(self.rank(at["dp"], at["pp"], at["cp"]))
            out.append(sorted(ranks))
        return out

    def pipeline_ranks(self, rank: int) -> tuple[int, ...]:
        """Global ranks of the pipeline of ``rank`` (same DP replica and CP rank), by pipeline rank."""
        c = self.coords(rank)
        return tuple(self.rank(c.dp, q, c.cp) for q in range(self.pp))

    def build_mesh(self, device_type: str, axes: Sequence[str] = AXES) -> Any:
        """The named DeviceMesh of this layout over ``axes`` (a subset of :data:`AXES` whose other degrees are
        1, in that order). Collective: every rank calls it.

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
