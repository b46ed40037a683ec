"""Preset node topologies (``topology.Topology``) for ``Machine.topology``: the links inside a node and between nodes.

Pure data, like ``DeviceSpec``'s device presets: no torch, no processes.
"""

from __future__ import annotations

from plait.planner.cost.topology import Topology
from plait.planner.pipeline.types import P2PModel

__all__ = ["INFINIBAND_NDR_LINK", "NVLINK4_LINK", "nvlink_infiniband"]

NVLINK4_LINK = P2PModel(latency_s=3e-6, bandwidth_Bps=450e9)
"""Fourth-generation NVLink between two GPUs of an H100 / H200 SXM node: 450 GB/s per direction (NVIDIA's H100
Tensor Core GPU datasheet gives 900 GB/s of NVLink bandwidth per GPU, both directions together) and about 3 us per
message (a rough figure for a small NCCL message within a node; calibrate with ``plait.measure.link``)."""

INFINIBAND_NDR_LINK = P2PModel(latency_s=5e-6, bandwidth_Bps=50e9)
"""One 400 Gb/s InfiniBand NDR port per GPU between nodes (an NVIDIA ConnectX-7 adapter: 400 Gb/s = 50 GB/s per
direction; a DGX H100 has one such port per GPU on its compute fabric) and about 5 us per message (a rough figure for
a small message through a switch; calibrate with ``plait.measure.link``)."""


def nvlink_infiniband(gpus_per_node: int = 8) -> Topology:
    """Nodes of ``gpus_per_node`` NVLink-connected GPUs (:data:`NVLINK4_LINK`, 450 GB/s per direction) with one
    400 Gb/s InfiniBand port per GPU between nodes (:data:`INFINIBAND_NDR_LINK`, 50 GB/s per direction): an
    H100 / H200 SXM cluster of DGX / HGX nodes.

    Args:
        gpus_per_node: GPUs per node (8 on an HGX / DGX board).

    Raises:
        ValueError: on ``gpus_per_node`` below 1 (``Topology``).
    """
    return Topology(gpus_per_node, intra_link=NVLINK4_LINK, inter_link=INFINIBAND_NDR_LINK)
