"""Simulator: hand-worked timelines, closed forms, and a longest-path brute force on random plans."""

from __future__ import annotations

import json
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedules import gpipe, one_f_one_b, zb_h1, zb_h2
from plait.planner.pipeline.types import P2PModel, SimResult, StageMemory, TimelineEvent
from plait.planner.pipeline.simulator import boundary_bytes_from_units, simulate, stage_costs_from_units
from plait.planner.types import UnitCost
from tests.unit.planner.random_plans import draw_plan, generate


def _chain(n_stages: int, trainable: bool = True):
    return plan_pipeline(synthetic_units({}, [trainable] * n_stages), stages_per_module={"llm": n_stages})


def _timeline(result):
    return [(e.rank, f"{e.kind}{e.stage}.{e.microbatch}", e.start_s, e.end_s) for e in result.events]


# ----- hand-worked cases -------------------------------------------------------------------------
def test_two_stage_1f1b_hand_worked():
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.0, (1, "B"): 2.0}
    result = simulate(one_f_one_b(_chain(2), 2), costs)
    # rank 0: F0 [0,1] F1 [1,2] B0 waits for rank 1's B0 (ends 4) [4,6] B1 waits for B1 (ends 7) [7,9]
    # rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    assert _timeline(result) == [
        (0, "F0.0", 0, 1), (0, "F0.1", 1, 2), (0, "B0.0", 4, 6), (0, "B0.1", 7, 9),
        (1, "F1.0", 1, 2), (1, "B1.0", 2, 4), (1, "F1.1", 4, 5), (1, "B1.1", 5, 7),
    ]  # fmt: skip
    assert result.makespan_s == 9.0
    assert result.busy_s == (6.0, 6.0)
    assert result.bubble_fraction == pytest.approx((1 / 3, 1 / 3))


def test_two_stage_1f1b_with_latency():
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.0, (1, "B"): 2.0}
    result = simulate(one_f_one_b(_chain(2), 2), costs, p2p=P2PModel(latency_s=0.5))
    assert _timeline(result) == [
        (0, "F0.0", 0, 1), (0, "F0.1", 1, 2), (0, "B0.0", 5, 7), (0, "B0.1", 8, 10),
        (1, "F1.0", 1.5, 2.5), (1, "B1.0", 2.5, 4.5), (1, "F1.1", 4.5, 5.5), (1, "B1.1", 5.5, 7.5),
    ]  # fmt: skip
    assert result.makespan_s == 10.0


def test_two_stage_1f1b_with_message_overheads():
    # LogP overheads: every cross-rank message costs its sender 0.25 s and its receiver 0.125 s of host time
    costs = {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.0, (1, "B"): 2.0}
    p2p = P2PModel(latency_s=0.5, send_overhead_s=0.25, recv_overhead_s=0.125)
    result = simulate(one_f_one_b(_chain(2), 2), costs, p2p=p2p)
    assert _timeline(result) == [
        (0, "F0.0", 0, 1.25), (0, "F0.1", 1.25, 2.5), (0, "B0.0", 5.625, 7.75), (0, "B0.1", 9, 11.125),
        (1, "F1.0", 1.75, 2.875), (1, "B1.0", 2.875, 5.125), (1, "F1.1", 5.125, 6.25), (1, "B1.1", 6.25, 8.5),
    ]  # fmt: skip
    assert result.makespan_s == 11.125
    assert result.busy_s == (6.75, 6.75)
    with pytest.raises(ValueError, match="send_overhead_s"):
        P2PModel(send_overhead_s=-0.1)


def _multimodal():
    # vision: one trainable stage; audio: one frozen stage (forward only); LLM: one trainable stage
    units = synthetic_units({"vision": [True], "audio": [False]}, [True])
    return plan_pipeline(units)


