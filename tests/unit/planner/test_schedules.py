"""Schedule IR, generators and checker.

Generated schedules are verified against references written here from the definitions: the expected
action multiset, and deadlock freedom as acyclicity of (rank order + data dependencies), found by Kahn's
algorithm rather than by the library's blocking execution.
"""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.schedule_ir import Action, Schedule, check_schedule, in_flight_peaks, schedule_dag
from plait.planner.pipeline.schedules import build_schedule, gpipe, memory_capped_1f1b, one_f_one_b, zb_h1
from tests.unit.planner.random_plans import draw_encoders, draw_plan, generate


def _parse(text: str) -> tuple[Action, ...]:
    """``"F0 F1 B0"`` with a fixed stage -> actions; ``"F0.1"`` = kind, stage 0, microbatch 1."""
    out = []
    for token in text.split():
        stage, mb = token[1:].split(".")
        out.append(Action(token[0], int(stage), int(mb)))
    return tuple(out)


def _chain(n_stages: int, trainable: bool = True, units_per_stage: int = 1):
    units = synthetic_units({}, [trainable] * (n_stages * units_per_stage))
    return plan_pipeline(units, stages_per_module={"llm": n_stages})


# ----- references ----------------------------------------------------------------------------
def _ref_expected(plan, m, split):
    out = Counter()
    for stage in plan.stages:
        back = stage.trainable or stage.needs_input_grad
        for mb in range(m):
            out[("F", stage.index, mb)] += 1
            if back:
                out[("B", stage.index, mb)] += 1
            if split and stage.trainable:
                out[("W", stage.index, mb)] += 1
    return out


def _ref_deps(plan, kind, s, mb):
    if kind == "F":
        return [("F", a, mb) for a, b in plan.edges if b == s]
    if kind == "W":
        return [("B", s, mb)]
    succ = [("B", b, mb) for a, b in plan.edges if a == s and plan.stages[b].runs_backward]
    return [("F", s, mb)] + succ


def _ref_acyclic(schedule) -> bool:
    """Blocking in-order execution finishes iff rank-order + dependency edges form a DAG (Kahn)."""
    nodes = [(a.kind, a.stage, a.microbatch) for _, a in schedule.all_actions()]
    preds = {n: set(_ref_deps(schedule.plan, *n)) for n in nodes}
    for actions in schedule.actions:
        for prev, cur in zip(actions, actions[1:]):
            preds[(cur.kind, cur.stage, cur.microbatch)].add((prev.kind, prev.stage, prev.microbatch))
    succs = {n: [] for n in nodes}
    for n, ps in preds.items():
        for p in ps:
            succs[p].append(n)
    indeg = {n: len(ps) for n, ps in preds.items()}
    queue = deque(n for n, d in indeg.items() if d == 0)
    seen = 0
    while queue:
        n = queue.popleft()
        seen += 1
        for t in succs[n]:
            indeg[t] -= 1
            if indeg[t] == 0:
                queue.append(t)
    return seen == len(nodes)


def _ref_peaks(schedule):
    peaks = {}
    for stage in schedule.plan.stages:
        frees = "W" if schedule.split_backward and stage.trainable else "B"
        live = peak = 0
        for a in schedule.actions[stage.rank]:
            if a.stage != stage.index or not stage.runs_backward:
                continue
            live += a.kind == "F"
            live -= a.kind == frees
            peak = max(peak, live)
        peaks[stage.index] = peak
    return peaks


# ----- hand-worked orders ------------------------------------------------------------------------
def test_one_f_one_b_chain_orders():
    schedule = one_f_one_b(_chain(3), 4)
    assert schedule.actions[0] == _parse("F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3")
    assert schedule.actions[1] == _parse("F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3")
    assert schedule.actions[2] == _parse("F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3")
    assert in_flight_peaks(schedule) == (3, 2, 1)


