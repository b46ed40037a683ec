"""plan_parallel is complete (TP, FSDP2 and checkpointing weighed whether or not the plain plan fits) and monotone in
the device count (a plan for N devices is never slower than the plan for a divisor of N), and the plan it returns is
timed as evaluate_plan times it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.planner.cost.sharding import (pipelined_optimizer, pipelined_overheads, pipelined_shard_costs,
                                         shard_costs)
from plait.planner.cost.types import ParallelDegrees
from plait.planner.pipeline.plan import synthetic_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.monotone import chain_s, divisors, plan_over_divisors, work_bound
from plait.planner.search.parallel import plan_parallel
from plait.planner.search.types import LayoutChoice, Machine, NoPlanFits, SearchSpace
from plait.planner.types import UnitCost

LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=5e9)
SPACE = SearchSpace(fsdp_reshard=("after_forward",), encoder_dp=(("e0", 4),))  # encoder replicas searched too


@st.composite
def models(draw):
    """A small random MLLM (0-1 encoder of 1-3 units, an LLM of 2-5 units, frozen or trainable at random), its
    costs, a microbatch count and a memory cap (None or a share of the whole model's static bytes)."""
    encoders = {"e0": draw(st.lists(st.booleans(), min_size=1, max_size=3))} if draw(st.booleans()) else {}
    llm = draw(st.lists(st.booleans(), min_size=2, max_size=5))
    units = synthetic_units(encoders, llm)
    costs = [UnitCost(forward_s=draw(st.floats(0.01, 1.0)), input_grad_s=draw(st.floats(0.01, 1.0)),
                      weight_grad_s=draw(st.floats(0.01, 1.0)), param_bytes=draw(st.integers(1_000, 4_000_000)),
                      activation_bytes=draw(st.integers(1_000, 4_000_000)),
                      output_bytes=draw(st.integers(1_000, 400_000))) for _ in units]
    microbatches = draw(st.integers(1, 8))
    share = draw(st.sampled_from([None, 4.0, 1.0, 0.5]))
    static = sum(16 * c.param_bytes + c.activation_bytes for c in costs)
    return units, costs, microbatches, None if share is None else share * static


def _retimed(choice: LayoutChoice, units, costs, machine: Machine, microbatches: int) -> list[float]:
    """The times evaluate_plan gives the choice's plan under its degrees' per-rank costs (both FSDP2 runtimes for
    a one-rank plan with a shard degree: the search may reach it either way)."""
    degrees = ParallelDegrees(choice.tp, choice.dp_shard, choice.checkpointing, choice.fsdp_reshard)
    common = dict(dp=choice.dp, microbatches=microbatches, devices=choice.devices // choice.tp,
                  schedule=choice.schedule)
    links = dict(tp_link=machine.tp_link or machine.p2p)
    unsharded = dataclasses.replace(degrees, dp_shard=1)
    staged = evaluate_plan(choice.plan, units, pipelined_shard_costs(units, costs, unsharded, **links),
                           machine=dataclasses.replace(
                               machine, overheads=pipelined_overheads(machine.overheads, choice.dp_shard),
                               optimizer=pipelined_optimizer(machine.optimizer, choice.dp_shard)), **common)
    times = [staged.iteration_s]
    if choice.dp_shard > 1 and choice.plan.num_ranks == 1:
        flat = evaluate_plan(choice.plan, units, shard_costs(units, costs, degrees, shard_link=machine.dp_link,
                                                             **links),
                             machine=dataclasses.replace(machine, dp_shard=choice.dp_shard), **common)
        extra = (choice.microbatches_per_replica - 1) * flat.grad_sync_s if choice.fsdp_reduce == "microbatch" else 0
        times.append(flat.iteration_s + extra)
    return times


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.sampled_from([2, 4, 6, 8]))
def test_time_never_grows_with_the_devices_and_evaluate_plan_reproduces_it(model, devices):
    units, costs, microbatches, cap = model
    machine = Machine(memory_cap=cap, p2p=LINK, dp_link=LINK)
    found: dict[int, LayoutChoice | None] = {}
    for d in divisors(devices):
        try:
            found[d] = plan_parallel(units, costs, d, microbatches=microbatches, machine=machine, space=SPACE)
        except NoPlanFits:
            found[d] = None
    top = found[devices]
    for d, choice in found.items():
        if choice is None:
            continue
        assert top is not None, f"a plan fits on {d} devices but none on {devices}"
        assert top.iteration_s <= choice.iteration_s * (1 + 1e-9), (devices, d, top.iteration_s, choice.iteration_s)
        assert choice.fits_memory and choice.devices == d and choice.devices_used <= d
        if choice.offload == "cpu":  # its host side is offload.offload_cost's (test_offload.py)
            continue
        times = _retimed(choice, units, costs, machine, microbatches)
        assert any(t == pytest.approx(choice.iteration_s, rel=1e-9) for t in times), (times, choice.iteration_s)
        if (choice.tp, choice.dp_shard, choice.checkpointing) == (1, 1, "none"):  # the given costs themselves
            again = evaluate_plan(choice.plan, units, costs, dp=choice.dp, microbatches=microbatches, devices=d,
                                  machine=machine, schedule=choice.schedule)
            assert again.iteration_s == pytest.approx(choice.iteration_s, rel=1e-9)
            assert again.fits_memory