def test_multimodal_dag_hand_worked():
    costs = {(0, "F"): 2, (0, "B"): 3, (1, "F"): 4, (2, "F"): 1, (2, "B"): 2}
    memory = {0: StageMemory(100, 10), 1: StageMemory(50, 7), 2: StageMemory(200, 30)}
    result = simulate(one_f_one_b(_multimodal(), 2), costs, memory=memory)
    # LLM F0 waits for audio F0 (ends 4); vision B0 waits for LLM B0 (ends 7), B1 for LLM B1 (ends 11)
    assert _timeline(result) == [
        (0, "F0.0", 0, 2), (0, "F0.1", 2, 4), (0, "B0.0", 7, 10), (0, "B0.1", 11, 14),
        (1, "F1.0", 0, 4), (1, "F1.1", 4, 8),
        (2, "F2.0", 4, 5), (2, "B2.0", 5, 7), (2, "F2.1", 8, 9), (2, "B2.1", 9, 11),
    ]  # fmt: skip
    assert result.makespan_s == 14
    assert result.busy_s == (10, 8, 6)
    # vision holds 2 microbatches at once; audio only while a forward runs; the LLM one at a time
    assert result.peak_memory_bytes == (100 + 2 * 10, 50 + 7, 200 + 30)


def test_multimodal_dag_with_bandwidth():
    costs = {(0, "F"): 2, (0, "B"): 3, (1, "F"): 4, (2, "F"): 1, (2, "B"): 2}
    p2p = P2PModel(latency_s=0.5, bandwidth_Bps=1000.0)
    result = simulate(one_f_one_b(_multimodal(), 2), costs, p2p=p2p, boundary_bytes={0: 1000, 1: 2000})
    # vision -> LLM takes 0.5 + 1 s, audio -> LLM 0.5 + 2 s, LLM -> vision gradient 0.5 + 1 s
    assert _timeline(result)[2:4] == [(0, "B0.0", 11, 14), (0, "B0.1", 15, 18)]
    assert _timeline(result)[6:] == [
        (2, "F2.0", 6.5, 7.5), (2, "B2.0", 7.5, 9.5), (2, "F2.1", 10.5, 11.5), (2, "B2.1", 11.5, 13.5),
    ]  # fmt: skip
    assert result.makespan_s == 18


def test_gpipe_closed_form_with_comm():
    # GPipe on a uniform chain: T = (M + S - 1)(f + b) + 2 (S - 1) c  (derived by induction on stages)
    s, m, f, b, c = 3, 4, 1.0, 2.0, 0.25
    costs = {"F": [f] * s, "B": [b] * s}
    p2p = P2PModel(latency_s=0.05, bandwidth_Bps=100.0)  # 0.05 + 20 / 100 = 0.25 s
    result = simulate(gpipe(_chain(s), m), costs, p2p=p2p, boundary_bytes={0: 20, 1: 20})
    assert result.makespan_s == pytest.approx((m + s - 1) * (f + b) + 2 * (s - 1) * c)


def test_memory_of_split_backward_frees_at_w():
    plan = _chain(2)
    costs = {"F": [1, 1], "B": [1, 1], "W": [1, 1]}
    memory = {0: StageMemory(0, 5), 1: StageMemory(1000, 3)}
    result = simulate(one_f_one_b(plan, 3, split_backward=True), costs, memory=memory)
    # stage 0 holds 2 (warm-up 1), stage 1 holds 1: F, B, W then the next F
    assert result.peak_memory_bytes == (2 * 5, 1000 + 3)
    per_mb = {0: StageMemory(0, (5, 50, 7)), 1: StageMemory(0, 0)}
    result = simulate(one_f_one_b(plan, 3, split_backward=True), costs, memory=per_mb)
    assert result.peak_memory_bytes == (50 + 7, 0)  # microbatches 1 and 2 overlap, 0 is freed first


# ----- closed forms ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 10), st.integers(1, 5), st.integers(1, 5), st.booleans())
def test_uniform_chain_closed_form(s, m, f, b, use_gpipe):
    """Uniform chain, zero comm: T = (M + S - 1)(f + b), every rank idles (S - 1)/(M + S - 1)."""
    schedule = (gpipe if use_gpipe else one_f_one_b)(_chain(s), m)
    result = simulate(schedule, {"F": [f] * s, "B": [b] * s})
    assert result.makespan_s == (m + s - 1) * (f + b)
    assert result.bubble_fraction == pytest.approx([(s - 1) / (m + s - 1)] * s)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(1, 10), st.booleans())