def test_gpipe_chain_orders():
    schedule = gpipe(_chain(2), 3)
    assert schedule.actions[0] == _parse("F0.0 F0.1 F0.2 B0.0 B0.1 B0.2")
    assert schedule.actions[1] == _parse("F1.0 F1.1 F1.2 B1.0 B1.1 B1.2")
    assert in_flight_peaks(schedule) == (3, 3)


def test_multimodal_one_f_one_b_warmup():
    # vision: 2 trainable stages; audio: 1 frozen stage (forward only); LLM: 2 trainable stages
    units = synthetic_units({"vision": [True] * 2, "audio": [False] * 2}, [True] * 2)
    plan = plan_pipeline(units, stages_per_module={"vision": 2, "llm": 2})
    schedule = one_f_one_b(plan, 5)
    # vision stage i warms up with S_enc + S_llm - i - 1 = 3, 2; LLM stage j with S_llm - j - 1 = 1, 0
    assert schedule.actions[0] == _parse("F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 B0.2 B0.3 B0.4")
    assert schedule.actions[1] == _parse("F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 B1.3 B1.4")
    assert schedule.actions[2] == _parse("F2.0 F2.1 F2.2 F2.3 F2.4")
    assert schedule.actions[3] == _parse("F3.0 F3.1 B3.0 F3.2 B3.1 F3.3 B3.2 F3.4 B3.3 B3.4")
    assert schedule.actions[4] == _parse("F4.0 B4.0 F4.1 B4.1 F4.2 B4.2 F4.3 B4.3 F4.4 B4.4")


def test_split_backward_frozen_stages_get_no_w():
    # frozen encoder, trainable projector (own stage), frozen LLM: LLM stages need dX but have no dW
    units = synthetic_units({"vision": [False, True]}, [False] * 2)
    plan = plan_pipeline(units, stages_per_module={"vision": 2, "llm": 2})
    schedule = one_f_one_b(plan, 2, split_backward=True)
    assert schedule.actions[0] == _parse("F0.0 F0.1")
    assert schedule.actions[1] == _parse("F1.0 F1.1 B1.0 W1.0 B1.1 W1.1")
    assert schedule.actions[2] == _parse("F2.0 F2.1 B2.0 B2.1")
    assert schedule.actions[3] == _parse("F3.0 B3.0 F3.1 B3.1")


def test_memory_capped_orders_and_peaks():
    schedule = memory_capped_1f1b(_chain(4), 6, cap=2)
    assert schedule.actions[0] == _parse("F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 F0.4 B0.3 F0.5 B0.4 B0.5")
    assert in_flight_peaks(schedule) == (2, 2, 2, 1)
    # a cap on stage 1 also binds the stages after it (deadlock freedom), not stage 0
    per_stage = memory_capped_1f1b(_chain(4), 6, cap={1: 1})
    assert in_flight_peaks(per_stage) == (4, 1, 1, 1)


def test_capped_does_not_cap_forward_only_stages():
    units = synthetic_units({"vision": [False] * 3}, [True] * 2)
    plan = plan_pipeline(units, stages_per_module={"vision": 3, "llm": 2})
    schedule = memory_capped_1f1b(plan, 4, cap=1)
    assert schedule.actions[0] == _parse("F0.0 F0.1 F0.2 F0.3")
    assert schedule.actions[3] == _parse("F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3")


def test_deferred_w_keeps_holding_bound():
    plan = _chain(4)
    schedule = one_f_one_b(plan, 8, split_backward=True, defer_weight_grad=True)
    peaks = _ref_peaks(schedule)
    assert max(peaks.values()) == 4  # the 1F1B peak of stage 0, not more
    # the last stage runs its forwards and input-gradient backwards before the deferred Ws catch up
    last = [f"{a.kind}{a.microbatch}" for a in schedule.actions[3]]
    assert last[:4] == ["F0", "B0", "F1", "B1"]