def _one_big_layer():
    """An LLM of an embedding, one heavy layer and a head, all trainable: with one microbatch a pipeline cannot
    overlap anything, while TP splits the layer."""
    units = synthetic_units({}, [True, True, True])
    small = UnitCost(0.01, 0.01, 0.01, param_bytes=1_000, activation_bytes=1_000, output_bytes=1_000)
    layer = UnitCost(1.0, 1.0, 1.0, param_bytes=1_000_000, activation_bytes=1_000_000, output_bytes=1_000)
    return units, [small, layer, small]


def test_faster_tp_plan_chosen_although_the_plain_plan_fits():
    units, costs = _one_big_layer()
    machine = Machine(memory_cap=1e12, p2p=LINK, dp_link=LINK)
    plain = plan_layout(units, costs, 2, microbatches=1, machine=machine)
    assert plain.fits_memory
    old = plan_parallel(units, costs, 2, microbatches=1, machine=machine, space=SearchSpace(prefer_plain=True))
    assert (old.tp, old.iteration_s) == (1, plain.iteration_s)
    chosen = plan_parallel(units, costs, 2, microbatches=1, machine=machine)
    only_tp = plan_parallel(units, costs, 2, microbatches=1, machine=machine,
                            space=SearchSpace(tp_degrees=(2,), dp_shard_degrees=(1,), checkpointing=("none",)))
    assert (chosen.tp, chosen.dp_shard, chosen.checkpointing) == (2, 1, "none")
    assert chosen.iteration_s == pytest.approx(only_tp.iteration_s)
    assert chosen.iteration_s < 0.6 * plain.iteration_s  # the layer's 3 s halved, its all-reduces a few microseconds
    per_rank = shard_costs(list(units), costs, ParallelDegrees(tp=2), tp_link=LINK)
    again = evaluate_plan(chosen.plan, units, per_rank, dp=chosen.dp, microbatches=1, machine=machine,
                          schedule=chosen.schedule)
    assert again.iteration_s == pytest.approx(chosen.iteration_s)


def test_bounds_stay_below_every_plan():
    units, costs = _one_big_layer()
    assert chain_s(units, costs) == pytest.approx(0.01 + 1.0 + 0.01 + 1.0 + 0.01)  # forwards, dX of layer and head
    for devices in (1, 2, 4):
        for microbatches in (1, 3, 8):
            choice = plan_layout(units, costs, devices, microbatches=microbatches)
            bound = work_bound(units, costs, devices, microbatches, divisors(devices))
            assert bound <= choice.iteration_s * (1 + 1e-12)
    assert work_bound(units, costs, 2, 4, [4]) == math.inf  # no DP degree fits two devices


@dataclasses.dataclass(frozen=True)
class _Found:
    iteration_s: float
    devices: int
    lower_bound_s: float = 1.0
    origin: int = 0


@pytest.mark.parametrize("times", [{1: 8.0, 2: 4.0, 3: 5.0, 4: 2.5, 6: 2.5, 12: 3.0},
                                   {1: 8.0, 2: 4.0, 3: 5.0, 4: 2.5, 6: 2.0, 12: 2.0},
                                   {1: 8.0, 2: 4.0, 3: 5.0, 4: 2.5, 6: 2.2, 12: 1.0}])
def test_searching_the_device_count_first_finds_the_divisors_plan(times):
    """plan_over_divisors from the device count down (the divisors asked only for plans at most as fast as the best
    so far) returns what it returns from the smallest divisor up: the fastest, ties to the fewest devices."""
    asked = []

    def direct(n, so_far, beat):
        asked.append((n, beat))
        return _Found(times[n], n, origin=n) if times[n] < beat else None

    def key(found):
        return (found.iteration_s,)

    up = plan_over_divisors(12, direct, key)
    asked.clear()
    down = plan_over_divisors(12, direct, key, incumbent_first=lambda top: True)
    assert (down.iteration_s, down.origin, down.devices) == (up.iteration_s, up.origin, 12)
    assert asked[0] == (12, math.inf) and [n for n, _ in asked[1:]] == [1, 2, 3, 4, 6]
    assert all(beat <= math.nextafter(times[12], math.inf) for _, beat in asked[1:])
    refused = plan_over_divisors(12, direct, key, incumbent_first=lambda top: False)
    assert (refused.iteration_s, refused.origin) == (up.iteration_s, up.origin)
