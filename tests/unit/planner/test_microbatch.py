"""Tests of plait.planner.microbatch: coverage of every sample, determinism, limits, hand-worked cases,
Graham's LPT bound against brute force, and the CV reduction of the hierarchical (Entrain-style) method
on a synthetic multimodal mixture. Loads and CVs are recomputed here from the plan's fields, not read
from the planner's own statistics (except where ``workload_stats`` itself is under test)."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.microbatch import (
    METHODS,
    MicrobatchPlan,
    MicrobatchPolicy,
    ModuleCostCoeffs,
    SampleCost,
    WorkloadStats,
    module_order,
    plan_microbatches,
    sample_costs_from_metadata,
    workload_stats,
)

PROPERTY = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------ helpers


def pairs_of(plan: MicrobatchPlan) -> dict[int, tuple[int, int, int]]:
    """{index: (rank, encoder_mb, llm_mb)} read straight from the plan's two nested fields."""
    out = {}
    for r in range(plan.dp):
        for i in range(plan.num_microbatches):
            mb, llm = plan.microbatches[r][i], plan.llm_microbatch[r][i]
            assert len(mb) == len(llm)
            for index, j in zip(mb, llm):
                assert index not in out, f"sample {index} listed twice"
                out[index] = (r, i, j)
    return out


def loads(plan: MicrobatchPlan, costs) -> list[list[float]]:
    """loads[module][r * M + i]: work of each module in each microbatch (LLM at its LLM microbatch)."""
    by_index = {c.index: c for c in costs}
    k = len(costs[0].work)
    m = plan.num_microbatches
    out = [[0.0] * (plan.dp * m) for _ in range(k)]
    for index, (r, i, j) in pairs_of(plan).items():
        for module, w in enumerate(by_index[index].work):
            out[module][r * m + (j if module == k - 1 else i)] += w
    return out


def cv(values) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else 0.0


def buffered_counts(plan: MicrobatchPlan, rank: int) -> list[int]:
    m = plan.num_microbatches
    return [sum(1 for r, i, j in pairs_of(plan).values() if r == rank and i <= k < j) for k in range(m - 1)]


def make_costs(works, tokens=None) -> list[SampleCost]:
    tokens = tokens or [1] * len(works)
    return [SampleCost(index=x, work=tuple(w), tokens=t) for x, (w, t) in enumerate(zip(works, tokens))]


@st.composite
def cost_lists(draw, max_size=36):
    k = draw(st.integers(1, 3))
    n = draw(st.integers(0, max_size))
    work = st.one_of(st.just(0.0), st.floats(0.0, 100.0), st.sampled_from([1.0, 5.0]))
    offset = draw(st.integers(0, 50))
    order = draw(st.permutations(list(range(n))))
    costs = []
    for x in order:
        w = tuple(draw(work) for _ in range(k))
        costs.append(SampleCost(index=offset + x, work=w, tokens=draw(st.integers(0, 500))))
    return costs


@st.composite
def policies(draw, methods=METHODS):
    return MicrobatchPolicy(
        method=draw(st.sampled_from(methods)),
        dp=draw(st.integers(1, 4)),
        num_microbatches=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 3)),
        equal_counts_per_rank=draw(st.booleans()),
        allow_deferral=draw(st.booleans()),
        max_deferred=draw(st.integers(0, 3)),
        refine_rounds=draw(st.sampled_from([0, 1, 8])),
    )


# ------------------------------------------------------------ properties


@PROPERTY
@given(costs=cost_lists(), policy=policies(), step=st.integers(0, 5))
def test_every_sample_exactly_once_and_pairs_valid(costs, policy, step):
    plan = plan_microbatches(costs, policy, step)
    placed = pairs_of(plan)
    assert sorted(placed) == sorted(c.index for c in costs)
    assert len(plan.microbatches) == policy.dp
    assert all(len(rank) == policy.num_microbatches for rank in plan.microbatches)
    for r, i, j in placed.values():
        assert 0 <= r < policy.dp and 0 <= i <= j < policy.num_microbatches
    if policy.method != "hierarchical":
        assert all(i == j for _, i, j in placed.values())