def test_schedule_json_round_trip_and_format():
    schedule = one_f_one_b(_chain(2), 2, split_backward=True)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert schedule.format().splitlines()[1] == "rank 1: F1.0 B1.0 W1.0 F1.1 B1.1 W1.1"
    assert schedule.stage_actions(0) == schedule.actions[0]


def test_schedule_dag_has_rank_order_and_data_edges():
    schedule = one_f_one_b(_chain(2), 2)
    dag = schedule_dag(schedule)
    assert set(dag[Action("B", 0, 0)]) == {Action("F", 0, 0), Action("B", 1, 0), Action("F", 0, 1)}
    assert dag[Action("F", 0, 0)] == ()


def test_build_schedule_dispatch_and_errors():
    plan = _chain(3)
    assert build_schedule(plan, "1f1b", 4) == one_f_one_b(plan, 4)
    assert build_schedule(plan, "memory_capped_1f1b", 4, cap=1).name == "memory_capped_1f1b"
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule(plan, "interleaved", 4)
    with pytest.raises(ValueError, match="defer_weight_grad needs split_backward"):
        gpipe(plan, 4, defer_weight_grad=True)
    with pytest.raises(ValueError, match="cap for stage 0 must be >= 1"):
        memory_capped_1f1b(plan, 4, cap=0)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        gpipe(plan, 0)
    assert gpipe(plan.replace(num_microbatches=3)).num_microbatches == 3


def test_schedule_constructor_errors():
    plan = _chain(2)
    with pytest.raises(ValueError, match="rank lists"):
        Schedule(plan, ((),), 1)
    with pytest.raises(ValueError, match="belongs to rank 1"):
        Schedule(plan, ((Action("F", 1, 0),), ()), 1)
    with pytest.raises(ValueError, match="out of range"):
        Schedule(plan, ((Action("F", 0, 3),), ()), 2)
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0, 0)


# ----- the checker catches broken schedules ----------------------------------------------------
def _replace_rank(schedule, rank, actions):
    rows = list(schedule.actions)
    rows[rank] = tuple(actions)
    return Schedule(schedule.plan, tuple(rows), schedule.num_microbatches, schedule.split_backward)


def test_checker_missing_duplicate_unexpected():
    good = one_f_one_b(_chain(2), 2)
    with pytest.raises(ValueError, match=r"rank 1: missing action B\(stage=1, mb=1\)"):
        check_schedule(_replace_rank(good, 1, good.actions[1][:-1]))
    with pytest.raises(ValueError, match=r"rank 0: duplicate action F\(stage=0, mb=0\)"):
        check_schedule(_replace_rank(good, 0, good.actions[0] + (Action("F", 0, 0),)))
    with pytest.raises(ValueError, match="unexpected action W.*does not split"):
        check_schedule(_replace_rank(good, 0, good.actions[0] + (Action("W", 0, 0),)))
    units = synthetic_units({"vision": [False]}, [False, True])
    plan = plan_pipeline(units, stages_per_module={"llm": 2})
    frozen = one_f_one_b(plan, 1, split_backward=True)
    with pytest.raises(ValueError, match="unexpected action B.*forward-only"):
        check_schedule(_replace_rank(frozen, 0, frozen.actions[0] + (Action("B", 0, 0),)))
    with pytest.raises(ValueError, match="unexpected action W.*no trainable unit"):
        check_schedule(_replace_rank(frozen, 1, frozen.actions[1] + (Action("W", 1, 0),)))


def test_checker_same_rank_order():
    good = one_f_one_b(_chain(2), 2)
    broken = _replace_rank(good, 1, _parse("B1.0 F1.0 F1.1 B1.1"))
    with pytest.raises(ValueError, match=r"rank 1: B\(stage=1, mb=0\) at position 0 needs F\(stage=1, mb=0\)"):
        check_schedule(broken)


