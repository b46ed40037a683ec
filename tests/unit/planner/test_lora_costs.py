"""LoRA units (a frozen base with trainable adapters) as a cost class, hand-worked: backward = dX through the base +
the adapters' share of dW, activations kept, gradients and optimizer state for the adapters only; the unit-graph
rule and the report read them from ``Unit.trainable_fraction``."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.cost.analytic import unit_activation_bytes, unit_static_bytes, unit_work
from plait.planner.cost.types import OptimizerSpec
from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.report import format_lora_units
from plait.planner.pipeline.simulator import stage_costs_from_units
from plait.planner.types import Unit, UnitCost

COST = UnitCost(forward_s=1.0, input_grad_s=2.0, weight_grad_s=4.0, param_bytes=1000, activation_bytes=300)


def lora_unit(fraction: float = 0.25, needs_input_grad: bool = True) -> Unit:
    return Unit("llm.1", "llm", "layer", True, needs_input_grad, fraction)


def test_fraction_is_validated_and_round_trips():
    with pytest.raises(ValueError, match="trainable_fraction"):
        Unit("x", "llm", "layer", True, False, 0.0)
    unit = lora_unit(0.125)
    assert Unit.from_dict(unit.to_dict()) == unit
    assert unit.adapter and unit.trained_fraction == 0.125
    assert not Unit("x", "llm", "layer", True, False).adapter
    assert Unit("x", "llm", "layer", False, True, 0.5).trained_fraction == 0.0


def test_backward_is_dx_plus_the_adapters_share_of_dw():
    # dX 2 s whole + dW 4 s x 0.25 = 3 s; frozen-unaware: 2 + 4 = 6 s
    assert COST.backward_s(lora_unit()) == 3.0
    assert COST.backward_s(lora_unit(), frozen_aware=False) == 6.0
    assert unit_work([lora_unit()], [COST]) == [4.0]
    # a LoRA unit with nothing trainable upstream (the first adapted layer) pays its dW share only: 1 s
    assert COST.backward_s(lora_unit(needs_input_grad=False)) == 1.0


def test_memory_counts_gradients_and_optimizer_state_for_adapters_only():
    # bf16 (2 B): 1000 B = 500 parameters; full: 1000 + 500 x (2 grad + 12 AdamW) = 8000 B
    full = Unit("llm.1", "llm", "layer", True, True)
    assert unit_static_bytes(full, COST) == 8000.0
    # LoRA, adapters a quarter of the parameters: 1000 + 125 x 14 = 2750 B
    assert unit_static_bytes(lora_unit(), COST) == 2750.0
    assert unit_static_bytes(lora_unit(), COST, frozen_aware=False) == 8000.0
    assert unit_static_bytes(lora_unit(), COST, optimizer=OptimizerSpec(grad_bytes_per_param=4)) == 1000 + 125 * 16
    assert unit_activation_bytes(lora_unit(), COST) == 300.0  # activations kept


def test_graph_rule_lora_units_train_and_feed_input_gradients_downstream():
    units = list(synthetic_units({}, [False, False, False, False]))
    units[1] = dataclasses.replace(units[1], trainable=True, trainable_fraction=0.1)
    flags = consistent_units(units)
    assert [u.needs_input_grad for u in flags] == [False, False, True, True]
    assert flags[1].adapter and flags[1].trainable_fraction == 0.1
    assert all(u.trainable_fraction == 1.0 for u in consistent_units(units, all_trainable=True))


def test_simulator_stage_work_reads_the_fraction():
    units = list(synthetic_units({}, [False, False, False, False]))
    units = consistent_units([dataclasses.replace(u, trainable=True, trainable_fraction=0.25) if u.kind == "layer"
                              else u for u in units])
    costs = {u.name: COST for u in units}
    one = plan_pipeline(units, stages_per_module={"llm": 1})
    # layers llm.1, llm.2 are LoRA: dW = 2 x 4 x 0.25 = 2 s; dX = 2 s for llm.2 and the head llm.3 = 4 s. One stage's
    # input needs no gradient: its split B has nothing to send and W runs the whole backward (the runtime's split)
    assert stage_costs_from_units(one, units, costs)[(0, "B")] == 6.0
    split = stage_costs_from_units(one, units, costs, split_backward=True)
    assert (split[(0, "B")], split[(0, "W")]) == (0.0, 6.0)
    two = stage_costs_from_units(plan_pipeline(units, stages_per_module={"llm": 2}), units, costs, split_backward=True)
    assert (two[(0, "B")], two[(0, "W")]) == (0.0, 1.0)  # llm.0 (frozen embedding), llm.1 (LoRA, no dX needed)
    assert (two[(1, "B")], two[(1, "W")]) == (4.0, 1.0)  # llm.2 (LoRA) and the head: dX through both, W of llm.2
    # the runtime's split backward measured (B 3, W 5 s per unit): stage 1 needs an input gradient, so it pays B 3 for
    # llm.2 and 2 (plain dX) for the frozen head, W 5 x 0.25 for llm.2; stage 0 runs one unsplit backward (fused)
    measured = {n: dataclasses.replace(c, split_input_grad_s=3.0, split_weight_grad_s=5.0) for n, c in costs.items()}
    plan2 = plan_pipeline(units, stages_per_module={"llm": 2})
    got = stage_costs_from_units(plan2, units, measured, split_backward=True)
    assert (got[(0, "B")], got[(0, "W")]) == (0.0, 1.0) and (got[(1, "B")], got[(1, "W")]) == (5.0, 1.25)
    assert stage_costs_from_units(plan2, units, measured) == stage_costs_from_units(plan2, units, costs)  # 1F1B


def test_report_names_lora_units():
    units = [Unit("llm.0", "llm", "embed", False, False), lora_unit(0.02), lora_unit(0.04)]
    text = format_lora_units(units)
    assert text.startswith("LoRA llm: 2 units") and "3.00% of a unit's parameters" in text and text.endswith("\n")
    assert format_lora_units(units[:1]) == ""
