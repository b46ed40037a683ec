"""Pipeline templates, their instantiation and microbatch distribution (Oobleck's plans), without processes."""

from __future__ import annotations

import itertools

import pytest

from plait.planner.cost.types import ActionOverheads
from plait.planner.pipeline.types import P2PModel
from plait.planner.resilience.reconfigure import plan_reconfiguration
from plait.planner.resilience.shards import failed_groups, group_workers, partners_left, shard_rows, worker_transfers
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.resilience.templates import (distribute_microbatches, instantiate, plan_instantiation,
                                               plan_templates, units_on_few_domains)
from plait.planner.resilience.types import PipelineTemplate, TemplateSet, format_seconds
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.templates import CAP, PARAM, model, templates


def test_templates_cover_n0_to_n_minus_f_n0_and_fit_their_simulated_times():
    units, costs = model()
    ts = templates(8, 1)
    n0 = ts.min_ranks
    with pytest.raises(ValueError):
        plan_layout(units, costs, n0 - 1, microbatches=12, machine=Machine(memory_cap=CAP),
                    space=SearchSpace(dp_degrees=[1]))
    assert n0 >= 2
    assert [t.num_ranks for t in ts.templates] == list(range(n0, 8 - n0 + 1))
    for t in ts.templates:
        choice = plan_layout(units, costs, t.num_ranks, microbatches=12, machine=Machine(memory_cap=CAP),
                             space=SearchSpace(dp_degrees=[1]))
        assert t.plan.stages == choice.plan.stages and t.plan.num_ranks <= t.num_ranks
        for nb in (12, 24):
            real = evaluate_plan(t.plan, units, costs, dp=1, microbatches=nb, schedule=t.schedule).makespan_s
            assert t.makespan_s(nb) == pytest.approx(real, rel=1e-9)
    # copy bytes: parameters; AdamW state 12 B per trained bf16 parameter (6x the parameter bytes)
    by_name = ts.unit_bytes()
    assert by_name["llm.3"].param_bytes == PARAM and by_name["llm.3"].state_bytes == 6 * PARAM
    assert by_name["vision.0"].state_bytes == 0 and by_name["vision.3"].state_bytes == 6 * PARAM
    assert TemplateSet.from_json(ts.to_json()) == ts


def test_too_few_ranks_for_f_plus_one_pipelines_is_refused():
    with pytest.raises(ValueError, match=r"cannot hold failures \+ 1 = 4 pipelines of at least n0 = "):
        templates(8, 3)


def _template(fixed: float, per: float) -> PipelineTemplate:
    small = templates(8, 1).templates[0]
    return PipelineTemplate(small.num_ranks, small.plan, "1f1b", fixed, per, (0.0,) * small.plan.num_ranks)


def test_water_filling_balances_heterogeneous_pipelines_exactly():
    fast, slow = _template(0.5, 1.0), _template(0.2, 2.0)
    assert distribute_microbatches([fast, slow], 6) == (4, 2)  # 4.5 s and 4.2 s
    for m in range(0, 13):
        counts = distribute_microbatches([fast, slow, fast], m)
        assert sum(counts) == m
        best = min(max(t.makespan_s(c) for t, c in zip((fast, slow, fast), split))
                   for split in itertools.product(range(m + 1), repeat=3) if sum(split) == m)
        assert max(t.makespan_s(c) for t, c in zip((fast, slow, fast), counts)) == pytest.approx(best)


def _partitions(total: int, low: int, high: int, top: int | None = None):
    top = high if top is None else top
    if total == 0:
        yield ()
        return
    for size in range(min(top, total), low - 1, -1):
        for rest in _partitions(total - size, low, high, size):
            yield (size,) + rest


@pytest.mark.parametrize("num_ranks,failures", [(8, 1), (9, 1), (10, 2), (11, 1)])
def test_instantiation_uses_every_rank_with_f_plus_one_pipelines_and_is_the_best(num_ranks, failures):
    ts = templates(num_ranks, failures)
    inst = plan_instantiation(ts)
    assert inst.ranks == tuple(range(num_ranks))
    assert len(inst.pipelines) >= failures + 1 and inst.microbatches == 12
    for pipeline in inst.pipelines:
        assert pipeline.template == ts.template(len(pipeline.ranks))
    # exhaustive over every multiset of template sizes with enough pipelines
    best = min(instantiate(ts, [list(range(sum(p[:i]), sum(p[:i + 1]))) for i in range(len(p))]).iteration_s
               for p in _partitions(num_ranks, ts.min_ranks, ts.max_ranks) if failures + 1 <= len(p) <= 12)
    assert inst.iteration_s == pytest.approx(best)
    # every unit has one holder per pipeline
    for unit in ts.units:
        holders = inst.holders(unit.name)
        assert len(set(holders)) == len(inst.pipelines)
        assert all(unit.name in inst.units_of(h) for h in holders)


