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

from collections.abc import Sequence
from typing import Any

from plait.planner.cost.analytic import trained_params, unit_activation_bytes, unit_static_bytes
from plait.planner.cost.types import HostSpec, OffloadCost, OptimizerSpec, ParallelDegrees, dtype_bytes
from plait.planner.cost.sharding import shard_buffer_bytes, shard_costs
from plait.planner.types import Unit, UnitCost

__all__ = ["offload_cost"]

_MASTER_BYTES = 4.0
"""Bytes per element of the host shard and of the reduced gradient (fp32 master weights, fp32 reduction)."""


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
