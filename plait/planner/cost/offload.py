"""FSDP2 CPU offload (``parallel.offload = "cpu"``) as a plan: what stays on the device, what the host holds, what
it costs in time.

Under ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` (``plait.parallel.fsdp``; ZeRO-Offload's split, Ren et
al., "ZeRO-Offload", USENIX ATC 2021) the shards of the trainable units' parameters, their gradients and so the AdamW
state and step live in host memory. Only the plan without pipeline stages is modelled (every device a DP rank: the
runtime refuses offload with ``pp`` > 1), per device (one TP rank), with the per-rank costs of
``sharding.shard_costs`` (TP, checkpointing, FSDP2 applied):

- **device memory**: the frozen units whole (outside FSDP2), FSDP2's working set of the groups in flight
  (``sharding.shard_buffer_bytes``: the running and the prefetched unit's unsharded parameters and one unit's
  unsharded gradient) and one microbatch's saved activations;
- **host memory per device**: the trainable units' shards with their gradients and optimizer state
  (``cost_model.unit_static_bytes`` of the sharded costs), against ``HostSpec.memory_bytes``;
- **time added to the step**, per microbatch of the busiest rank: the fp32 master shard of the trainable units
  copied host-to-device before each all-gather (forward and backward: twice) and its fp32 gradient shard back
  (device-to-host), the gradient reduce-scatter after every microbatch instead of once per step (the runtime keeps
  the gradients sharded on the host); per step, AdamW on the host over the shard (``HostSpec.adamw_params_per_s``)
  instead of the device's step. Copies are charged in full, not overlapped (an upper bound: FSDP2 issues the copy
  in its all-gather stream, which prefetch can overlap).

The defaults of :class:`HostSpec` are documented figures of an 8-GPU H100 node (uncertain, pass your own).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plait.planner.cost.analytic import (OptimizerSpec, dtype_bytes, trained_params, unit_activation_bytes,
                                     unit_static_bytes)
from plait.planner.serialize import JsonDataclass
from plait.planner.cost.sharding import ParallelDegrees, shard_buffer_bytes, shard_costs
from plait.planner.types import Unit, UnitCost

__all__ = ["HostSpec", "OffloadCost", "offload_cost"]

_GIB = 2**30
_MASTER_BYTES = 4.0
"""Bytes per element of the host shard and of the reduced gradient (fp32 master weights, fp32 reduction)."""


@dataclass(frozen=True)
class HostSpec(JsonDataclass):
    """The host side of one device, for CPU offload.

    Attributes:
        memory_bytes: host memory per device (bytes); default 256 GiB: 2 TiB per 8-GPU node (a DGX H100 holds 2 TiB).
        h2d_Bps, d2h_Bps: host-to-device and device-to-host copy bandwidth per device (bytes/s, pinned memory);
            default 25e9: about half of PCIe Gen5 x16's 64 GB/s, as measured copies reach with 8 GPUs sharing the
            host's root complexes (uncertain).
        adamw_params_per_s: parameters the host's AdamW updates per second per device (the node's cores shared by
            its devices); default 2.5e8: a vectorized CPU AdamW does about 2e9 parameters/s on a 2-socket node
            (ZeRO-Offload's CPU-Adam, Ren et al. 2021, section 4.1), shared by 8 devices (uncertain).

    Raises:
        ValueError: on a field that is not a finite number > 0.
    """

    memory_bytes: float = 256 * _GIB
    h2d_Bps: float = 25e9
    d2h_Bps: float = 25e9
    adamw_params_per_s: float = 2.5e8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"HostSpec.{f.name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class OffloadCost(JsonDataclass):
    """One device's memory and added time under CPU offload (module docstring).

    Attributes:
        device_static_bytes: frozen units' parameters kept whole on the device.
        activation_bytes: one microbatch's saved activations.
        buffer_bytes: FSDP2's unsharded working set (``sharding.shard_buffer_bytes``).
        host_bytes: the trainable shards with their gradients and optimizer state, in host memory.
        copy_s_per_microbatch: host-to-device copies (forward and backward) and the device-to-host gradient copy
            of one microbatch (seconds).
        adamw_s: the host's AdamW step over the shard (seconds, once per step).
        trainable_shard_params: trainable parameters in this device's shard.
    """

    device_static_bytes: float
    activation_bytes: float
    buffer_bytes: float
    host_bytes: float
    copy_s_per_microbatch: float
    adamw_s: float
    trainable_shard_params: float

    @property
    def device_bytes(self) -> float:
        """Peak device memory: static + activations + buffer (bytes)."""
        return self.device_static_bytes + self.activation_bytes + self.buffer_bytes

    def step_s(self, microbatches: int, grad_sync_s: float) -> float:
        """Seconds offload adds to a step of ``microbatches`` microbatches on this device whose gradient
        reduce-scatter takes ``grad_sync_s`` once: the copies of every microbatch, ``microbatches - 1`` more
        reduce-scatters and the host's AdamW."""
        return microbatches * self.copy_s_per_microbatch + max(0, microbatches - 1) * grad_sync_s + self.adamw_s


def offload_cost(units: Sequence[Unit], costs: Sequence[UnitCost], degrees: ParallelDegrees,
                 host: HostSpec = HostSpec(), *, dtype: Any = "bfloat16", optimizer: OptimizerSpec = OptimizerSpec(),
                 checkpoint_overrides: dict[str, str] | None = None) -> OffloadCost:
    """Per-device memory and copy/optimizer time of the plan without pipeline stages under CPU offload.

    Args:
        units: pipeline units with consistent flags (``graph.consistent_units``); costs: their whole-unit costs
            on one device (before TP, checkpointing and sharding).
        degrees: TP, shard degree (> 1: offload needs FSDP2) and checkpointing.
        host: the host side of a device.
        dtype, optimizer: as ``cost_model.unit_static_bytes``.
        checkpoint_overrides: per-module checkpointing (``sharding.shard_costs``).

    Raises:
        ValueError: when ``degrees.dp_shard`` is 1 or the lengths differ.
    """
    if degrees.dp_shard < 2:
        raise ValueError(f"CPU offload offloads FSDP2's shards: it needs dp_shard > 1, got {degrees.dp_shard}")
    per_rank = shard_costs(units, costs, degrees, checkpoint_overrides=checkpoint_overrides)
    trained = [(u, c) for u, c in zip(units, per_rank) if u.trainable]
    shard_elements = sum(c.param_bytes for _, c in trained) / dtype_bytes(dtype)
    grad_elements = sum(trained_params(u, c, dtype) for u, c in trained)
    copies = 2 * shard_elements * _MASTER_BYTES / host.h2d_Bps + grad_elements * _MASTER_BYTES / host.d2h_Bps
    return OffloadCost(
        device_static_bytes=float(sum(c.param_bytes for u, c in zip(units, per_rank) if not u.trainable)),
        activation_bytes=float(sum(unit_activation_bytes(u, c) for u, c in zip(units, per_rank))),
        buffer_bytes=shard_buffer_bytes(units, costs, degrees, dtype, optimizer),
        host_bytes=float(sum(unit_static_bytes(u, c, dtype, optimizer) for u, c in trained)),
        copy_s_per_microbatch=copies, adamw_s=grad_elements / host.adamw_params_per_s,
        trainable_shard_params=grad_elements)