def test_oobleck_formula_bottleneck_last(work, m, use_gpipe):
    """../shared/REFERENCES.md section 2 with the (rightmost) slowest stage last, k* = S:
    T = sum w + (M - S + k* - 1) w_k* + sum_{i > k*} w_i = sum w + (M - 1) w_S, with b = 2 f per stage."""
    work = work[:-1] + [max(work)]
    s = len(work)
    schedule = (gpipe if use_gpipe else one_f_one_b)(_chain(s), m)
    result = simulate(schedule, {"F": work, "B": [2 * w for w in work]})
    w = [3 * x for x in work]
    assert result.makespan_s == sum(w) + (m - s + s - 1) * w[-1]


def test_zero_bubble_deferred_w():
    """Uniform chain with F = B = W = 1, S = 4, M = 8. With W right after B, B alone carries the gradient
    back: T = M (F+B+W) + (S-1)(F+B) = 30. Deferring W gives ZB-H1's M (F+B+W) + (S-1)(F+B-W) = 27."""
    costs = {"F": [1] * 4, "B": [1] * 4, "W": [1] * 4}
    memory = {s: StageMemory(0, 1) for s in range(4)}
    inline = simulate(one_f_one_b(_chain(4), 8, split_backward=True), costs, memory=memory)
    deferred = simulate(one_f_one_b(_chain(4), 8, split_backward=True, defer_weight_grad=True), costs, memory=memory)
    assert inline.makespan_s == 8 * 3 + 3 * 2
    assert deferred.makespan_s == 8 * 3 + 3 * 1
    assert max(deferred.peak_memory_bytes) == max(inline.peak_memory_bytes) == 4


@pytest.mark.parametrize("s, m, f, b, w", [(4, 8, 1, 1, 1), (4, 8, 1, 1, 0.5), (4, 8, 1, 2, 1), (8, 16, 1, 1, 0.5),
                                            (2, 6, 1, 1, 1)])
def test_zero_bubble_makespans_on_a_uniform_chain(s, m, f, b, w):
    """ZB-H1: M (F+B+W) + (S-1)(F+B-W) at 1F1B's peak of S microbatches; ZB-H2 reaches the bound every schedule
    has on this chain, M (F+B+W) + (S-1) F (the last rank's first forward waits for S-1 others), holding up to
    2S-1 (Qi et al., ICLR 2024, section 3.1)."""
    costs = {"F": [f] * s, "B": [b] * s, "W": [w] * s}
    memory = {k: StageMemory(0, 1) for k in range(s)}
    h1, h2 = simulate(zb_h1(_chain(s), m), costs, memory=memory), simulate(zb_h2(_chain(s), m), costs, memory=memory)
    assert h1.makespan_s == m * (f + b + w) + (s - 1) * (f + b - w)
    assert h2.makespan_s == m * (f + b + w) + (s - 1) * f
    assert max(h1.peak_memory_bytes) == s and max(h2.peak_memory_bytes) == min(2 * s - 1, m)


# ----- brute force on random plans --------------------------------------------------------------
@st.composite
def random_cases(draw):
    plan = draw_plan(draw, slack=1)[0]
    m = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["gpipe", "1f1b", "capped"]))
    split, defer = draw(st.sampled_from([(False, False), (True, False), (True, True)]))
    schedule = generate(kind, plan, m, split, defer, draw(st.integers(1, 3)) if kind == "capped" else None)
    n = plan.num_stages
    table = {k: [[draw(st.integers(0, 6)) for _ in range(m)] for _ in range(n)] for k in "FBW"}
    boundary = {s: draw(st.integers(0, 3)) for s in range(n)}
    memory = {s: StageMemory(draw(st.integers(0, 5)), draw(st.integers(0, 5))) for s in range(n)}
    return schedule, table, boundary, memory