@PROPERTY
@given(costs=cost_lists(), policy=policies(methods=("hierarchical",)), step=st.integers(0, 5))
def test_deferral_respects_order_and_buffer_bound(costs, policy, step):
    plan = plan_microbatches(costs, policy, step)
    placed = pairs_of(plan)
    limit = policy.max_deferred if policy.allow_deferral else 0
    for r in range(policy.dp):
        assert all(b <= limit for b in buffered_counts(plan, r))
    for c in costs:
        r, i, j = placed[c.index]
        assert i <= j
        if c.encoder_work == 0:  # no encoder output to buffer: nothing is deferred
            assert i == j


@PROPERTY
@given(costs=cost_lists(), policy=policies(), step=st.integers(0, 5))
def test_equal_counts_per_rank(costs, policy, step):
    plan = plan_microbatches(costs, policy, step)
    counts = [sum(len(mb) for mb in rank) for rank in plan.microbatches]
    floor = len(costs) // policy.dp
    if policy.equal_counts_per_rank or policy.method in ("arrival", "random"):
        assert all(c in (floor, floor + 1) for c in counts)
        assert counts.count(floor + 1) == len(costs) % policy.dp


@PROPERTY
@given(costs=cost_lists(), policy=policies(), step=st.integers(0, 5))
def test_deterministic_for_seed_and_step(costs, policy, step):
    first = plan_microbatches(costs, policy, step)
    again = plan_microbatches(list(costs), MicrobatchPolicy.from_dict(policy.to_dict()), step)
    assert first == again
    assert json.dumps(first.to_dict()) == json.dumps(again.to_dict())


@PROPERTY
@given(costs=cost_lists(), policy=policies(methods=("lpt", "hierarchical")), slack=st.integers(0, 300))
def test_token_cap_respected(costs, policy, slack):
    if not costs:
        return
    tokens = [c.tokens for c in costs]
    # Whatever rank a sample lands on, some microbatch then holds at most total/M tokens, so a cap of
    # total/M + the largest sample always leaves a microbatch with room: the greedy cannot fail.
    cap = max(1, math.ceil(sum(tokens) / policy.num_microbatches) + max(tokens) + slack)
    policy = MicrobatchPolicy(**{**policy.to_dict(), "max_tokens_per_microbatch": cap})
    plan = plan_microbatches(costs, policy, 0)
    tok = {c.index: c.tokens for c in costs}
    for r in range(plan.dp):
        for mb in plan.llm_microbatches(r):
            assert sum(tok[x] for x in mb) <= cap


@settings(max_examples=80, deadline=None)
@given(costs=cost_lists(), policy=policies(methods=("lpt", "hierarchical")), frac=st.floats(0.0, 1.0))
def test_tight_token_cap_is_never_violated(costs, policy, frac):
    """With a tight cap the greedy may give up (ValueError), but a plan it returns never breaks the cap."""
    if not costs:
        return
    tokens = [c.tokens for c in costs]
    cap = max(1, max(tokens) + math.ceil(frac * sum(tokens) / policy.num_microbatches))
    policy = MicrobatchPolicy(**{**policy.to_dict(), "max_tokens_per_microbatch": cap})
    try:
        plan = plan_microbatches(costs, policy, 0)
    except ValueError as exc:
        assert "fits in no microbatch" in str(exc)
        return
    tok = {c.index: c.tokens for c in costs}
    for r in range(plan.dp):
        for mb in plan.llm_microbatches(r):
            assert sum(tok[x] for x in mb) <= cap