def test_checker_deadlock_names_cycle():
    good = one_f_one_b(_chain(2), 2)
    # rank 0 waits for B(1,0) before sending F(0,1); rank 1 waits for F(0,1) before running B(1,0)
    broken = _replace_rank(_replace_rank(good, 0, _parse("F0.0 B0.0 F0.1 B0.1")), 1, _parse("F1.0 F1.1 B1.0 B1.1"))
    assert not _ref_acyclic(broken)
    with pytest.raises(ValueError, match="deadlock") as info:
        check_schedule(broken)
    message = str(info.value)
    assert r"rank 0 waits at B(stage=0, mb=0) for B(stage=1, mb=0) on rank 1" in message
    assert r"rank 1 waits at F(stage=1, mb=1) for F(stage=0, mb=1) on rank 0" in message


def test_checker_deadlock_through_encoder_branch():
    # two branches feed LLM stage 2; branch 1 sends microbatch 1 first but only after getting B(2,0)
    units = synthetic_units({"vision": [True], "audio": [True]}, [True])
    plan = plan_pipeline(units)
    good = one_f_one_b(plan, 2)
    broken = _replace_rank(good, 1, _parse("F1.0 B1.0 F1.1 B1.1"))
    broken = _replace_rank(broken, 2, _parse("F2.0 F2.1 B2.0 B2.1"))
    assert not _ref_acyclic(broken)
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(broken)


# ----- property tests over random plans ----------------------------------------------------------
@st.composite
def random_plans(draw, shared_ranks: bool = False):
    plan, layout, stages, s_llm = draw_plan(draw, slack=2, shared_ranks=shared_ranks)
    depths = []  # S_enc + S_llm - i for encoder stage i of a branch, S_llm - j for LLM stage j
    if layout == "encoder_parallel":
        for s in stages:
            depths += [s + s_llm - i for i in range(s)]
    else:
        depths += [stages[0] + s_llm - i for i in range(stages[0])]
    depths += [s_llm - j for j in range(s_llm)]
    return plan, depths


def _assert_valid(schedule):
    plan = schedule.plan
    got = Counter((a.kind, a.stage, a.microbatch) for _, a in schedule.all_actions())
    assert got == _ref_expected(plan, schedule.num_microbatches, schedule.split_backward)
    assert _ref_acyclic(schedule)
    for rank, action in schedule.all_actions():
        assert plan.stages[action.stage].rank == rank
    check_schedule(schedule)


@settings(max_examples=70, deadline=None)
@given(
    random_plans(),
    st.integers(1, 12),
    st.sampled_from(["gpipe", "1f1b", "capped"]),
    st.sampled_from([(False, False), (True, False), (True, True)]),
    st.integers(1, 4),
)
def test_generators_on_random_plans(case, m, kind, split_defer, cap):
    plan, depths = case
    split, defer = split_defer
    schedule = generate(kind, plan, m, split, defer, cap)
    _assert_valid(schedule)
    peaks = _ref_peaks(schedule)
    assert peaks == dict(enumerate(in_flight_peaks(schedule)))
    backward = [s.index for s in plan.stages if s.runs_backward]
    limit = {"gpipe": [m] * len(depths), "1f1b": [min(d, m) for d in depths]}.get(kind)
    if kind == "capped":
        limit = [min(d, m, cap) for d in depths]
    for s in backward:
        bound = limit[s]
        if defer:  # W held back: up to the deepest stage's limit, or up to the cap
            bound = min(cap, m) if kind == "capped" else max(limit[t] for t in backward)
        assert peaks[s] <= bound
        if not defer:
            assert peaks[s] == limit[s]
            first_b = next(i for i, a in enumerate(schedule.stage_actions(s)) if a.kind == "B")
            assert first_b == limit[s]  # warm-up forwards + the first steady forward
    for s in set(range(plan.num_stages)) - set(backward):
        assert {a.kind for a in schedule.stage_actions(s)} == {"F"}


