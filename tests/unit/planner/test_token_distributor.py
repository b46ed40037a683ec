"""Token distribution over CP ranks: hand-worked cases, brute-force optima, invariants."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.token_distributor import IlpLimits, TokenAssignment, WorkWeights, plan_tokens


def _owners(a: TokenAssignment) -> list[int]:
    """Rank of each block, read back from the ranges."""
    owner = [-1] * -(-a.num_tokens // a.block_size)
    for rank, spans in enumerate(a.ranges):
        for start, end in spans:
            for block in range(start // a.block_size, -(-end // a.block_size)):
                owner[block] = rank
    return owner


def _brute_opt(work, tokens, cp, cap=None) -> float:
    best = float("inf")
    for assign in itertools.product(range(cp), repeat=len(work)):
        if len(set(assign)) < cp:
            continue
        held = np.bincount(assign, weights=tokens, minlength=cp)
        if cap is not None and held.max() > cap:
            continue
        best = min(best, np.bincount(assign, weights=work, minlength=cp).max())
    return best


def test_uniform_and_zigzag_hand_worked():
    uni = plan_tokens(np.ones(5), num_tokens=10, cp=2, method="uniform", block_size=2)
    assert uni.ranges == (((0, 6),), ((6, 10),))
    assert uni.tokens_per_rank == (6, 4)
    zig = plan_tokens(np.ones(8), num_tokens=16, cp=2, method="zigzag", block_size=2)
    assert zig.ranges == (((0, 4), (12, 16)), ((4, 12),))
    assert zig.token_indices(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_zigzag_balances_one_causal_document():
    n, bs = 64, 4
    pairs = np.arange(1, n + 1)  # token t of one causal document attends t + 1 keys
    blocks = pairs.reshape(-1, bs).sum(1)
    zig = plan_tokens(blocks, n, cp=4, method="zigzag", block_size=bs)
    per_rank = [pairs[zig.token_indices(r)].sum() for r in range(4)]
    assert len(set(per_rank)) == 1 and list(zig.work) == per_rank
    uni = plan_tokens(blocks, n, cp=4, method="uniform", block_size=bs)
    assert uni.imbalance > 1.5 and zig.imbalance == pytest.approx(1.0)


def test_lpt_hand_worked():
    a = plan_tokens([7, 5, 4, 3, 3, 2], num_tokens=6, cp=2, method="lpt", block_size=1)
    # 7->r0, 5->r1, 4->r1 (5 < 7), 3->r0 (7 < 9), 3->r1 (9 < 10), 2->r0 (10 < 12)
    assert _owners(a) == [0, 1, 1, 0, 1, 0]
    assert a.work == (12.0, 12.0) and a.imbalance == 1.0


def test_work_includes_linear_term_and_partial_last_block():
    attn = np.array([10.0, 20.0, 30.0])
    a = plan_tokens(attn, num_tokens=21, cp=2, method="uniform", block_size=8, weights=WorkWeights(alpha=2.0, beta=0.5))
    assert a.ranges == (((0, 16),), ((16, 21),))
    assert a.work == (2 * 30 + 0.5 * 16, 2 * 30 + 0.5 * 5)


@settings(max_examples=30, deadline=None)
@given(work=st.lists(st.integers(1, 50), min_size=3, max_size=7), cp=st.integers(2, 3))
def test_lpt_within_graham_bound_and_ilp_optimal(work, cp):
    if len(work) < cp:
        return
    tokens = np.ones(len(work))
    opt = _brute_opt(work, tokens, cp)
    lpt = plan_tokens(work, len(work), cp, method="lpt", block_size=1)
    assert opt <= lpt.max_work <= (4 / 3 - 1 / (3 * cp)) * opt + 1e-9
    ilp = plan_tokens(work, len(work), cp, method="ilp", block_size=1, ilp=IlpLimits(time_s=5.0))
    assert ilp.max_work == pytest.approx(opt)


@settings(max_examples=20, deadline=None)
@given(work=st.lists(st.integers(1, 100), min_size=4, max_size=7), cp=st.integers(2, 3), data=st.data())
def test_cap_respected_and_ilp_optimal_under_cap(work, cp, data):
    if len(work) < cp:
        return
    per_rank = -(-len(work) // cp)
    cap = data.draw(st.integers(per_rank, len(work)))
    for method in ("lpt", "ilp"):
        a = plan_tokens(work, len(work), cp, method=method, block_size=1, max_tokens_per_rank=cap,
                        ilp=IlpLimits(time_s=5.0))
        assert max(a.tokens_per_rank) <= cap and min(a.tokens_per_rank) >= 1
    assert a.max_work == pytest.approx(_brute_opt(work, np.ones(len(work)), cp, cap))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(8, 300), bs=st.integers(1, 16), cp=st.integers(1, 5),
       method=st.sampled_from(["uniform", "zigzag", "lpt"]), seed=st.integers(0, 99))
def test_partition_work_and_determinism(n, bs, cp, method, seed):
    nb = -(-n // bs)
    if nb < cp:
        return
    per_token = np.random.default_rng(seed).integers(1, 20, n)
    blocks = np.add.reduceat(per_token, np.arange(0, n, bs))
    a = plan_tokens(blocks, n, cp, method=method, block_size=bs, weights=WorkWeights(alpha=1.5, beta=3.0))
    everything = np.sort(np.concatenate([a.token_indices(r) for r in range(cp)]))
    assert np.array_equal(everything, np.arange(n))
    for r in range(cp):
        idx = a.token_indices(r)
        assert np.all(np.diff(idx) > 0) and idx.size >= 1
        assert a.work[r] == pytest.approx(1.5 * per_token[idx].sum() + 3.0 * idx.size)
    assert plan_tokens(blocks, n, cp, method=method, block_size=bs, weights=WorkWeights(alpha=1.5, beta=3.0)) == a


def test_json_round_trip_and_ilp_fallback():
    work = np.arange(1, 41, dtype=float)
    a = plan_tokens(work, 40 * 16 - 3, cp=4, method="ilp", block_size=16, ilp=IlpLimits(max_vars=100))
    assert a.method == "lpt" and "160 binaries > ilp_max_vars=100" in a.note
    back = TokenAssignment.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back == a


def test_invalid_inputs():
    with pytest.raises(ValueError, match="method"):
        plan_tokens([1, 2], 4, 2, method="greedy", block_size=2)
    with pytest.raises(ValueError, match="shape"):
        plan_tokens([1, 2, 3], 4, 2, block_size=2)
    with pytest.raises(ValueError, match=">= 0"):
        plan_tokens([1, -2], 4, 2, block_size=2)
    with pytest.raises(ValueError, match="every rank needs a block"):
        plan_tokens([1, 2], 4, 3, block_size=2)
    with pytest.raises(ValueError, match="not both 0"):
        plan_tokens([1, 2], 4, 2, block_size=2, weights=WorkWeights(alpha=0.0, beta=0.0))
    with pytest.raises(ValueError, match="need >= 4"):
        plan_tokens([1, 2, 3], 6, 2, block_size=2, max_tokens_per_rank=3)
    with pytest.raises(ValueError, match="do not partition"):
        TokenAssignment(4, 2, "lpt", (((0, 2),), ((3, 4),)), (1.0, 1.0))
    with pytest.raises(ValueError, match="rank 2"):
        plan_tokens([1, 2], 4, 2, block_size=2).token_indices(2)
