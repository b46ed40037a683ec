"""Joining the job: this process's rank, world size and device (the rank layout, meshes and groups:
:mod:`plait.parallel.dims`)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.models.device import resolve_device

__all__ = ["DistInfo", "NodeLayout", "broadcast_from_main", "init_distributed", "max_over_ranks", "node_layout"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: global rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of the job as ``torchrun`` describes them to each worker.

    Attributes:
        nodes: agents (nodes) of the job (``GROUP_WORLD_SIZE``; 1 without torchrun).
        per_node: processes per node (``LOCAL_WORLD_SIZE``).
        node_rank: this process's node (``GROUP_RANK``).
    """

    nodes: int
    per_node: int
    node_rank: int

    def describe(self) -> str:
        """``"2 nodes x 4 processes"`` (one node: ``"1 node x 4 processes"``)."""
        return f"{self.nodes} node{'s' * (self.nodes != 1)} x {self.per_node} process{'es' * (self.per_node != 1)}"


def node_layout(environ: Any = None) -> NodeLayout:
    """The node layout from ``torchrun``'s variables (``environ``, default ``os.environ``), checked: every node
    runs the same number of processes and ranks are numbered node by node (rank ``r`` on node ``r // per_node``),
    which the rank order (``parallel.rank_order``) relies on to keep groups inside nodes. Without torchrun: one
    node holding every process.

    Raises:
        ValueError: naming the variables when ``WORLD_SIZE`` is not ``GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE`` (nodes
            with different process counts: start every node with the same ``--nproc_per_node``) or this rank is
            not on node ``RANK // LOCAL_WORLD_SIZE``.
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    per_node = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    nodes = int(env.get("GROUP_WORLD_SIZE", str(max(world // max(per_node, 1), 1))))
    node_rank = int(env.get("GROUP_RANK", str(rank // max(per_node, 1))))
    if per_node < 1 or nodes * per_node != world:
        raise ValueError(f"WORLD_SIZE={world} is not GROUP_WORLD_SIZE={nodes} nodes x LOCAL_WORLD_SIZE={per_node} "
                         "processes: plait needs the same number of processes on every node (torchrun "
                         "--nproc_per_node N on each)")
    if rank // per_node != node_rank:
        raise ValueError(f"RANK={rank} with LOCAL_WORLD_SIZE={per_node} would be on node {rank // per_node}, but "
                         f"GROUP_RANK={node_rank}: ranks must be numbered node by node (torchrun's numbering)")
    return NodeLayout(nodes, per_node, node_rank)


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Join the process group started by ``torchrun`` (``WORLD_SIZE`` > 1), or run as a single process.

    The device is ``resolve_device(device, LOCAL_RANK)``; the backend is NCCL on GPU and gloo on CPU unless given.
    The node layout is checked first (:func:`node_layout`); the process group's keys live under a prefix of this
    start of the job (:func:`_attempt_store`), so a job restarted by torchrun never reads the keys of the one before.

    Raises:
        ValueError: for NCCL on a CPU device, a node layout plait cannot number, and as ``resolve_device``.
    """
    node_layout()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("parallel.backend='nccl' needs CUDA devices; use gloo on CPU")
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=_attempt_store(world, timeout), rank=rank, world_size=world,
                                timeout=timeout)
    return DistInfo(rank, world, local_rank, dev)


def _attempt_store(world: int, timeout: datetime.timedelta) -> Any:
    """The job's store (torchrun's ``env://`` rendezvous: the agent's store, or one hosted by rank 0) under a prefix
    of its own for this start of the job: every process adds 1 to ``plait/joined`` once, so the ``k``-th start
    (``torchrun --max-restarts``) is the one whose counts fall in ``(k world, (k + 1) world]``. A store kept across
    a restart (torchrun's static rendezvous, or its shared rendezvous store) still holds the process group keys of
    the attempt before, and gloo's full-mesh connect then reads a dead peer's address (``Connection refused`` after
    the timeout; pytorch/pytorch#135712); the prefix leaves them unread."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = (store.add("plait/joined", 1) - 1) // world
    return dist.PrefixStore(f"plait/attempt{attempt}/", store)


def broadcast_from_main(value: Any, info: DistInfo, wait_s: float) -> Any:
    """Rank 0's ``value`` (any picklable object) on every rank; ``value`` itself in a single process. Sent in a gloo
    group of its own whose timeout is ``wait_s`` seconds, not the job's ``parallel.timeout_s``, so the other ranks
    may wait while rank 0 works alone for minutes; a rank that dies ends the wait at once (its connections close).
    """
    box = [value]
    if info.world_size > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_s))
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        finally:
            dist.destroy_process_group(group)
    return box[0]


def max_over_ranks(value: int, info: DistInfo) -> int:
    """The largest of every rank's ``value`` (an all-reduce of one integer over the job's default group, on
    ``info.device``: NCCL needs a CUDA tensor); ``value`` itself in a single process. Every rank must call it at
    the same point of the job."""
    if info.world_size == 1 or not dist.is_initialized():
        return value
    box = torch.tensor([value], dtype=torch.int64, device=info.device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())
