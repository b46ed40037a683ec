"""The options ``parallel.plan_parallel`` searches (TP, FSDP2 shard and EP degrees, checkpointing policy, FSDP2
resharding: ``ParallelDegrees``) and their tie order. Pure: no torch, no files."""

from __future__ import annotations

from collections.abc import Sequence

from plait.planner.cost.types import CHECKPOINT_POLICIES, FSDP_RESHARD, ParallelDegrees
from plait.planner.search.types import LayoutChoice

__all__ = ["degree_options", "degrees_of", "label", "preference"]


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(max(limit, 1).bit_length()) if (1 << k) <= limit]


def degree_options(devices: int, tp_degrees: Sequence[int] | None = None,
                   dp_shard_degrees: Sequence[int] | None = None,
                   checkpointing: Sequence[str] = CHECKPOINT_POLICIES,
                   fsdp_reshard: Sequence[str] = FSDP_RESHARD,
                   ep_degrees: Sequence[int] = (1,)) -> list[ParallelDegrees]:
    """Every ``ParallelDegrees`` to consider on ``devices``: TP degrees (default powers of two up to 8) dividing
    ``devices``, shard degrees (default powers of two) dividing ``devices / tp``, each checkpointing policy, and
    with a shard degree above 1 each of ``fsdp_reshard`` (``sharding.FSDP_RESHARD``); with ``tp = 1``, each EP
    degree of ``ep_degrees`` dividing ``devices`` that is a divisor or a multiple of the shard degree.

    Raises:
        ValueError: on a degree below 1, an unknown policy or an unknown ``fsdp_reshard``.
    """
    tps = sorted({int(t) for t in (tp_degrees if tp_degrees is not None else _powers_of_two(min(8, devices)))})
    out = []
    for tp in (t for t in tps if devices % max(t, 1) == 0):
        rest = devices // tp
        shards = dp_shard_degrees if dp_shard_degrees is not None else _powers_of_two(rest)
        for shard in sorted({int(s) for s in shards if rest % max(int(s), 1) == 0}):
            reshards = fsdp_reshard if shard > 1 else ("after_forward",)
            eps = sorted({int(e) for e in ep_degrees if e == 1 or (tp == 1 and rest % e == 0
                                                                   and (e % shard == 0 or shard % e == 0))})
            out += [ParallelDegrees(tp, shard, policy, r, e) for e in eps for policy in checkpointing
                    for r in reshards]
    return out


def preference(degrees: ParallelDegrees) -> tuple[int, int, int, int, int]:
    """Tie order: less TP, less sharding, less EP, less checkpointing, parameters resharded after the forward."""
    return (degrees.tp, degrees.dp_shard, degrees.ep, CHECKPOINT_POLICIES.index(degrees.checkpointing),
            FSDP_RESHARD.index(degrees.fsdp_reshard))


def degrees_of(choice: LayoutChoice) -> ParallelDegrees:
    return ParallelDegrees(choice.tp, choice.dp_shard, choice.checkpointing, choice.fsdp_reshard, choice.ep)


def label(degrees: ParallelDegrees) -> str:
    reshard = f", fsdp_reshard {degrees.fsdp_reshard}" if degrees.fsdp_reshard != "after_forward" else ""
    ep = f", ep {degrees.ep}" if degrees.ep > 1 else ""
    return f"tp {degrees.tp}, dp_shard {degrees.dp_shard}{ep}, checkpointing {degrees.checkpointing}{reshard}"
