"""ZB-V, the V-shape zero-bubble schedule: placement, closed forms on a uniform chain, and random multimodal plans
(complete, deadlock-free, 1F1B's activation memory, simulated makespan equal to the executed order replayed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.pipeline.plan import plan_pipeline, stage_ranks, synthetic_units, v_shape_ranks
from plait.planner.pipeline.schedule_ir import check_schedule, in_flight_peaks, run_blocking
from plait.planner.pipeline.schedules import build_schedule, one_f_one_b, zb_h1, zb_v
from plait.planner.pipeline.simulator import simulate
from plait.planner.pipeline.types import StageMemory
from tests.unit.planner.random_plans import draw_encoders


def _v_chain(p: int, trainable: bool = True, encoder: str | None = None):
    """An LLM of ``2 p`` one-unit stages in a V over ``p`` ranks; ``encoder``: None, ``"alone"`` (own rank 0) or
    ``"attached"`` (on the first LLM rank), a frozen encoder with a trainable projector."""
    enc = {} if encoder is None else {"vision": [False, True]}
    counts = {"llm": 2 * p} | ({"vision": 1} if encoder else {})
    ranks = stage_ranks(1 if encoder else 0, p, 2, attach_encoders=encoder == "attached", v_shape=True)
    return plan_pipeline(synthetic_units(enc, [trainable] * (2 * p)), stages_per_module=counts, ranks=ranks)


def test_v_shape_ranks():
    assert v_shape_ranks((), 3) == (0, 1, 2, 2, 1, 0)
    assert v_shape_ranks((0, 1), 2) == (0, 1, 2, 3, 3, 2)
    assert stage_ranks(2, 2, 2, v_shape=True) == (0, 1, 2, 3, 3, 2)
    assert stage_ranks(2, 2, 2, attach_encoders=True, v_shape=True) == (0, 0, 0, 1, 1, 0)
    with pytest.raises(ValueError, match="2 LLM stages per rank"):
        stage_ranks(0, 2, 3, v_shape=True)


def test_orders_by_hand():
    # p = 2, M = 3: rank 0 holds LLM stages 0 and 3, rank 1 stages 1 and 2. Stage 0 (depth 4) holds up to 3
    # microbatches (one fewer than 1F1B's 4), so rank 0 runs its 3 forwards back to back; stage 3's forward of
    # microbatch 0 arrives at tick 3 and its B and W follow at once (the loss is on rank 0). Rank 1 runs chunk 0 and
    # chunk 1 of each microbatch back to back.
    s = zb_v(_v_chain(2), 3)
    assert [f"{a.kind}{a.stage}.{a.microbatch}" for a in s.actions[0][:7]] == [
        "F0.0", "F0.1", "F0.2", "F3.0", "B3.0", "W3.0", "F3.1"]
    assert [f"{a.kind}{a.stage}.{a.microbatch}" for a in s.actions[1][:6]] == [
        "F1.0", "F2.0", "F1.1", "F2.1", "B2.0", "B1.0"]
    assert s.name == "zb_v" and s.split_backward


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (3, 9)])
def test_uniform_chain_closed_form(p, m):
    """Chunk costs F/2 = B/2 = W/2 = 0.5: ``M (F + B + W) + (p - 1) F / 2``, at 1F1B's peak (``p`` stage
    activations = ``2p`` chunk activations on rank 0), against ZB-H1's ``(p - 1)(F + B - W)`` bubble on ``p``
    whole stages and 1F1B's ``(p - 1)(F + B + W)``."""
    chunk = {k: [0.5] * (2 * p) for k in "FBW"}
    v = simulate(zb_v(_v_chain(p), m), chunk, memory={s: StageMemory(0, 1) for s in range(2 * p)})
    assert v.makespan_s == m * 3 + (p - 1) * 0.5
    assert max(v.peak_memory_bytes) == 2 * p
    whole = plan_pipeline(synthetic_units({}, [True] * p), stages_per_module={"llm": p})
    costs, memory = {k: [1.0] * p for k in "FBW"}, {s: StageMemory(0, 2) for s in range(p)}
    h1 = simulate(zb_h1(whole, m), costs, memory=memory)
    plain = simulate(one_f_one_b(whole, m, split_backward=True), costs, memory=memory)
    assert h1.makespan_s == m * 3 + (p - 1) * 1 and plain.makespan_s == m * 3 + (p - 1) * 2
    assert max(h1.peak_memory_bytes) == max(plain.peak_memory_bytes) == 2 * p