def _ref_makespan(schedule, table, boundary, p2p):
    """Longest path through rank order + data dependencies (Kahn order), written from the definitions."""
    plan = schedule.plan
    rank_of = {s.index: s.rank for s in plan.stages}
    preds = {}
    for actions in schedule.actions:
        for i, a in enumerate(actions):
            key = (a.kind, a.stage, a.microbatch)
            edges = [(actions[i - 1].kind, actions[i - 1].stage, actions[i - 1].microbatch, 0.0)] if i else []
            if a.kind == "F":
                for p, q in plan.edges:
                    if q == a.stage:
                        hop = p2p.transfer_s(boundary[p]) if rank_of[p] != rank_of[q] else 0.0
                        edges.append(("F", p, a.microbatch, hop))
            elif a.kind == "B":
                edges.append(("F", a.stage, a.microbatch, 0.0))
                for p, q in plan.edges:
                    if p == a.stage and plan.stages[q].runs_backward:
                        hop = p2p.transfer_s(boundary[p]) if rank_of[p] != rank_of[q] else 0.0
                        edges.append(("B", q, a.microbatch, hop))
            else:
                edges.append(("B", a.stage, a.microbatch, 0.0))
            preds[key] = edges
    succ = {k: [] for k in preds}
    for k, edges in preds.items():
        for e in edges:
            succ[e[:3]].append(k)
    indeg = {k: len(v) for k, v in preds.items()}
    finish = {}
    queue = deque(k for k, d in indeg.items() if d == 0)
    while queue:
        k = queue.popleft()
        start = max([finish[e[:3]] + e[3] for e in preds[k]], default=0.0)
        finish[k] = start + table[k[0]][k[1]][k[2]]
        for t in succ[k]:
            indeg[t] -= 1
            if indeg[t] == 0:
                queue.append(t)
    assert len(finish) == len(preds)
    return max(finish.values())


def _ref_peak_memory(schedule, events, memory):
    """At every allocation instant, sum the live intervals [F start, freeing end) per rank."""
    plan = schedule.plan
    by_key = {(e.kind, e.stage, e.microbatch): e for e in events}
    intervals = {r: [] for r in range(schedule.num_ranks)}
    for e in events:
        if e.kind != "F":
            continue
        stage = plan.stages[e.stage]
        if not stage.runs_backward:
            end = e.end_s
        else:
            frees = "W" if schedule.split_backward and stage.trainable else "B"
            end = by_key[(frees, e.stage, e.microbatch)].end_s
        intervals[e.rank].append((e.start_s, end, memory[e.stage].activation_bytes))
    peaks = []
    for r in range(schedule.num_ranks):
        static = sum(memory[s.index].static_bytes for s in plan.stages if s.rank == r)
        live = [sum(b for a, z, b in intervals[r] if a <= t < z) for t, _, _ in intervals[r]]
        peaks.append(static + max([0] + [x for x in live]))
    return tuple(peaks)


@settings(max_examples=60, deadline=None)
@given(random_cases(), st.sampled_from([0.0, 0.5]), st.sampled_from([None, 2.0]))
def test_random_plans_match_longest_path(case, latency, bandwidth):
    schedule, table, boundary, memory = case
    p2p = P2PModel(latency, bandwidth)
    result = simulate(schedule, table, p2p=p2p, boundary_bytes=boundary, memory=memory)
    assert result.makespan_s == pytest.approx(_ref_makespan(schedule, table, boundary, p2p))
    assert result.peak_memory_bytes == _ref_peak_memory(schedule, result.events, memory)
    for rank in range(schedule.num_ranks):
        mine = sorted((e for e in result.events if e.rank == rank), key=lambda e: e.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))  # one action at a time
        assert result.busy_s[rank] == pytest.approx(sum(e.end_s - e.start_s for e in mine))


# ----- inputs and outputs ------------------------------------------------------------------------
def test_cost_forms_agree():
    schedule = one_f_one_b(_chain(2), 3, split_backward=True)
    per_mb = [[1.0, 2.0, 3.0], [0.5, 0.5, 4.0]]
    table = {"F": np.array(per_mb), "B": [[1, 1, 1], [2, 2, 2]], "W": [0.5, 0.25]}
    keyed = {(0, "F"): per_mb[0], (1, "F"): lambda mb: per_mb[1][mb], (0, "B"): 1, (1, "B"): 2.0}
    keyed |= {(0, "W"): 0.5, (1, "W"): 0.25}
    def fn(stage, kind, mb):
        return {"F": per_mb[stage][mb], "B": [1, 2][stage], "W": [0.5, 0.25][stage]}[kind]

    results = [simulate(schedule, c).events for c in (table, keyed, fn)]
    assert results[0] == results[1] == results[2]
    assert results[0][0] == TimelineEvent(0, "F", 0, 0, 0.0, 1.0)