@PROPERTY
@given(
    jobs=st.lists(st.integers(1, 20), min_size=1, max_size=7),
    m=st.integers(2, 3),
)
def test_lpt_within_graham_bound_of_brute_force_optimum(jobs, m):
    costs = make_costs([(float(j),) for j in jobs])
    plan = plan_microbatches(costs, MicrobatchPolicy(method="lpt", num_microbatches=m), 0)
    makespan = max(loads(plan, costs)[0])
    best = min(
        max(sum(j for j, g in zip(jobs, assign) if g == q) for q in range(m))
        for assign in itertools.product(range(m), repeat=len(jobs))
    )
    assert makespan <= (4 / 3 - 1 / (3 * m)) * best + 1e-9


@PROPERTY
@given(costs=cost_lists(max_size=14), dp=st.integers(2, 3), equal=st.booleans())
def test_level0_is_a_local_optimum(costs, dp, equal):
    """No single move (or swap) between ranks lowers the sum of squared normalised rank loads, unless both
    ranks are already within 1/256 of the mean in every module (where the search stops on purpose)."""
    if not costs:
        return
    policy = MicrobatchPolicy(method="hierarchical", dp=dp, equal_counts_per_rank=equal, refine_rounds=100)
    placed = pairs_of(plan_microbatches(costs, policy, 0))
    k = len(costs[0].work)
    totals = [math.fsum(c.work[q] for c in costs) for q in range(k)]
    norm = {c.index: np.array([c.work[q] / totals[q] if totals[q] else 0.0 for q in range(k)]) for c in costs}
    rank_load = np.zeros((dp, k))
    for c in costs:
        rank_load[placed[c.index][0]] += norm[c.index]
    settled = [
        all(abs(rank_load[r, q] * dp - 1) * 256 <= 1 for q in range(k) if totals[q]) for r in range(dp)
    ]
    members = [[c.index for c in costs if placed[c.index][0] == r] for r in range(dp)]

    def ss(a, b):
        return float((a * a).sum() + (b * b).sum())

    for r1, r2 in itertools.combinations(range(dp), 2):
        if settled[r1] and settled[r2]:
            continue
        base = ss(rank_load[r1], rank_load[r2])
        for x in members[r1]:
            for y in members[r2]:
                d = norm[y] - norm[x]
                assert ss(rank_load[r1] + d, rank_load[r2] - d) >= base - 1e-6
        if not equal:
            for src, dst, group in ((r1, r2, members[r1]), (r2, r1, members[r2])):
                for x in group:
                    assert ss(rank_load[src] - norm[x], rank_load[dst] + norm[x]) >= base - 1e-6


# ------------------------------------------------------------ hand cases


def test_arrival_splits_consecutive_equal_groups():
    costs = make_costs([(1.0,)] * 10)
    plan = plan_microbatches(costs, MicrobatchPolicy(method="arrival", dp=2, num_microbatches=2), 0)
    assert plan.microbatches == (((0, 1, 2), (3, 4)), ((5, 6, 7), (8, 9)))
    assert plan.deferred() == ()


@pytest.mark.parametrize("method", METHODS)
def test_fewer_samples_than_microbatches_leaves_empty_tuples(method):
    costs = make_costs([(2.0, 1.0), (0.0, 3.0), (1.0, 1.0)])
    plan = plan_microbatches(costs, MicrobatchPolicy(method=method, dp=2, num_microbatches=4), 7)
    sizes = [len(mb) for rank in plan.microbatches for mb in rank]
    assert sorted(sizes) == [0, 0, 0, 0, 0, 1, 1, 1]
    assert sorted(pairs_of(plan)) == [0, 1, 2]
    if method == "arrival":
        assert plan.microbatches == (((0,), (1,), (), ()), ((2,), (), (), ()))


def test_empty_batch_gives_all_empty_microbatches():
    plan = plan_microbatches([], MicrobatchPolicy(dp=2, num_microbatches=3), 0)
    assert plan.microbatches == (((), (), ()), ((), (), ()))
    assert plan.num_samples == 0