@settings(max_examples=40, deadline=None)
@given(
    random_plans(shared_ranks=True),
    st.integers(1, 8),
    st.sampled_from(["gpipe", "1f1b", "capped"]),
    st.sampled_from([(False, False), (True, False), (True, True)]),
)
def test_generators_with_shared_ranks(case, m, kind, split_defer):
    plan, depths = case
    schedule = generate(kind, plan, m, *split_defer, cap=2)
    _assert_valid(schedule)
    if kind == "capped":
        assert all(p <= 2 for p in in_flight_peaks(schedule))


@settings(max_examples=60, deadline=None)
@given(random_plans(shared_ranks=True), st.integers(1, 10), st.sampled_from(["zb_h1", "zb_h2"]))
def test_zero_bubble_schedules_on_random_plans(case, m, name):
    """Complete, deadlock-free, split backward (no W on a frozen stage, no B on a forward-only one), and a stage
    holds at most the deepest warm-up's microbatches: 1F1B's (H1) or up to ``2 d - 1`` (H2)."""
    plan, depths = case
    schedule = build_schedule(plan, name, m)
    _assert_valid(schedule)
    assert schedule.split_backward and schedule.name == name
    warm = [min(d, m) if name == "zb_h1" else min(2 * d - 1, m) for d in depths]
    backward = [s.index for s in plan.stages if s.runs_backward]
    peaks = in_flight_peaks(schedule)
    for s in backward:
        assert peaks[s] <= max(warm[t] for t in backward)


def test_zero_bubble_h1_is_1f1b_with_w_deferred():
    plan = _chain(4)
    assert zb_h1(plan, 8).actions == one_f_one_b(plan, 8, split_backward=True, defer_weight_grad=True).actions


# ----- interleaved 1F1B ----------------------------------------------------------------------------
def _interleaved_chain(p, v, trainable=True, encoder=None):
    """An LLM of ``v * p`` one-unit stages cyclic over ``p`` ranks; ``encoder``: None, ``"alone"`` (own rank
    0) or ``"attached"`` (on the first LLM stage's rank), a frozen encoder with a trainable projector."""
    enc = {} if encoder is None else {"vision": [False, True]}
    units = synthetic_units(enc, [trainable] * (v * p))
    counts = {"llm": v * p} | ({"vision": 1} if encoder else {})
    llm = [j % p for j in range(v * p)]
    ranks = {None: llm, "alone": [0] + [r + 1 for r in llm], "attached": [0] + llm}[encoder]
    return plan_pipeline(units, stages_per_module=counts, ranks=ranks)


def test_interleaved_orders_by_hand():
    # p = 2, v = 2, M = 4: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. Forward order per rank: chunk
    # 0 of microbatches 0-1, chunk 1 of 0-1, chunk 0 of 2-3, chunk 1 of 2-3; backwards the same with chunks
    # reversed; warm-up 2 (p - i - 1) + (v - 1) p = 4 on rank 0 and 2 on rank 1, then one F one B, then drain.
    schedule = build_schedule(_interleaved_chain(2, 2), "interleaved_1f1b", 4)
    assert schedule.actions[0] == _parse("F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 "
                                         "B2.2 B2.3 B0.2 B0.3")
    assert schedule.actions[1] == _parse("F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 "
                                         "F3.3 B3.3 B1.2 B1.3")
    assert schedule.name == "interleaved_1f1b" and _ref_acyclic(schedule)