def test_cost_errors():
    schedule = one_f_one_b(_chain(2), 2)
    with pytest.raises(ValueError, match="no time for B of stage 1"):
        simulate(schedule, {"F": [1, 1], "B": [1]})
    with pytest.raises(ValueError, match=">= 0"):
        simulate(schedule, {"F": [1, -1], "B": [1, 1]})
    with pytest.raises(ValueError, match="no microbatch 1"):
        simulate(schedule, {"F": [[1], [1]], "B": [1, 1]})
    with pytest.raises(ValueError, match="latency_s"):
        P2PModel(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        P2PModel(bandwidth_Bps=0)
    with pytest.raises(ValueError, match="bytes must be >= 0"):
        StageMemory(-1, 0)
    with pytest.raises(ValueError, match="no entry for microbatch 1"):
        simulate(schedule, {"F": [1, 1], "B": [1, 1]}, memory={0: StageMemory(0, (5,))})


def test_stage_costs_from_units():
    # frozen encoder unit, trainable projector, frozen LLM (needs dX only)
    units = synthetic_units({"vision": [False, True]}, [False, False])
    plan = plan_pipeline(units, stages_per_module={"llm": 2})
    cost = {u.name: UnitCost(1.0, 2.0, 3.0, output_bytes=10 * (i + 1)) for i, u in enumerate(units)}
    full = stage_costs_from_units(plan, units, cost)
    # stage 0 = vision.0 (no dX, no dW) + vision.1 (dW only); stages 1, 2: dX only
    assert full[(0, "F")] == 2.0 and full[(0, "B")] == 3.0
    assert full[(1, "B")] == 2.0 and full[(2, "B")] == 2.0
    split = stage_costs_from_units(plan, units, cost, split_backward=True)
    assert (split[(0, "B")], split[(0, "W")], split[(1, "W")]) == (0.0, 3.0, 0.0)
    assert boundary_bytes_from_units(plan, cost) == {0: 20, 1: 30, 2: 40}
    with pytest.raises(ValueError, match="no Unit or no UnitCost"):
        stage_costs_from_units(plan, units, {})


def test_sim_result_json_round_trip():
    schedule = gpipe(_chain(2), 2)
    result = simulate(schedule, {"F": [1, 2], "B": [2, 4]}, memory={0: StageMemory(3, (1, 2))})
    again = SimResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result
    assert again.mean_bubble_fraction == pytest.approx(sum(result.bubble_fraction) / 2)
    assert StageMemory.from_dict(json.loads(json.dumps(StageMemory(3, (1, 2)).to_dict()))) == StageMemory(3, (1, 2))


def test_interleaved_schedule_memory_sums_a_ranks_chunks():
    # p = 2 ranks x v = 2 chunks, M = 2. Rank 0 (stages 0, 2) warms up with min(2 + 2, 4) = 4 forwards, so it
    # holds both microbatches of both chunks: 2 x 1 + 2 x 100 bytes. Rank 1 (stages 1, 3) runs
    # F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1: at most 2 x 10 + 1000. Static: 5 bytes per stage.
    from plait.planner.pipeline.plan import interleaved_ranks
    from plait.planner.pipeline.interleaved import interleaved_1f1b

    plan = plan_pipeline(synthetic_units({}, [True] * 4), stages_per_module={"llm": 4},
                         ranks=interleaved_ranks([], 2, 2), num_microbatches=2)
    schedule = interleaved_1f1b(plan)
    memory = {s: StageMemory(5, a) for s, a in enumerate([1, 10, 100, 1000])}
    result = simulate(schedule, {"F": [1.0] * 4, "B": [1.0] * 4}, memory=memory)
    assert result.peak_memory_bytes == (10 + 202, 10 + 1020)
    # Timeline (F = B = 1, free transfers): rank 0 F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] F2.1 [3,4]; rank 1 F1.0 [1,2]
    # F1.1 [2,3] F3.0 [3,4] B3.0 [4,5] F3.1 [5,6] B3.1 [6,7]; rank 0 B2.0 [5,6] B2.1 [7,8]; rank 1 B1.0 [7,8]
    # B1.1 [8,9]; rank 0 B0.0 [8,9] B0.1 [9,10].
    assert result.makespan_s == 10.0