def test_instantiation_refuses_too_many_pipelines():
    ts = templates(8, 1)
    with pytest.raises(ValueError, match="cannot hold 5 pipelines"):
        plan_instantiation(ts, min_pipelines=5)


def test_a_group_no_template_split_covers_runs_the_largest_template_with_spares():
    ts = templates(10, 2)  # templates of 3 and 4 ranks: 5 ranks cannot be split into them
    assert (ts.min_ranks, ts.max_ranks) == (3, 4)
    inst = plan_instantiation(ts, ranks=range(5), min_pipelines=1)
    (pipeline,) = inst.pipelines
    assert pipeline.ranks == (0, 1, 2, 3, 4) and pipeline.template == ts.template(4)
    assert pipeline.units_of(4) == () and pipeline.microbatches == 12
    assert plan_instantiation(ts, ranks=range(6), min_pipelines=1).iteration_s < inst.iteration_s


def test_format_seconds_keeps_four_digits_in_a_fitting_unit():
    assert format_seconds(1.23456) == "1.235 s"
    assert format_seconds(0.0123456) == "12.35 ms"
    assert format_seconds(4.56e-5) == "45.6 us"
    assert format_seconds(0.0) == "0 us"


def test_templates_are_timed_with_the_runtime_overheads_they_are_searched_with():
    units, costs = model()
    overheads = ActionOverheads(0.002, 0.005, 0.005)
    ts = templates(8, 1, overheads=overheads)
    for t in ts.templates:
        for nb in (12, 24):
            real = evaluate_plan(t.plan, units, costs, dp=1, microbatches=nb, schedule=t.schedule,
                                 machine=Machine(overheads=overheads)).makespan_s
            assert t.makespan_s(nb) == pytest.approx(real, rel=1e-9)
    plain = {t.num_ranks: t for t in templates(8, 1).templates}
    for t in ts.templates:  # at least the 5 ms forward and backward chunk overheads of each microbatch
        assert t.per_microbatch_s >= plain[t.num_ranks].per_microbatch_s + 0.01 - 1e-12


def test_spares_name_pipelines_with_ranks_left_without_a_stage():
    ts = templates(8, 1)
    largest = ts.max_ranks
    n0 = ts.min_ranks
    assert ts.template(n0).plan.num_ranks == n0  # the memory minimum needs every one of its ranks
    assert instantiate(ts, [list(range(0, n0)), list(range(n0, 2 * n0))]).spares() == []
    wide = instantiate(ts, [list(range(0, largest + 1)), list(range(largest + 1, largest + 1 + ts.min_ranks))])
    used = ts.template(largest).plan.num_ranks
    assert wide.spares()[0] == (largest + 1, used) and used <= largest


