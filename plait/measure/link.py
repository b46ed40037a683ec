"""The stage-to-stage link as the simulator's :class:`~plait.planner.pipeline.types.P2PModel`, measured in a job.

:func:`measure_link` (collective over the default process group): ranks 0 and 1 ping-pong messages packed as
the pipeline runtime's gloo transport packs them (:func:`~plait.parallel.pipeline.wire.pack_payload`: one buffer
of header and payload, its receive posted ahead, as :class:`~plait.parallel.pipeline.transport.Transport` posts
it), an empty one and one of ``nbytes``. From the medians it takes, as LogP does (Culler et al., "LogP: towards
a realistic model of parallel computation", PPoPP 1993, section 2), the host time each end spends per message
(overhead ``o``: packing and posting on the sender, waiting and unpacking on the receiver; main-thread CPU
seconds) and the wire time ``latency + bytes / bandwidth`` (one-way time less both overheads, fitted on the two
sizes). Rank 0's result is broadcast, so
every rank of the job gets the same model (a deterministic plan search on every rank then agrees).

The measurement uses the packed CPU transport, so it is what a gloo job on CPU sends. :func:`preset_link` is the
documented link of a NCCL job (the NVLink figures of the ``cost_model.DeviceSpec`` preset that matches the GPU's
name, no host overhead: NCCL sends are asynchronous kernel launches); a NCCL ping-pong is not used because it
could not be validated here (it needs two GPUs). :func:`job_link` picks between the two.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.pipeline.wire import pack_payload, unpack
from plait.planner.pipeline.types import P2PModel

__all__ = ["LinkSample", "MIN_LINK_BYTES", "describe_link", "job_link", "measure_link", "ping_pong", "preset_link"]

MIN_LINK_BYTES = 1 << 16
"""Smallest large message :func:`job_link` fits the bandwidth on (bytes): smaller boundaries give a noisy fit."""


@dataclass(frozen=True)
class LinkSample:
    """Seconds of one runtime-shaped message between two ranks.

    Attributes:
        one_way: wall time of half a ping-pong (s).
        send: this rank's host time to pack and post the message (s, main-thread CPU time).
        recv: this rank's host time to wait for and unpack it (s, main-thread CPU time).
    """

    one_way: float
    send: float
    recv: float


def ping_pong(peer: int, nbytes: int, rounds: int, group: Any = None) -> LinkSample:
    """Median :class:`LinkSample` over ``rounds`` ping-pongs with global rank ``peer`` (the lower rank pings
    first) of a message packed as the runtime's gloo transport packs it (``pack_payload``: header and a float32
    tensor of ``nbytes`` bytes, rounded down to whole floats, at least one), its receive posted ahead as the
    runtime posts it. Both ranks must call it with the same arguments.

    Args:
        peer: the other rank (global rank).
        nbytes: payload bytes.
        rounds: ping-pongs timed (>= 1).
        group: process group of just the two ranks, for the barriers (None: the default group, which must then
            be these two ranks).

    Raises:
        ValueError: on ``rounds`` < 1 or a negative ``nbytes``.
    """
    if rounds < 1 or nbytes < 0:
        raise ValueError(f"ping_pong needs rounds >= 1 and nbytes >= 0, got rounds={rounds}, nbytes={nbytes}")
    payload = {"llm": [torch.zeros(max(1, nbytes // 4))]}
    me = dist.get_rank()
    capacity = pack_payload(("llm",), payload, 0).numel()  # the receive holds it whole
    posted = (buf := torch.empty(capacity, dtype=torch.uint8)), dist.irecv(buf, peer)
    dist.barrier(group=group)
    samples = []
    for _ in range(rounds):
        start, send, recv = time.perf_counter(), 0.0, 0.0
        for ping in ((me < peer), (me > peer)):
            cpu = time.thread_time()
            if ping:
                dist.isend(pack_payload(("llm",), payload, capacity), peer).wait()
                send = time.thread_time() - cpu
            else:
                posted[1].wait()
                unpack(posted[0], ("llm",))
                posted = (buf := torch.empty(capacity, dtype=torch.uint8)), dist.irecv(buf, peer)
                recv = time.thread_time() - cpu
        samples.append(LinkSample((time.perf_counter() - start) / 2, send, recv))
    dist.barrier(group=group)
    dist.isend(torch.zeros(capacity, dtype=torch.uint8), peer).wait()  # completes the peer's last posted receive
    posted[1].wait()
    return LinkSample(*(statistics.median(getattr(m, f) for m in samples) for f in ("one_way", "send", "recv")))


def measure_link(nbytes: int) -> P2PModel:
    """The link between ranks 0 and 1 as a ``P2PModel`` (module docstring); collective: every rank of the
    default process group (world size >= 2) calls it with the same ``nbytes`` and gets rank 0's model.

    Per message: a send and a receive overhead (host time of the ``nbytes`` message, the two ranks' medians
    averaged) and a wire time ``latency + bytes / bandwidth`` (one-way time less the overheads) fitted on an
    empty (4-byte) and an ``nbytes`` message; ``bandwidth_Bps`` is None (unlimited) when the large message's
    wire time is not above the empty one's. 5 warm-up and 2 x 30 timed ping-pongs.

    Raises:
        ValueError: when the default process group is not initialised or has fewer than 2 ranks, or on a
            negative ``nbytes``.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        raise ValueError("measure_link needs an initialised process group of at least 2 ranks")
    if nbytes < 0:  # checked on every rank, before any rank waits for the others
        raise ValueError(f"measure_link needs nbytes >= 0, got {nbytes}")
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = None if world == 2 else dist.new_group([0, 1])  # every rank takes part in creating the group
    model = None
    if rank < 2:
        model = _fit_link(1 - rank, nbytes, pair)
    box = [model.to_dict() if model is not None else None]
    dist.broadcast_object_list(box, src=0)
    return P2PModel.from_dict(box[0])


