"""Activation checkpointing in the planner (issue 14, items 4-5): the one selection rule and its costs, with
hand-worked values: recomputation charged in the backward, only the layer's input kept."""

from __future__ import annotations

import pytest

from plait.planner.cost.analytic import stage_work, unit_activation_bytes, unit_memory_bytes, unit_work
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.cost.recompute import checkpointed_costs, plan_checkpointing
from plait.planner.pipeline.simulator import stage_costs_from_units
from plait.planner.types import Unit, UnitCost


def _units(vision_trainable: bool, projector_trainable: bool, llm_trainable: bool) -> tuple[Unit, ...]:
    """vision: embed, layers 0-2, projector; llm: embed, layers 0-3, head."""
    units = [Unit("v.embed", "vision", "embed", vision_trainable, False)]
    units += [Unit(f"v.layers.{i}", "vision", "layer", vision_trainable, False) for i in range(3)]
    units += [Unit("v.proj", "vision", "projector", projector_trainable, False),
              Unit("l.embed", "llm", "embed", llm_trainable, False)]
    units += [Unit(f"l.layers.{i}", "llm", "layer", llm_trainable, False) for i in range(4)]
    units.append(Unit("l.head", "llm", "head", llm_trainable, False))
    return consistent_units(units)


def _names(units, flags) -> list[str]:
    return [u.name for u, f in zip(units, flags) if f]


def test_full_checkpoints_every_layer_that_runs_a_backward():
    units = _units(True, True, True)
    assert _names(units, plan_checkpointing(units, "full")) == [
        "v.layers.0", "v.layers.1", "v.layers.2", "l.layers.0", "l.layers.1", "l.layers.2", "l.layers.3"]
    assert not any(plan_checkpointing(units, "none"))


def test_selective_is_every_other_layer_of_each_module():
    units = _units(True, True, True)
    assert _names(units, plan_checkpointing(units, "selective")) == [
        "v.layers.0", "v.layers.2", "l.layers.0", "l.layers.2"]


def test_frozen_units_that_run_no_backward_are_never_checkpointed():
    units = _units(False, True, False)  # frozen encoder + trainable projector + frozen LLM (needs input grad)
    assert not any(u.runs_backward for u in units[:4])
    assert _names(units, plan_checkpointing(units, "full")) == [
        "l.layers.0", "l.layers.1", "l.layers.2", "l.layers.3"]
    everything_frozen = _units(False, False, False)
    assert not any(plan_checkpointing(everything_frozen, "full"))


def test_per_module_overrides():
    units = _units(True, True, True)
    flags = plan_checkpointing(units, "none", {"llm": "full", "vision": "selective"})
    assert _names(units, flags) == ["v.layers.0", "v.layers.2", "l.layers.0", "l.layers.1", "l.layers.2",
                                    "l.layers.3"]
    with pytest.raises(ValueError, match="activation checkpointing of llm: 'most'"):
        plan_checkpointing(units, "full", {"llm": "most"})
    with pytest.raises(ValueError, match="of default"):
        plan_checkpointing(units, "some")


def test_checkpointed_cost_charges_recomputation_and_keeps_the_input():
    # a layer: forward 2 s, dX 3 s, dW 1.5 s, saves 1000 B, output (= input) 64 B, params 10 B
    unit = Unit("l.layers.0", "llm", "layer", True, True)
    cost = UnitCost(2.0, 3.0, 1.5, param_bytes=10, activation_bytes=1000, output_bytes=64)
    [ck] = checkpointed_costs([cost], [True])
    assert ck.recompute_s == 2.0 and ck.activation_bytes == 64 and ck.forward_s == 2.0
    assert unit_work([unit], [cost]) == [6.5] and unit_work([unit], [ck]) == [8.5]  # 2 + 3 + 1.5 (+ 2)
    assert unit_activation_bytes(unit, ck) == 64.0
    # 3 microbatches in flight, fp32 params (2.5 parameters), AdamW 12 B + grad 4 B: 10 + 40 = 50 static
    assert unit_memory_bytes(unit, ck, 3, dtype="fp32") == 50 + 3 * 64
    assert unit_memory_bytes(unit, cost, 3, dtype="fp32") == 50 + 3 * 1000
    # a trainable layer after frozen ones (no dX) still recomputes before its dW: 2 + 1.5 + 2
    first = Unit("l.layers.0", "llm", "layer", True, False)
    assert unit_work([first], [ck]) == [5.5]
    # a frozen layer that passes gradients (dX only): 2 + 3 + 2
    passing = Unit("l.layers.0", "llm", "layer", False, True)
    assert unit_work([passing], [ck]) == [7.0]
    # unflagged costs are unchanged
    assert checkpointed_costs([cost], [False]) == [cost]
    with pytest.raises(ValueError, match="1 costs but 2"):
        checkpointed_costs([cost], [True, False])


def test_simulator_stage_costs_and_memory_follow_checkpointing():
    units = _units(False, True, True)  # frozen encoder, trainable projector and LLM
    base = UnitCost(1.0, 2.0, 1.0, param_bytes=0, activation_bytes=500, output_bytes=50)
    costs = [base] * len(units)
    flags = plan_checkpointing(units, "full")
    ck = checkpointed_costs(costs, flags)
    plan = plan_pipeline(units, "encoder_parallel", stages_per_module={"vision": 1, "llm": 1})
    by_name = {u.name: c for u, c in zip(units, ck)}
    plain = stage_costs_from_units(plan, units, {u.name: c for u, c in zip(units, costs)})
    fused = stage_costs_from_units(plan, units, by_name)
    split = stage_costs_from_units(plan, units, by_name, split_backward=True)
    llm = plan.stage_of_unit("l.layers.0")
    # LLM stage: 6 units (embed, 4 layers, head) train and need dX (the projector upstream trains); the 4
    # checkpointed layers add 4 x 1 s of forward to B (split: to B and again to W)
    assert plain[(llm, "B")] == 6 * 2.0 + 6 * 1.0 and fused[(llm, "B")] == plain[(llm, "B")] + 4.0
    assert split[(llm, "B")] == 6 * 2.0 + 4.0 and split[(llm, "W")] == 6 * 1.0 + 4.0
    enc = plan.stage_of_unit("v.layers.0")
    assert fused[(enc, "B")] == plain[(enc, "B")]  # frozen layers: nothing recomputed
    # saved activations per microbatch of the LLM stage: 2 x 500 (embed, head) + 4 x 50 (layer inputs)
    assert stage_work(units[5:], ck[5:]) == pytest.approx(6 * 1.0 + 6 * 2.0 + 6 * 1.0 + 4 * 1.0)
    assert sum(unit_activation_bytes(u, c) for u, c in zip(units[5:], ck[5:])) == 2 * 500 + 4 * 50
    # the frozen encoder's layers keep nothing with or without checkpointing
    assert sum(unit_activation_bytes(u, c) for u, c in zip(units[:4], ck)) == 0
