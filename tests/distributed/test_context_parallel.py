"""Context-parallel attention on 2 and 4 gloo processes vs a single-process reference (fp32)."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

from plait.attention.masks import MaskInfo, block_work, dense_mask
from plait.parallel.context import all_gather_tokens, build_cp_shard, cp_attention, shard_tokens, unshard_tokens
from plait.planner.token_distributor import TokenAssignment, WorkWeights, plan_tokens
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait

N = 53
TOL = dict(rtol=1e-5, atol=1e-5)


def _info(mode: str, docs: list[tuple[int, int]], items: list[tuple[int, int]]) -> MaskInfo:
    """Two rows: row 0 with ``docs``/``items`` spans, row 1 one document with padding; rest is padding."""
    doc = torch.full((2, N), -1)
    item = torch.full((2, N), -1)
    for d, (s, e) in enumerate(docs):
        doc[0, s:e] = d
    for i, (s, e) in enumerate(items):
        item[0, s:e] = i
    doc[1, :47] = 0
    item[1, 10:25] = 0
    pos = torch.zeros_like(doc)
    return MaskInfo(doc, item, pos, mode)


def _cases() -> dict[str, MaskInfo]:
    return {
        "causal": _info("causal", [(0, 50)], [(8, 22)]),
        "bidirectional_items": _info("bidirectional_items", [(0, 30), (30, 50)], [(8, 22), (33, 41)]),
        "packed": _info("bidirectional_items", [(0, 9), (9, 20), (20, 37), (37, 51)], [(2, 7), (12, 19), (25, 35)]),
    }


def _assignments(world: int, info: MaskInfo) -> list[TokenAssignment]:
    """An explicit uneven, non-contiguous split (item [8, 22) crosses ranks) and an LPT plan."""
    if world == 2:
        ranges = (((0, 5), (20, 40)), ((5, 20), (40, N)))
    else:
        ranges = (((0, 3), (30, 33)), ((3, 12), (44, N)), ((12, 21),), ((21, 30), (33, 44)))
    explicit = TokenAssignment(N, 1, "manual", ranges, (0.0,) * world)
    planned = plan_tokens(block_work(info, 4), N, world, method="lpt", block_size=4, weights=WorkWeights(beta=2.0))
    return [explicit, planned]


def _reference(q, k, v, info, grad_out):
    """Full attention written out (repeat K/V for GQA, softmax of masked scores) and its gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~dense_mask(info)[:, None], float("-inf")).softmax(-1)
    out = probs @ v.repeat_interleave(rep, 1)
    (out * grad_out).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _check_attention(rank: int, info: MaskInfo, assignment: TokenAssignment, case: str, flex: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v, g = (torch.randn(2, h, N, 8, generator=gen) for h in (4, 2, 2, 4))
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, info, g)
    shard = build_cp_shard(assignment, rank)
    local = [shard_tokens(t, shard, dim=2).requires_grad_() for t in (q, k, v)]
    out = cp_attention(*local, info, shard, backend="sdpa")
    (out * shard_tokens(g, shard, dim=2)).sum().backward()
    where = f"{case}, rank {rank}, counts {shard.counts}"
    torch.testing.assert_close(out, shard_tokens(ref_out, shard, 2), **TOL, msg=f"out {where}")
    for name, t, ref in zip("qkv", local, (ref_dq, ref_dk, ref_dv)):
        torch.testing.assert_close(t.grad, shard_tokens(ref, shard, 2), **TOL, msg=f"d{name} {where}")
    if not flex:  # flex on CPU is forward-only and costs seconds of tracing per process: checked on 2 ranks
        return
    with torch.no_grad():
        flex = cp_attention(*(t.detach() for t in local), info, shard, backend="flex")
    torch.testing.assert_close(flex, shard_tokens(ref_out, shard, 2), **TOL, msg=f"flex {where}")


def _check_gather_gradient(rank: int, world: int, assignment: TokenAssignment) -> None:
    shard = build_cp_shard(assignment, rank)
    full = torch.arange(3 * N, dtype=torch.float32).view(1, N, 3)
    x = shard_tokens(full, shard).requires_grad_()
    gathered = all_gather_tokens(x, shard, dim=1)
    assert torch.equal(gathered, full)
    weight = torch.linspace(-1, 1, 3 * N).view(1, N, 3)
    (gathered * weight * (rank + 1)).sum().backward()
    expected = shard_tokens(weight, shard) * sum(r + 1 for r in range(world))  # sum over ranks
    torch.testing.assert_close(x.grad, expected, **TOL)


def _worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port, timeout_s=60):
        for case, info in _cases().items():
            for i, assignment in enumerate(_assignments(world, info)):
                _check_attention(rank, info, assignment, case, flex=world == 2 and i == 0)
        _check_gather_gradient(rank, world, _assignments(world, _cases()["packed"])[0])
        dist.barrier()  # every rank's last messages delivered before any rank tears gloo down (SIGABRT seen once)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_single_process(world):
    spawn_and_wait(_worker, (world, free_port()), world, 90, f"CP test with {world} processes")


def test_assignments_have_uneven_counts_and_split_an_item():
    info = _cases()["bidirectional_items"]
    for world in (2, 4):
        explicit = _assignments(world, info)[0]
        assert len(set(explicit.tokens_per_rank)) > 1
        owners = {r for r in range(world) for t in explicit.token_indices(r) if 8 <= t < 22}
        assert len(owners) > 1


def test_shard_unshard_round_trip():
    assignment = _assignments(4, _cases()["packed"])[1]
    x = torch.randn(2, N, 5)
    pieces = [shard_tokens(x, build_cp_shard(assignment, r)) for r in range(4)]
    assert [p.shape[1] for p in pieces] == list(assignment.tokens_per_rank)
    assert torch.equal(unshard_tokens(pieces, assignment), x)
    assert np.array_equal(pieces[1][0, :, 0].numpy(), x[0, assignment.token_indices(1), 0].numpy())
    with pytest.raises(ValueError, match="tokens"):
        shard_tokens(x[:, :10], build_cp_shard(assignment, 0))
