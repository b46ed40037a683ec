"""Where ranks sit: GPUs per node, the order of the parallel axes in the rank numbering, and which collectives cross
nodes.

A launcher (``torchrun``) numbers the processes node by node: ranks ``0 .. G-1`` on the first node of ``G`` GPUs,
and so on. The rank layout (``plait.parallel.dims.ParallelDims``) numbers the coordinates of the parallel axes in a
fixed order, outermost first; the group of one axis (the ranks that differ only in that coordinate) therefore has a
stride of the product of the inner axes' degrees, and it stays inside one node only when stride x degree fits the
node (and the node boundaries fall between groups). Two orders are used:

- ``dp_outer``: ``dp, dp_shard, pp, cp, tp`` (plait's default: TP innermost, then CP, the pipeline, the data-parallel
  axes outermost);
- ``pp_outer``: ``pp, dp, dp_shard, cp, tp``: the pipeline outermost (Megatron-LM's and torchtitan's order: its
  point-to-point traffic is the lightest), so FSDP2's shard groups and the TP groups of one pipeline rank sit on
  consecutive ranks.

:func:`plan_rank_order` picks the order whose collectives cross nodes the least, weighing the axes by how much they
communicate per step: TP (an all-reduce in every layer) before the expert-parallel groups (four all-to-alls per MoE
layer; :func:`ep_crosses`) before CP (K/V in every attention layer) before FSDP2's ``dp_shard`` (an all-gather per
unit) before the replicas' ``dp`` (one gradient all-reduce) before the pipeline (one activation per microbatch and
stage boundary). Pure: no torch, no processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plait.planner.pipeline.types import P2PModel
from plait.planner.serialize import JsonDataclass

__all__ = ["RANK_AXES", "RANK_ORDERS", "Topology", "crossing_axes", "ep_crosses", "plan_rank_order"]

RANK_AXES = ("dp", "dp_shard", "pp", "cp", "tp")
"""The parallel axes of the rank layout, in plait's default order (outermost first)."""

RANK_ORDERS: dict[str, tuple[str, ...]] = {"dp_outer": RANK_AXES, "pp_outer": ("pp", "dp", "dp_shard", "cp", "tp")}
"""The axis orders a rank layout may use, by name (module docstring)."""

_WEIGHT = ("tp", "ep", "cp", "dp_shard", "dp", "pp")
"""Axes from the heaviest communicator per step to the lightest: the order :func:`plan_rank_order` weighs them."""


@dataclass(frozen=True)
class Topology(JsonDataclass):
    """The nodes a job's GPUs sit in and the links between them.

    Attributes:
        gpus_per_node: GPUs (ranks) per node; consecutive ranks fill a node (``torchrun``'s numbering).
        intra_link: the link between two GPUs of one node (NVLink); None: free.
        inter_link: the link between GPUs of different nodes (InfiniBand / RoCE, per GPU); None: free.

    Raises:
        ValueError: on ``gpus_per_node`` below 1.
    """

    gpus_per_node: int
    intra_link: P2PModel | None = None
    inter_link: P2PModel | None = None

    def __post_init__(self) -> None:
        if int(self.gpus_per_node) != self.gpus_per_node or self.gpus_per_node < 1:
            raise ValueError(f"Topology.gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")

    def link(self, crosses: bool) -> P2PModel | None:
        """``inter_link`` for a collective whose group crosses nodes, else ``intra_link``."""
        return self.inter_link if crosses else self.intra_link


def _check(order: Sequence[str], sizes: Mapping[str, int]) -> None:
    if sorted(order) != sorted(RANK_AXES):
        raise ValueError(f"a rank order names each of {RANK_AXES} once, got {tuple(order)}")
    unknown = set(sizes) - set(RANK_AXES)
    if unknown:
        raise ValueError(f"unknown axes {sorted(unknown)}; axes are {RANK_AXES}")
    bad = {a: s for a, s in sizes.items() if int(s) != s or s < 1}
    if bad:
        raise ValueError(f"axis degrees must be integers >= 1, got {bad}")