@pytest.mark.parametrize("num_ranks,failures,per_node", [(8, 1, 4), (8, 1, 2), (9, 1, 3), (10, 2, 2), (11, 1, 3)])
def test_with_nodes_as_failure_domains_every_unit_lies_on_f_plus_one_nodes(num_ranks, failures, per_node):
    ts = templates(num_ranks, failures)
    domains = {r: r // per_node for r in range(num_ranks)}
    inst = plan_instantiation(ts, domains=domains)
    assert inst.ranks == tuple(range(num_ranks))
    for unit in ts.units:  # f whole nodes lost at once leave a copy of every unit
        for lost in itertools.combinations(sorted(set(domains.values())), failures):
            assert any(domains[h] not in lost for h in inst.holders(unit.name)), (unit.name, lost)
    # the fastest instantiation that spreads the units: exhaustive over the sizes and their orders on node-major
    # ranks (the search's own placement)
    best = min((inst_.iteration_s for p in _partitions(num_ranks, ts.min_ranks, ts.max_ranks)
                if failures + 1 <= len(p) <= 12 for order in set(itertools.permutations(p))
                for inst_ in [instantiate(ts, [list(range(sum(order[:i]), sum(order[:i + 1])))
                                                for i in range(len(order))])]
                if not units_on_few_domains(inst_, domains, failures + 1)))
    assert inst.iteration_s == pytest.approx(best)


def test_units_on_few_domains_names_the_units_a_node_loss_would_take():
    ts = templates(8, 1)
    striped = instantiate(ts, [[0, 2, 4, 6], [1, 3, 5, 7]])
    # nodes of 2: ranks 0-1 on node 0, 2-3 on node 1, ...: each pipeline's i-th rank shares a node with the other's
    domains = {r: r // 2 for r in range(8)}
    few = units_on_few_domains(striped, domains, 2)
    assert few and set(few) == {u for r in striped.pipelines[0].ranks for u in striped.pipelines[0].units_of(r)}
    assert units_on_few_domains(striped, {r: r % 2 for r in range(8)}, 2) == ()  # nodes by parity: spread
    assert units_on_few_domains(striped, domains, 1) == ()


def test_no_spread_possible_is_refused_naming_the_domains():
    ts = templates(8, 1)
    with pytest.raises(ValueError, match=r"failure domains \(f = 1 counts domains; ranks per domain \{0: 8\}\)"):
        plan_instantiation(ts, domains={r: 0 for r in range(8)})


def test_sharded_templates_plan_shard_groups_that_fit_on_fewer_ranks():
    # FSDP2 inside the pipelines: 16 workers as 8 shard groups of 2, 12 microbatches as 6 per shard row; each rank
    # holds a half of the AdamW state, so a pipeline fits on 2 groups where 3 ranks are needed unsharded
    units, costs = model()
    machine = Machine(memory_cap=CAP, dp_link=P2PModel(1e-5, 1e10))
    sharded = plan_templates(units, costs, 16, 1, microbatches=12, machine=machine, dp_shard=2)
    whole = plan_templates(units, costs, 8, 1, microbatches=6, machine=machine)
    assert (sharded.num_ranks, sharded.workers, sharded.microbatches, sharded.dp_shard) == (8, 16, 6, 2)
    assert sharded.min_ranks == 2 < whole.min_ranks == 3
    assert TemplateSet.from_json(sharded.to_json()) == sharded
    assert TemplateSet.from_dict({k: v for k, v in whole.to_dict().items() if k != "dp_shard"}).dp_shard == 1
    for workers, mbs in ((15, 12), (16, 13)):
        with pytest.raises(ValueError, match=r"dp_shard 2 must be a positive integer dividing the"):
            plan_templates(units, costs, workers, 1, microbatches=mbs, machine=machine, dp_shard=2)


def test_shard_groups_map_the_plans_to_workers():
    units, costs = model()
    ts = plan_templates(units, costs, 12, 1, microbatches=12, machine=Machine(memory_cap=CAP), dp_shard=2)
    inst = instantiate(ts, [[0, 1, 2], [3, 4, 5]])  # groups; group g = workers 2g, 2g + 1
    assert group_workers(2, 2) == (4, 5)
    assert shard_rows(inst, 2) == ((0, 2, 4), (1, 3, 5), (6, 8, 10), (7, 9, 11))
    alive = [w for w in range(12) if w not in (3, 10)]  # group 1 (pipeline 0) and group 5 (pipeline 1) fail
    assert failed_groups(inst, alive, 2) == (1, 5)
    assert partners_left(inst, alive, 2) == (2, 11)
    rec = plan_reconfiguration(ts, inst, failed_groups(inst, alive, 2))
    moved = worker_transfers(rec.transfers, 2)
    assert len(moved) == 2 * len(rec.transfers)
    for t, (a, b) in zip(rec.transfers, zip(moved[::2], moved[1::2])):
        assert (a.unit, a.src, a.dst, b.src, b.dst) == (t.unit, 2 * t.src, 2 * t.dst, 2 * t.src + 1, 2 * t.dst + 1)
        assert a.param_bytes == t.param_bytes // 2 and a.state_bytes == t.state_bytes // 2
    # for people: the ranks are shard groups, and a pipeline runs dp_shard rows of its rows' microbatches
    mbs = [p.microbatches for p in inst.pipelines]
    assert inst.describe(2).startswith(f"2 pipelines: 3 shard groups ({inst.pipelines[0].template.plan.num_stages} "
                                       f"stages) x {2 * mbs[0]} mb ({mbs[0]} per shard row of 2 workers), ")
    assert inst.describe().startswith("2 pipelines: 3 ranks (") and f"x {mbs[0]} mb, " in inst.describe()
    summary = rec.summary(2)
    assert summary.startswith("shard groups [1, 5] failed; ") and "pipelines now " in summary
    assert " ranks" not in summary and "shrinks 3 -> 2 shard groups" in summary
