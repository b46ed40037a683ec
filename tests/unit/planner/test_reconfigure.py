"""Reconfiguration after failures (shrink, borrow, merge; copies from surviving replicas), without processes:
every failure set of size <= f leaves a valid plan, and losing every copy of a unit is refused by name."""

from __future__ import annotations

import itertools

import pytest

from plait.planner.resilience.reconfigure import check_instantiation, plan_reconfiguration, plan_rejoin
from plait.planner.resilience.types import LostUnitsError, Reconfiguration
from plait.planner.resilience.templates import instantiate, plan_instantiation
from tests.helpers.templates import templates


def _check(ts, before, failed, rec: Reconfiguration) -> None:
    """The new plan is valid over the survivors and its transfers bring exactly the missing units."""
    check_instantiation(ts, rec.after)
    survivors = tuple(sorted(set(before.ranks) - set(failed)))
    assert rec.after.ranks == survivors
    for rank in survivors:
        missing = set(rec.after.units_of(rank)) - set(before.units_of(rank))
        got = rec.received_by(rank)
        assert {t.unit for t in got} == missing and len(got) == len(missing)
        for t in got:
            assert t.src not in failed and t.unit in before.units_of(t.src)
            size = ts.unit_bytes()[t.unit]
            assert (t.param_bytes, t.state_bytes) == (size.param_bytes, size.state_bytes)
    assert rec.bytes == sum(t.bytes for t in rec.transfers)


@pytest.mark.parametrize("num_ranks,failures", [(8, 1), (10, 2), (11, 1), (12, 2)])
def test_every_failure_set_up_to_f_leaves_a_valid_plan(num_ranks, failures):
    ts = templates(num_ranks, failures)
    before = plan_instantiation(ts)
    count = 0
    for k in range(1, failures + 1):
        for failed in itertools.combinations(range(num_ranks), k):
            rec = plan_reconfiguration(ts, before, failed)
            _check(ts, before, failed, rec)
            count += 1
    assert count == sum(len(list(itertools.combinations(range(num_ranks), k))) for k in range(1, failures + 1))


def test_shrink_borrow_and_merge():
    ts = templates(11, 1)  # n0 = 3, templates 3..8
    assert ts.min_ranks == 3
    before = instantiate(ts, [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10]])
    shrink = plan_reconfiguration(ts, before, [1])
    assert [p.ranks for p in shrink.after.pipelines] == [(0, 2, 3, 4), (5, 6, 7), (8, 9, 10)]
    assert shrink.actions == ("pipeline 0 shrinks 5 -> 4 ranks",)
    # rank 2 now runs plan rank 1 of the 4-rank template: it receives the units it lacks from a replica
    assert {t.unit for t in shrink.received_by(2)} == set(shrink.after.units_of(2)) - set(before.units_of(2))
    borrow = plan_reconfiguration(ts, before, [6])
    assert [p.ranks for p in borrow.after.pipelines] == [(0, 1, 2, 3), (5, 7, 4), (8, 9, 10)]
    assert any("borrows ranks [4]" in a for a in borrow.actions)
    twice = plan_reconfiguration(ts, before, [5, 9])  # two 2-rank pipelines each borrow from the 5-rank one
    assert [p.ranks for p in twice.after.pipelines] == [(0, 1, 2), (6, 7, 4), (8, 10, 3)]
    assert sum("borrows" in a for a in twice.actions) == 2
    three = instantiate(ts, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    merged = plan_reconfiguration(ts, three, [1, 4])
    assert [p.ranks for p in merged.after.pipelines] == [(0, 2, 3, 5), (6, 7, 8)]
    assert merged.actions[-1] == "pipelines of 2 and 2 ranks merge"
    assert "ranks [1, 4] failed" in merged.summary() and "pipelines now 4+3 ranks" in merged.summary()
    assert Reconfiguration.from_json(merged.to_json()) == merged


def test_losing_every_copy_of_a_unit_is_refused_naming_the_units():
    ts = templates(8, 1)
    before = plan_instantiation(ts)
    first, second = before.pipelines[0], before.pipelines[1]
    unit = first.units_of(first.ranks[0])[0]
    failed = [first.ranks[0], second.holder(unit)]
    with pytest.raises(LostUnitsError, match=rf"held every copy of \d+ unit\(s\): .*{unit}.*resume from the last "
                                             "checkpoint") as info:
        plan_reconfiguration(ts, before, failed)
    lost = set(info.value.units)
    assert unit in lost and lost == {u.name for u in ts.units
                                     if all(h in failed for h in before.holders(u.name))}


def test_more_than_f_failures_that_keep_a_copy_are_survived_in_sequence():
    ts = templates(12, 1)
    plan = plan_instantiation(ts)
    alive = list(plan.ranks)
    for victim in (0, 11, 5, 7):  # one at a time, each leaving a copy of every unit
        rec = plan_reconfiguration(ts, plan, [victim])
        _check(ts, plan, [victim], rec)
        plan = rec.after
        alive.remove(victim)
        assert plan.ranks == tuple(alive)


def test_unknown_failed_rank_and_too_few_survivors():
    ts = templates(8, 1)
    before = plan_instantiation(ts)
    with pytest.raises(ValueError, match=r"failed ranks \[9\] are not in the instantiation"):
        plan_reconfiguration(ts, before, [9])
    small = instantiate(ts, [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError):
        plan_reconfiguration(ts, small, [0, 3, 1, 4])


def test_a_joining_rank_receives_every_unit_it_now_holds():
    ts = templates(8, 1)
    before = plan_reconfiguration(ts, plan_instantiation(ts), [7]).after
    rec = plan_rejoin(ts, before, [7])
    check_instantiation(ts, rec.after)
    assert rec.after.ranks == tuple(range(8)) and rec.failed == ()
    assert {t.unit for t in rec.received_by(7)} == set(rec.after.units_of(7)) and rec.received_by(7)
    for rank in before.ranks:
        missing = set(rec.after.units_of(rank)) - set(before.units_of(rank))
        assert {t.unit for t in rec.received_by(rank)} == missing
    assert all(t.src in before.ranks and t.unit in before.units_of(t.src) for t in rec.transfers)
    with pytest.raises(ValueError, match=r"ranks \[3\] are already in the instantiation"):
        plan_rejoin(ts, before, [3])