@pytest.mark.parametrize("p,v,k", [(2, 2, 1), (2, 3, 2), (3, 2, 2), (4, 2, 1), (4, 4, 3)])
def test_interleaved_bubble_is_one_over_v(p, v, k):
    # Megatron-LM (SC'21, 2.2.2): with M a multiple of p, per-chunk forward f and backward b and free
    # transfers, the iteration takes M v (f + b) + (p - 1)(f + b): the 1F1B bubble divided by v.
    from plait.planner.pipeline.simulator import simulate

    m, f, b = k * p, 1.0, 2.0
    schedule = build_schedule(_interleaved_chain(p, v), "interleaved_1f1b", m)
    costs = {(s, kind): c for s in range(v * p) for kind, c in (("F", f), ("B", b))}
    assert simulate(schedule, costs).makespan_s == pytest.approx(m * v * (f + b) + (p - 1) * (f + b))
    whole = plan_pipeline(synthetic_units({}, [True] * p), stages_per_module={"llm": p})
    one = simulate(one_f_one_b(whole, m), {(s, kind): v * c for s in range(p) for kind, c in (("F", f), ("B", b))})
    assert one.makespan_s == pytest.approx(m * v * (f + b) + (p - 1) * v * (f + b))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 4), st.integers(1, 3), st.integers(1, 10), st.sampled_from([None, "alone", "attached"]),
       st.booleans(), st.booleans(), st.integers(0, 3))
def test_interleaved_on_random_plans(p, v, m, encoder, trainable, split, extra_group):
    plan = _interleaved_chain(p, v, trainable, encoder)
    schedule = build_schedule(plan, "interleaved_1f1b", m, split_backward=split, group_size=p + extra_group)
    _assert_valid(schedule)
    assert plan.virtual_stages == v
    for stage in plan.stages:  # a stage's own actions: microbatches in order, each B after its F
        acts = schedule.stage_actions(stage.index)
        for kind in "FBW":
            assert [a.microbatch for a in acts if a.kind == kind] == sorted(a.microbatch for a in acts if a.kind == kind)


@st.composite
def interleaved_plans(draw):
    """Random encoder branches (each stage on its own rank, or the first branch's single stage on the first
    LLM stage's rank) and an LLM of ``v p`` stages cyclic over ``p`` ranks; random frozen flags."""
    from plait.planner.pipeline.plan import interleaved_ranks

    layout, encoders, counts, enc_stages = draw_encoders(draw)
    p, v = draw(st.integers(2, 3)), draw(st.integers(1, 3))
    llm = draw(st.lists(st.booleans(), min_size=v * p, max_size=v * p + 2))
    counts |= {"llm": v * p}
    ranks = list(interleaved_ranks(range(enc_stages), p, v))
    if enc_stages == 1 and draw(st.booleans()):  # attach the single encoder stage to the first LLM rank
        ranks = [0] + [r - 1 for r in ranks[1:]]
    return plan_pipeline(synthetic_units(encoders, llm), layout, stages_per_module=counts, ranks=ranks)


@settings(max_examples=40, deadline=None)
@given(interleaved_plans(), st.integers(1, 9), st.booleans())
def test_interleaved_on_random_multimodal_plans(plan, m, split):
    schedule = build_schedule(plan, "interleaved_1f1b", m, split_backward=split)
    _assert_valid(schedule)
    assert dict(enumerate(in_flight_peaks(schedule))) == _ref_peaks(schedule)


@pytest.mark.parametrize("p,m", [(1, 3), (3, 2), (4, 7)])
def test_interleaved_with_one_chunk_is_one_f_one_b(p, m):
    plan = _interleaved_chain(p, 1)
    assert build_schedule(plan, "interleaved_1f1b", m).actions == one_f_one_b(plan, m).actions


def test_interleaved_errors():
    plan = _interleaved_chain(2, 2)
    with pytest.raises(ValueError, match="group_size"):
        build_schedule(plan, "interleaved_1f1b", 4, group_size=1)
    units = synthetic_units({}, [True] * 4)
    ragged = plan_pipeline(units, stages_per_module={"llm": 4}, ranks=[0, 1, 1, 0])
    with pytest.raises(ValueError, match="mod p"):
        build_schedule(ragged, "interleaved_1f1b", 4)
    enc = synthetic_units({"vision": [True]}, [True] * 4)
    shared = plan_pipeline(enc, stages_per_module={"vision": 1, "llm": 4}, ranks=[1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match="shares LLM rank"):
        build_schedule(shared, "interleaved_1f1b", 4)