def test_random_differs_across_steps_and_keeps_equal_groups():
    costs = make_costs([(1.0,)] * 32)
    policy = MicrobatchPolicy(method="random", dp=2, num_microbatches=4, seed=3)
    plans = [plan_microbatches(costs, policy, step) for step in range(4)]
    assert len({json.dumps(p.to_dict()["microbatches"]) for p in plans}) == 4
    assert plan_microbatches(costs, policy, 2) == plans[2]
    assert all(len(mb) == 4 for p in plans for rank in p.microbatches for mb in rank)
    other_seed = plan_microbatches(
        costs, MicrobatchPolicy(method="random", dp=2, num_microbatches=4, seed=4), 2
    )
    assert other_seed != plans[2]


def test_lpt_graham_tight_example():
    # Jobs 3,3,2,2,2 on 2 machines: LPT gives {3,2,2} | {3,2} = 7 | 5, the optimum is 6 | 6.
    costs = make_costs([(3.0,), (3.0,), (2.0,), (2.0,), (2.0,)])
    plan = plan_microbatches(costs, MicrobatchPolicy(method="lpt", num_microbatches=2), 0)
    assert sorted(loads(plan, costs)[0]) == [5.0, 7.0]


@pytest.mark.parametrize("method", ["lpt", "hierarchical"])
def test_identical_and_zero_work_samples_spread_evenly(method):
    for work in [(0.0, 0.0), (2.0, 3.0)]:
        costs = make_costs([work] * 12)
        plan = plan_microbatches(costs, MicrobatchPolicy(method=method, dp=2, num_microbatches=3), 1)
        assert [len(mb) for rank in plan.microbatches for mb in rank] == [2] * 6
    costs = make_costs([(0.0, 0.0)] * 10)
    plan = plan_microbatches(costs, MicrobatchPolicy(method=method, dp=2, num_microbatches=3), 1)
    sizes = [len(mb) for rank in plan.microbatches for mb in rank]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 10


def test_hierarchical_defers_excess_llm_work_hand_case():
    # a: encoder 3, LLM 1; b, c, d: encoder 1, LLM 1. The only even encoder split is {a} | {b, c, d}
    # (3 | 3), which leaves the LLM at 1 | 3; deferring one of b, c, d to a's microbatch gives 2 | 2.
    costs = make_costs([(3.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)])
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2, max_deferred=1), 0)
    enc, llm = loads(plan, costs)
    assert sorted(enc) == [3.0, 3.0] and llm == [2.0, 2.0]
    (deferred,) = plan.deferred()
    index, rank, i, j = deferred
    assert index in (1, 2, 3) and (rank, i, j) == (0, 0, 1)
    assert set(plan.microbatches[0][0]) == {1, 2, 3} and plan.microbatches[0][1] == (0,)
    assert plan.llm_microbatches(0)[1] == tuple(sorted((0, index)))
    assert plan.buffered(0) == (1,) == tuple(buffered_counts(plan, 0))
    # Without deferral the LLM work must follow the encoder split.
    for policy in (
        MicrobatchPolicy(num_microbatches=2, max_deferred=0),
        MicrobatchPolicy(num_microbatches=2, allow_deferral=False),
    ):
        plan = plan_microbatches(costs, policy, 0)
        enc, llm = loads(plan, costs)
        assert sorted(enc) == [3.0, 3.0] and sorted(llm) == [1.0, 3.0] and plan.deferred() == ()


def test_text_only_sample_fills_the_light_microbatch():
    # a: encoder 2, LLM 2; b: encoder 2, LLM 1; t: text-only, LLM 1 -> {a} | {b, t}: 2 | 2 everywhere.
    costs = make_costs([(2.0, 2.0), (2.0, 1.0), (0.0, 1.0)])
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2), 0)
    enc, llm = loads(plan, costs)
    assert enc == [2.0, 2.0] and llm == [2.0, 2.0]
    placed = pairs_of(plan)
    assert placed[2][1] == placed[1][1] != placed[0][1] and plan.deferred() == ()


