"""Context parallelism (CP) for attention with multimodal masks: all-gather K/V, local queries.

Each rank of a CP group holds any subset of a microbatch's LLM tokens, given by a
:class:`~plait.planner.token_distributor.TokenAssignment` (not necessarily contiguous or equal-sized).
Attention runs as in Llama 3 / Cornstarch: each rank all-gathers K and V
of every token (variable-size shards, padded to the largest), puts them in global token order, and attends
its local queries against them, masking with the global token index of each query
(:func:`plait.attention.masks.build_mask_mod` with ``q_global``). The backward of the all-gather is a
reduce-scatter: each rank receives, for its own K/V shard, the sum over ranks of the gradients.

Rows of a batch share one assignment (same token indices in every row); plan it on the row-summed block
work, or use one packed row per microbatch. A :class:`CPShard` passed to the model as ``plait_cp=shard`` is
called by plait's HF attention function (``plait.attention.interface.ContextParallelShard``: the shard brings
its attention, :meth:`CPShard.attention` = :func:`cp_attention`, so the attention layer never imports this one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from plait.attention.interface import plait_attention
from plait.attention.masks import MaskInfo
from plait.planner.token_distributor import TokenAssignment

__all__ = ["CPShard", "all_gather_tokens", "build_cp_shard", "cp_attention", "shard_tokens", "unshard_tokens"]


@dataclass(frozen=True, eq=False)
class CPShard:
    """This rank's share of the tokens of one microbatch, and how to rebuild global order.

    Attributes:
        rank: index of this rank in the CP group.
        counts: tokens held by each rank of the group.
        local_index: int64 ``[n_local]``, sorted global token indices held here.
        gather_index: int64 ``[N]``; global token ``t`` sits at ``gather_index[t]`` in the concatenation of
            the ranks' shards, each padded to ``max(counts)`` tokens.
        group: the CP process group (None: the default group).
    """

    rank: int
    counts: tuple[int, ...]
    local_index: torch.Tensor
    gather_index: torch.Tensor
    group: Any = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def cp(self) -> int:
        """CP degree."""
        return len(self.counts)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo, *,
                  scale: float | None = None, backend: str = "flex", dropout: float = 0.0,
                  window: int | None = None) -> torch.Tensor:
        """:func:`cp_attention` with this shard (``plait.attention.interface.ContextParallelShard``)."""
        return cp_attention(query, key, value, info, self, scale=scale, backend=backend, dropout=dropout,
                            window=window)

    @property
    def max_count(self) -> int:
        """Largest shard (tokens); every shard is padded to it for the all-gather."""
        return max(self.counts)

    @property
    def num_tokens(self) -> int:
        """Tokens per row (N)."""
        return int(self.gather_index.shape[0])

    def q_global(self, batch: int, device: torch.device | str) -> torch.Tensor:
        """``local_index`` expanded to int64 ``[batch, n_local]``; one cached tensor per (batch, device), so
        block masks cached on a :class:`MaskInfo` are reused by every layer."""
        key = (batch, str(device))
        if key not in self._cache:
            self._cache[key] = self.local_index.to(device).expand(batch, -1)
        return self._cache[key]


def build_cp_shard(assignment: TokenAssignment, rank: int, group: Any = None,
                   device: torch.device | str = "cpu") -> CPShard:
    """The :class:`CPShard` of ``rank`` under ``assignment`` (no communication: every rank knows the plan).

    Raises:
        ValueError: on a rank outside ``[0, assignment.cp)`` or a group whose size is not ``assignment.cp``.
    """
    if not 0 <= rank < assignment.cp:
        raise ValueError(f"build_cp_shard: rank {rank} outside [0, {assignment.cp})")
    if group is not None and dist.get_world_size(group) != assignment.cp:
        raise ValueError(f"build_cp_shard: group has {dist.get_world_size(group)} ranks, "
                         f"assignment has cp={assignment.cp}")
    counts = assignment.tokens_per_rank
    padded = max(counts)
    gather_index = torch.empty(assignment.num_tokens, dtype=torch.long)
    for r in range(assignment.cp):
        idx = torch.from_numpy(assignment.token_indices(r))
        gather_index[idx] = torch.arange(idx.numel()) + r * padded
    local = torch.from_numpy(assignment.token_indices(rank))
    return CPShard(rank, counts, local.to(device), gather_index.to(device), group)


def shard_tokens(x: torch.Tensor, shard: CPShard, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (``N`` tokens along ``dim``) -> ``n_local`` along ``dim``.

    Raises:
        ValueError: when ``x`` does not have ``N`` tokens along ``dim``.
    """
    if x.shape[dim] != shard.num_tokens:
        raise ValueError(f"shard_tokens: x has {x.shape[dim]} tokens along dim {dim}, plan has {shard.num_tokens}")
    return x.index_select(dim, shard.local_index.to(x.device))