def _fit_link(peer: int, nbytes: int, group: Any) -> P2PModel:
    """This rank's fit of the link to ``peer`` (``measure_link``); the overheads of both ranks are averaged."""
    ping_pong(peer, 4, 5, group)
    small, big = ping_pong(peer, 4, 30, group), ping_pong(peer, nbytes, 30, group)
    both: list[Any] = [None, None]
    dist.all_gather_object(both, (big.send, big.recv), group=group)
    send, recv = (sum(v[i] for v in both) / 2 for i in (0, 1))
    wire_small = max(0.0, small.one_way - small.send - small.recv)
    wire_big = max(0.0, big.one_way - send - recv)
    bandwidth = nbytes / (wire_big - wire_small) if wire_big > wire_small else None
    return P2PModel(wire_small, bandwidth, send_overhead_s=send, recv_overhead_s=recv)


def preset_link(device_name: str) -> tuple[P2PModel, str]:
    """The NVLink link of the ``DeviceSpec`` preset whose name matches ``device_name`` (``"H200"``, ``"H100"``,
    ``"A100"`` in it; others: the H100 preset), without host overheads; and the preset's name.

    Latency and bandwidth (one direction) are the preset's ``link_latency`` / ``link_bandwidth``: neighbours
    on one NVLink node. Pipeline neighbours on different nodes see far less (InfiniBand), so a multi-node plan
    built on this link underrates transfers.
    """
    from plait.planner.cost.types import DeviceSpec

    name = device_name.upper()
    preset = next((p for p in ("h200", "h100", "a100") if p.upper() in name), "h100")
    spec = getattr(DeviceSpec, preset)()
    return P2PModel(spec.link_latency, spec.link_bandwidth), spec.name


def job_link(device: torch.device, nbytes: int) -> tuple[P2PModel, str]:
    """The link a job's auto plan uses, and a one-line description; collective when the world size is > 1.

    One process: no link (``P2PModel()``, free). gloo (CPU): :func:`measure_link` on a message of
    ``max(nbytes, MIN_LINK_BYTES)`` bytes (the largest boundary a stage sends, per microbatch). NCCL (CUDA):
    :func:`preset_link` of the GPU's name.

    Raises:
        ValueError: as :func:`measure_link`.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return P2PModel(), "none (1 process)"
    if dist.get_backend() == "nccl":
        model, preset = preset_link(torch.cuda.get_device_name(device))
        return model, f"{describe_link(model)} ({preset} NVLink preset)"
    size = max(int(nbytes), MIN_LINK_BYTES)
    model = measure_link(size)
    return model, f"{describe_link(model)} (measured: gloo ping-pong of ranks 0 and 1, {size} B message)"


def describe_link(model: P2PModel) -> str:
    """``"45 us + 1.20 GB/s, overhead send 20 us / recv 15 us"`` (``unlimited`` without a bandwidth)."""
    bandwidth = "unlimited" if model.bandwidth_Bps is None else f"{model.bandwidth_Bps / 1e9:.2f} GB/s"
    return (f"{1e6 * model.latency_s:.0f} us + {bandwidth}, overhead send {1e6 * model.send_overhead_s:.0f} us / "
            f"recv {1e6 * model.recv_overhead_s:.0f} us")