def test_token_cap_blocks_deferral_and_text_only_fill():
    # The deferral case above, but a's microbatch has no room for another 10-token sample under a cap of 30.
    costs = make_costs([(3.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)], tokens=[25, 10, 10, 10])
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2, max_tokens_per_microbatch=30), 0)
    enc, llm = loads(plan, costs)
    assert sorted(enc) == [3.0, 3.0] and sorted(llm) == [1.0, 3.0] and plan.deferred() == ()
    # The text-only case above, but t (10 tokens) does not fit next to b (25 tokens): it must join a.
    costs = make_costs([(2.0, 2.0), (2.0, 1.0), (0.0, 1.0)], tokens=[10, 25, 10])
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2, max_tokens_per_microbatch=30), 0)
    placed = pairs_of(plan)
    assert placed[2][1] == placed[0][1] != placed[1][1]
    assert sorted(loads(plan, costs)[1]) == [1.0, 3.0]


def test_level1_swap_fixes_lpt_unless_the_token_cap_forbids_it():
    # Encoder work 3,3,2,2,2: LPT gives {3,2,2} | {3,2} = 7 | 5; swapping a 3 with a 2 gives 6 | 6, but
    # puts both 10-token samples together (20 tokens), which a cap of 19 forbids.
    costs = make_costs([(3.0, 1.0), (3.0, 1.0), (2.0, 1.0), (2.0, 1.0), (2.0, 1.0)], tokens=[10, 10, 1, 1, 1])
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2), 0)
    assert sorted(loads(plan, costs)[0]) == [6.0, 6.0]
    plan = plan_microbatches(costs, MicrobatchPolicy(num_microbatches=2, max_tokens_per_microbatch=19), 0)
    assert sorted(loads(plan, costs)[0]) == [5.0, 7.0]


def test_token_cap_changes_the_split_and_too_large_sample_raises():
    # Work alone would pair the two heavy samples with the two light ones; tokens forbid pairing 0 with 2.
    costs = make_costs([(10.0,), (9.0,), (1.0,), (1.0,)], tokens=[60, 10, 50, 10])
    plan = plan_microbatches(
        costs, MicrobatchPolicy(method="lpt", num_microbatches=2, max_tokens_per_microbatch=100), 0
    )
    groups = sorted(sorted(mb) for mb in plan.microbatches[0])
    assert groups == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="sample 0 .*max_tokens_per_microbatch=50"):
        plan_microbatches(
            costs,
            MicrobatchPolicy(method="hierarchical", num_microbatches=4, max_tokens_per_microbatch=50),
            0,
        )


# ------------------------------------------------------------ cost model


def test_sample_costs_from_metadata_hand_worked():
    coeffs = {
        "vision": ModuleCostCoeffs(linear=2.0, quadratic=0.5, trainable=True, encoder_tokens_per_feature=2.0),
        "audio": ModuleCostCoeffs(linear=1.0),
        "llm": ModuleCostCoeffs(linear=1.0, quadratic=0.01, needs_input_grad=True),
    }
    meta = [
        {"text_tokens": 10, "length": 19, "items": [("vision", 2), ("vision", 1), ("audio", 6)]},
        {"text_tokens": 5, "items": []},
        {"text_tokens": 0, "items": [("audio", 7, 3)]},
    ]
    costs = sample_costs_from_metadata(meta, coeffs)
    assert module_order(coeffs) == ("vision", "audio", "llm")
    # vision items of 2 and 1 placeholders run 4 and 2 encoder tokens: 3 * (2*4 + 0.5*16) + 3 * (2*2 + 0.5*4)
    # = 48 + 18; audio 6; L = 10 + 2 + 1 + 6 = 19, LLM (frozen after a trainable part: forward + dX)
    # = 2 * (19 + 0.01 * 19**2).
    assert costs[0].work == pytest.approx((66.0, 6.0, 2 * (19 + 3.61)))
    assert costs[0].tokens == 19 and costs[0].has == (True, True, True)
    assert costs[1].work == pytest.approx((0.0, 0.0, 2 * (5 + 0.25)))
    assert costs[1].has == (False, False, True) and costs[1].encoder_work == 0.0
    assert costs[2].work == pytest.approx((0.0, 3.0, 2 * (7 + 0.49))) and costs[2].tokens == 7
    assert [c.index for c in costs] == [0, 1, 2]