def test_frozen_llm_has_no_w_and_a_frozen_encoder_no_backward():
    s = zb_v(_v_chain(2, trainable=False, encoder="alone"), 4)
    kinds = {(s.plan.stages[a.stage].is_llm, a.kind) for _, a in s.all_actions()}
    assert (True, "W") not in kinds and (True, "B") in kinds  # a frozen LLM still passes gradients to the projector
    enc = s.plan.module_stages("vision")[0]
    assert {a.kind for a in s.stage_actions(enc)} == {"F", "B", "W"}  # its projector trains


def test_placement_errors():
    cyclic = plan_pipeline(synthetic_units({}, [True] * 4), stages_per_module={"llm": 4}, ranks=[0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"LLM stage 2 \(plan stage 2\) is on rank 0, but a V"):
        zb_v(cyclic, 4)
    odd = plan_pipeline(synthetic_units({}, [True] * 3), stages_per_module={"llm": 3}, ranks=[0, 1, 0])
    with pytest.raises(ValueError, match="even number of LLM stages"):
        build_schedule(odd, "zb_v", 4)
    units = synthetic_units({"vision": [True]}, [True] * 4)
    on_second = plan_pipeline(units, stages_per_module={"llm": 4, "vision": 1}, ranks=[1, 0, 1, 1, 0])
    with pytest.raises(ValueError, match="encoder stage 0 is on LLM rank 1"):
        zb_v(on_second, 4)


@st.composite
def v_plans(draw):
    """Random encoder branches (each stage on its own rank, or every encoder stage on the first LLM rank) and an
    LLM of ``2 p`` stages in a V; random frozen flags."""
    layout, encoders, counts, enc_stages = draw_encoders(draw)
    p = draw(st.integers(1, 4))
    llm = draw(st.lists(st.booleans(), min_size=2 * p, max_size=2 * p + 2))
    counts |= {"llm": 2 * p}
    ranks = stage_ranks(enc_stages, p, 2, attach_encoders=draw(st.booleans()), v_shape=True)
    return plan_pipeline(synthetic_units(encoders, llm), layout, stages_per_module=counts, ranks=ranks)


@settings(max_examples=80, deadline=None)
@given(v_plans(), st.integers(1, 12), st.data())
def test_random_plans(plan, m, data):
    """Complete and deadlock-free (``check_schedule``); every LLM rank holds at most ``2p`` chunk microbatches
    (1F1B's ``p`` stage activations); the simulated makespan with random costs equals the executed order replayed
    (each rank runs its actions in order, an action starting when its rank is free and its inputs are done)."""
    schedule = build_schedule(plan, "zb_v", m)
    check_schedule(schedule)
    assert run_blocking(schedule) == [len(a) for a in schedule.actions]
    peaks = in_flight_peaks(schedule)
    llm = plan.llm_stages
    p = len(llm) // 2
    for i in range(p):
        assert peaks[llm[i]] + peaks[llm[2 * p - 1 - i]] <= 2 * p
    table = {k: [data.draw(st.integers(1, 5)) for _ in range(plan.num_stages)] for k in "FBW"}
    assert simulate(schedule, table).makespan_s == _replayed(schedule, table)


def _replayed(schedule, table):
    """The end of the last action when each rank runs its list in order (written from the definitions)."""
    from plait.planner.pipeline.schedule_ir import action_dependencies

    end, free, pos = {}, [0] * len(schedule.actions), [0] * len(schedule.actions)
    while any(pos[r] < len(a) for r, a in enumerate(schedule.actions)):
        moved = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = action_dependencies(schedule.plan, a)
                if not all(d in end for d in deps):
                    break
                start = max([free[r], *(end[d] for d in deps)])
                end[a] = free[r] = start + table[a.kind][a.stage]
                pos[r] += 1
                moved = True
        assert moved, "the order deadlocks"
    return max(end.values())