def unshard_tokens(pieces: Sequence[torch.Tensor], assignment: TokenAssignment, dim: int = 1) -> torch.Tensor:
    """Reassemble the per-rank pieces (``pieces[r]`` holds rank ``r``'s tokens along ``dim``) in global order.

    Raises:
        ValueError: when the number of pieces or a piece's token count does not match ``assignment``.
    """
    if len(pieces) != assignment.cp:
        raise ValueError(f"unshard_tokens: {len(pieces)} pieces for cp={assignment.cp}")
    for r, (piece, count) in enumerate(zip(pieces, assignment.tokens_per_rank)):
        if piece.shape[dim] != count:
            raise ValueError(f"unshard_tokens: piece {r} has {piece.shape[dim]} tokens along dim {dim}, "
                             f"rank {r} holds {count}")
    order = torch.from_numpy(_concat_indices(assignment)).to(pieces[0].device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(list(pieces), dim=dim).index_select(dim, inverse)


def _concat_indices(assignment: TokenAssignment) -> np.ndarray:
    return np.concatenate([assignment.token_indices(r) for r in range(assignment.cp)])


class _GatherTokens(torch.autograd.Function):
    """All-gather of variable-size token shards into global order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: CPShard, dim: int) -> torch.Tensor:
        ctx.shard, ctx.dim = shard, dim
        local = x.movedim(dim, 0)
        pad = shard.max_count - local.shape[0]
        if pad:
            local = torch.cat([local, local.new_zeros(pad, *local.shape[1:])])
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(shard.cp)]
        dist.all_gather(parts, local, group=shard.group)
        full = torch.cat(parts).index_select(0, shard.gather_index.to(x.device))
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard, dim = ctx.shard, ctx.dim
        grad = grad.movedim(dim, 0)
        buffer = grad.new_zeros(shard.cp * shard.max_count, *grad.shape[1:])
        buffer.index_copy_(0, shard.gather_index.to(grad.device), grad)
        mine = torch.empty_like(buffer[: shard.max_count])
        dist.reduce_scatter(mine, list(buffer.chunk(shard.cp)), group=shard.group)
        return mine[: shard.counts[shard.rank]].movedim(0, dim), None, None


def all_gather_tokens(x: torch.Tensor, shard: CPShard, dim: int = 1) -> torch.Tensor:
    """Differentiable all-gather of token shards: ``n_local`` tokens along ``dim`` -> all ``N``, global order.

    Forward: all-gather of the shards (padded to the largest). Backward: reduce-scatter, so this rank gets
    the sum over ranks of the gradient of its own tokens. Collective: every rank of ``shard.group`` must
    call it (and its backward) in the same order.

    Raises:
        ValueError: when ``x`` does not hold this rank's ``n_local`` tokens along ``dim``.
    """
    if x.shape[dim] != shard.counts[shard.rank]:
        raise ValueError(f"all_gather_tokens: x has {x.shape[dim]} tokens along dim {dim}, "
                         f"rank {shard.rank} holds {shard.counts[shard.rank]}")
    return _GatherTokens.apply(x, shard, dim)


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, info: MaskInfo,
                 shard: CPShard, scale: float | None = None, backend: str = "flex",
                 dropout: float = 0.0, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries against the K/V of all ranks (one collective for K and V).

    Args:
        query: ``[B, H, n_local, D]``; key, value: ``[B, Hkv, n_local, D]`` / ``[..., Dv]``, this rank's
            tokens (``shard.local_index``) in order.
        info: mask metadata of the whole rows ``[B, N]`` (identical on every rank).
        shard: this rank's :class:`CPShard`.
        scale, backend, dropout, window: as :func:`plait.attention.interface.plait_attention`.

    Returns:
        ``[B, H, n_local, Dv]``, equal to the rows of full attention at this rank's tokens.

    Raises:
        ValueError: on shapes that do not match the shard or the mask.
    """
    b = query.shape[0]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[2] != shard.counts[shard.rank]:
            raise ValueError(f"cp_attention: {name} {tuple(t.shape)} must be [B, heads, "
                             f"{shard.counts[shard.rank]}, D] on rank {shard.rank}")
    head_dim = key.shape[-1]
    kv = all_gather_tokens(torch.cat([key, value], dim=-1), shard, dim=2)
    key_all, value_all = kv[..., :head_dim], kv[..., head_dim:]
    return plait_attention(query, key_all, value_all, info, q_global=shard.q_global(b, query.device),
                           scale=scale, backend=backend, dropout=dropout, window=window)