def test_sample_costs_from_loader_sample_meta():
    from plait.data.processing import SampleMeta

    metas = [
        SampleMeta("a", "caption", 12, 3, 2, (("vision", 4), ("vision", 5))),
        SampleMeta("b", "chat", 7, 7, 4, ()),
    ]
    coeffs = {"vision": ModuleCostCoeffs(linear=1.0, quadratic=1.0), "llm": ModuleCostCoeffs(linear=1.0)}
    costs = sample_costs_from_metadata(metas, coeffs)
    assert [c.work for c in costs] == [(4 + 16 + 5 + 25, 12.0), (0.0, 7.0)]
    assert [c.tokens for c in costs] == [12, 7]


def test_cost_coeffs_pass_factors():
    assert ModuleCostCoeffs(trainable=True).pass_factor == 3
    assert ModuleCostCoeffs(trainable=False).pass_factor == 1
    assert ModuleCostCoeffs(trainable=False, needs_input_grad=True).pass_factor == 2
    assert ModuleCostCoeffs(linear=1.0, quadratic=0.5, fixed=2.0, trainable=True).cost(4) == 3 * (2 + 4 + 8)


@pytest.mark.parametrize(
    "meta, match",
    [
        ([{"text_tokens": 3, "items": [("video", 4)]}], "sample 0: encoder 'video'"),
        ([{"text_tokens": 3, "length": 9, "items": [("vision", 4)]}], "sample 0: length=9 but .* = 7"),
        ([{"items": []}], "sample 0: metadata lacks 'text_tokens'"),
        ([{"text_tokens": 1, "items": []}, {"text_tokens": 1, "items": [("vision", -2)]}], "sample 1"),
        ([{"text_tokens": 1, "items": [("vision",)]}], "sample 0: item"),
    ],
)
def test_metadata_errors_name_the_sample(meta, match):
    coeffs = {"vision": ModuleCostCoeffs(), "llm": ModuleCostCoeffs()}
    with pytest.raises(ValueError, match=match):
        sample_costs_from_metadata(meta, coeffs)


# ------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(index=0, work=(1.0, 2.0), has=(False, True)), r"work\[0\]=1.0 > 0 but has\[0\] is False"),
        (dict(index=0, work=(-1.0,)), r"work\[0\]"),
        (dict(index=0, work=(float("nan"),)), r"work\[0\]"),
        (dict(index=-1, work=(1.0,)), "index"),
        (dict(index=0, work=()), "at least one module"),
        (dict(index=0, work=(1.0, 1.0), has=(True,)), "has has 1 entries"),
    ],
)
def test_sample_cost_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SampleCost(**kwargs)


def test_plan_input_validation():
    with pytest.raises(ValueError, match="sample index 3 appears twice"):
        plan_microbatches([SampleCost(3, (1.0,)), SampleCost(3, (2.0,))], MicrobatchPolicy(), 0)
    with pytest.raises(ValueError, match="sample 4: 2 modules"):
        plan_microbatches([SampleCost(3, (1.0,)), SampleCost(4, (2.0, 1.0))], MicrobatchPolicy(), 0)
    with pytest.raises(ValueError, match="step"):
        plan_microbatches([], MicrobatchPolicy(), -1)
    with pytest.raises(ValueError, match="method"):
        MicrobatchPolicy(method="fastest")
    with pytest.raises(ValueError, match="num_microbatches"):
        MicrobatchPolicy(num_microbatches=0)
    with pytest.raises(ValueError, match="unknown field"):
        MicrobatchPolicy.from_dict({"dp": 2, "pp": 3})
    with pytest.raises(ValueError, match=r"sample 5 has encoder microbatch 1 but LLM microbatch 0"):
        MicrobatchPlan("hierarchical", 1, 2, 0, (((4,), (5,)),), (((0,), (0,)),))
    with pytest.raises(ValueError, match="sample 4 is assigned twice"):
        MicrobatchPlan("arrival", 1, 2, 0, (((4,), (4,)),))