def crossing_axes(order: Sequence[str], sizes: Mapping[str, int], gpus_per_node: int) -> tuple[str, ...]:
    """The axes (of degree > 1) some group of which spans more than one node when the ranks are numbered in
    ``order`` (outermost first) and consecutive ranks fill nodes of ``gpus_per_node``; in ``order``.

    A group of axis ``a`` holds the ranks ``r0 + k * stride`` (``k < sizes[a]``, ``stride`` = the product of the
    degrees inside ``a``): it stays in one node exactly when ``stride * sizes[a]`` divides ``gpus_per_node`` or the
    whole world fits one node (the groups then tile the nodes).

    Args:
        order: a permutation of :data:`RANK_AXES`; sizes: degree per axis (missing axes: 1).

    Raises:
        ValueError: on an order that is not a permutation of the axes, an unknown axis or a degree below 1, or
            ``gpus_per_node`` below 1.
    """
    _check(order, sizes)
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    world = 1
    for axis in order:
        world *= sizes.get(axis, 1)
    out = []
    for i, axis in enumerate(order):
        degree = sizes.get(axis, 1)
        if degree == 1 or world <= gpus_per_node:
            continue
        stride = 1
        for inner in order[i + 1:]:
            stride *= sizes.get(inner, 1)
        if gpus_per_node % (stride * degree):
            out.append(axis)
    return tuple(out)


def plan_rank_order(sizes: Mapping[str, int], gpus_per_node: int, ep: int = 1) -> str:
    """The name (a :data:`RANK_ORDERS` key) of the rank order under which the heaviest communicating axes stay
    inside nodes (module docstring): the orders are compared by which axes cross nodes, heaviest axis first
    (TP, then the expert-parallel groups of ``ep`` data-parallel ranks, :func:`ep_crosses`: four all-to-alls per
    MoE layer, then CP, dp_shard, dp, pp); a tie keeps ``dp_outer``. E.g. 32 GPUs in nodes of 8 with ``pp`` 4,
    ``tp`` 2 and ``dp_shard`` 4: ``dp_outer`` puts every FSDP2 shard group across 4 nodes, ``pp_outer`` keeps it in
    one, so ``pp_outer``.

    Raises:
        ValueError: as :func:`crossing_axes` and :func:`ep_crosses`.
    """
    def cost(name: str) -> tuple[bool, ...]:
        crossing = set(crossing_axes(RANK_ORDERS[name], sizes, gpus_per_node))
        if ep > 1 and ep_crosses(RANK_ORDERS[name], sizes, ep, gpus_per_node):
            crossing.add("ep")
        return tuple(axis in crossing for axis in _WEIGHT)

    return min(RANK_ORDERS, key=lambda name: (cost(name), name != "dp_outer"))


def ep_crosses(order: Sequence[str], sizes: Mapping[str, int], ep: int, gpus_per_node: int) -> bool:
    """Whether an expert-parallel group spans more than one node: its ``ep`` ranks are consecutive coordinates of the
    data-parallel axes ``dp x dp_shard`` taken innermost first (as torchtitan takes EP from ``dp_shard``), so they
    are ``r0 + k * stride`` with ``stride`` the product of the degrees inside ``dp_shard`` in ``order``; the group
    stays in one node exactly when ``stride * ep`` divides ``gpus_per_node`` or the whole world fits one node.

    Raises:
        ValueError: as :func:`crossing_axes`, or when ``ep`` does not divide ``dp x dp_shard``.
    """
    _check(order, sizes)
    data = sizes.get("dp", 1) * sizes.get("dp_shard", 1)
    if ep < 1 or data % ep:
        raise ValueError(f"EP degree {ep} must divide dp x dp_shard = {data}")
    world = 1
    for axis in order:
        world *= sizes.get(axis, 1)
    if ep == 1 or world <= gpus_per_node:
        return False
    stride = 1
    for inner in order[order.index("dp_shard") + 1:]:
        stride *= sizes.get(inner, 1)
    return bool(gpus_per_node % (stride * ep))