def test_json_round_trips():
    costs = make_costs([(3.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.0, 2.0)])
    policy = MicrobatchPolicy(dp=1, num_microbatches=2, seed=5, max_tokens_per_microbatch=99)
    plan = plan_microbatches(costs, policy, 3)
    assert MicrobatchPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert MicrobatchPolicy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    assert SampleCost.from_dict(json.loads(json.dumps(costs[0].to_dict()))) == costs[0]
    stats = workload_stats(plan, costs)
    assert WorkloadStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats
    coeffs = ModuleCostCoeffs(linear=2.0, trainable=True)
    assert ModuleCostCoeffs.from_dict(json.loads(json.dumps(coeffs.to_dict()))) == coeffs


# ------------------------------------------------------------ metrics


def test_workload_stats_hand_worked():
    # s0 (enc 1, llm 3) and s2 (enc 1, llm 1, deferred to microbatch 1) enter microbatch 0; s1 (enc 2, llm 1)
    # runs in microbatch 1. Encoder per microbatch 2 | 2; LLM 3 | 2; total 5 | 4.
    costs = make_costs([(1.0, 3.0), (2.0, 1.0), (1.0, 1.0)])
    plan = MicrobatchPlan("hierarchical", 1, 2, 0, (((0, 2), (1,)),), (((0, 1), (1,)),))
    stats = workload_stats(plan, costs, ("vision", "llm"))
    assert stats.modules == ("vision", "llm")
    assert stats.cv == pytest.approx((0.0, 0.5 / 2.5))
    assert stats.max_over_mean == pytest.approx((1.0, 3.0 / 2.5))
    assert stats.total_cv == pytest.approx(0.5 / 4.5) and stats.total_max_over_mean == pytest.approx(5 / 4.5)
    assert stats.rank_max_over_mean == pytest.approx((1.0, 1.0))
    assert (stats.num_microbatches, stats.num_deferred, stats.max_buffered) == (2, 1, 1)
    zero = workload_stats(plan, make_costs([(0.0, 3.0), (0.0, 1.0), (0.0, 1.0)]))
    assert zero.cv[0] == 0.0 and zero.max_over_mean[0] == 1.0
    with pytest.raises(ValueError, match="plan and costs differ"):
        workload_stats(plan, costs[:2])


# ------------------------------------------------------------ realistic mixture


COEFFS = {
    # Dynamic-resolution ViT (14-pixel patches, 2x2 merge into the LLM), frozen.
    "vision": ModuleCostCoeffs(linear=1.0, quadratic=1 / 4096, trainable=False, encoder_tokens_per_feature=4),
    # Whisper-like audio encoder at 50 frames/s, 2x pooled, trainable.
    "audio": ModuleCostCoeffs(linear=1.0, quadratic=1 / 1500, trainable=True, encoder_tokens_per_feature=2),
    "llm": ModuleCostCoeffs(linear=2.0, quadratic=1 / 2048, trainable=True),
}


def synthetic_mixture(n: int, seed: int) -> list[dict]:
    """Image-only 30%, audio-only 15%, image+audio 15%, text-only 40%; image sides 224-2016 px (a fifth of
    the image samples carry two images), clips 1-30 s (log-normal), text log-normal 16-4096 tokens."""
    rng = np.random.default_rng(seed)
    meta = []
    for kind in rng.choice(4, size=n, p=[0.30, 0.15, 0.15, 0.40]):
        items = []
        if kind in (0, 2):
            for _ in range(2 if rng.random() < 0.2 else 1):
                h, w = rng.uniform(224, 2016, size=2)
                items.append(("vision", int(h // 28) * int(w // 28)))  # 14-px patches, 2x2 merge
        if kind in (1, 2):
            items.append(("audio", int(25 * np.clip(rng.lognormal(2.0, 0.8), 1, 30))))  # 50 frames/s, 2x pool
        meta.append({"text_tokens": int(np.clip(rng.lognormal(5.0, 1.0), 16, 4096)), "items": items})
    return meta


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hierarchical_cuts_cv_of_every_module_at_least_5x(seed):
    costs = sample_costs_from_metadata(synthetic_mixture(256, seed), COEFFS)
    kinds = {tuple(c.has[:2]) for c in costs}
    assert kinds == {(True, False), (False, True), (True, True), (False, False)}
    base = loads(plan_microbatches(costs, MicrobatchPolicy(method="arrival", num_microbatches=16), 0), costs)
    plan = plan_microbatches(
        costs, MicrobatchPolicy(method="hierarchical", num_microbatches=16, seed=seed), 0
    )
    ours = loads(plan, costs)
    factors = [cv(a) / max(cv(h), 1e-12) for a, h in zip(base, ours)]
    print(
        f"seed {seed}: CV arrival {[round(cv(a), 4) for a in base]} hierarchical "
        f"{[round(cv(h), 4) for h in ours]} factors {[round(f, 1) for f in factors]}"
    )
    assert all(f >= 5 for f in factors), factors
    assert all(b <= 4 for b in buffered_counts(plan, 0))
    # Stragglers: every module's busiest microbatch is within 5% of the unavoidable bound (the mean, or the
    # single heaviest sample when that alone exceeds it).
    for module, per_mb in enumerate(ours):
        mean = statistics.fmean(per_mb)
        bound = max(1.0, max(c.work[module] for c in costs) / mean)
        assert max(per_mb) / mean <= bound + 0.05, (module, max(per_mb) / mean, bound)


def test_same_plan_in_fresh_processes_with_other_hash_seeds():
    """Every rank computes its plan alone: a fresh interpreter (other PYTHONHASHSEED) must agree."""
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_microbatch as t\n"
        "costs = t.sample_costs_from_metadata(t.synthetic_mixture(128, 4), t.COEFFS)\n"
        "policy = t.MicrobatchPolicy(dp=2, num_microbatches=4, seed=9, equal_counts_per_rank=True)\n"
        "print(json.dumps(t.plan_microbatches(costs, policy, 11).to_dict()))\n"
    )
    costs = sample_costs_from_metadata(synthetic_mixture(128, 4), COEFFS)
    policy = MicrobatchPolicy(dp=2, num_microbatches=4, seed=9, equal_counts_per_rank=True)
    expected = plan_microbatches(costs, policy, 11)
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert MicrobatchPlan.from_dict(json.loads(out)) == expected


def test_hierarchical_balances_dp_ranks_and_microbatches():
    costs = sample_costs_from_metadata(synthetic_mixture(256, 7), COEFFS)
    for method, limit in (("arrival", None), ("hierarchical", 1.02)):
        plan = plan_microbatches(costs, MicrobatchPolicy(method=method, dp=4, num_microbatches=4), 0)
        per_mb = loads(plan, costs)
        rank_totals = [[sum(module[r * 4 : r * 4 + 4]) for r in range(4)] for module in per_mb]
        worst = max(max(t) / statistics.fmean(t) for t in rank_totals)
        if limit is None:
            arrival_worst, arrival_cv = worst, [cv(x) for x in per_mb]
        else:
            assert worst <= limit < arrival_worst
            assert all(cv(h) * 5 <= a for h, a in zip(per_mb, arrival_cv))
