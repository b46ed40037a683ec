"""A sharded ``plait plan`` (dp_shard > 1) prints its FSDP2 collectives (all-gathers per microbatch, the gradient
reduce-scatter per step) instead of a plain DP ``gradient all-reduce``; the reduce-scatter is the search's own."""

from __future__ import annotations

import dataclasses
import io

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.commands.plan.fsdp import fsdp_collectives, fsdp_line
from plait.planner.cost.types import DeviceSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.report import format_plan
from plait.planner.cost.sharding import gather_s, shard_costs
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def _sharded_plan():
    """The demo on 4 CPU devices with a cap of 0.4 x the whole model: tp 2 x FSDP2 2 (checked below)."""
    whole = sum(plan_command(DEMO, 1, None, device=DeviceSpec.cpu(), out=io.StringIO(),
                             profile_store=None).stage_memory_bytes)
    device = dataclasses.replace(DeviceSpec.cpu(), memory_bytes=0.4 * whole / 0.9)
    out = io.StringIO()
    choice = plan_command(DEMO, 4, None, device=device, out=out, profile_store=None)
    setup = plan_setup(DEMO, 4, device=device, stream=io.StringIO())
    return choice, out.getvalue(), setup


def test_sharded_plan_prints_fsdp2_collectives_not_a_dp_all_reduce():
    choice, text, setup = _sharded_plan()
    assert choice.dp_shard == 2 and choice.tp == 2
    link = setup.machine.shard_link
    gathers, sync = fsdp_collectives(setup.inputs.units, setup.inputs.costs, choice, link)
    assert sync == pytest.approx(choice.grad_sync_s, rel=1e-6) and sync > 0
    units = consistent_units(setup.inputs.units)
    split = shard_costs(units, setup.inputs.costs, ParallelDegrees(tp=2))
    one = sum(gather_s(c.param_bytes, 2, link) for u, c in zip(units, split) if u.trainable)
    assert choice.fsdp_reshard == "after_backward"  # the planner keeps the gathered parameters (it fits)
    assert gathers == pytest.approx(one) and "(forward only: kept until the backward" in text
    resharded = dataclasses.replace(choice, fsdp_reshard="after_forward")
    assert fsdp_collectives(setup.inputs.units, setup.inputs.costs, resharded, link)[0] == pytest.approx(2 * one)
    assert "gradient all-reduce" not in text
    assert f"FSDP2 gradient reduce-scatter {1e3 * choice.grad_sync_s:.2f} ms" in text
    assert f"parameter all-gathers {1e3 * gathers:.2f} ms per microbatch" in text
    assert fsdp_line(setup.inputs.units, setup.inputs.costs, choice, link) in text


def test_unsharded_plans_keep_the_all_reduce_and_an_uncharged_reduce_scatter_says_so():
    choice, _, setup = _sharded_plan()
    plain = dataclasses.replace(choice, dp_shard=1)
    assert "gradient all-reduce" in format_plan(plain)
    assert fsdp_collectives(setup.inputs.units, setup.inputs.costs, plain, setup.machine.shard_link) == (0.0, 0.0)
    assert fsdp_line(setup.inputs.units, setup.inputs.costs, plain, None) == ""
    uncharged = format_plan(dataclasses.replace(choice, grad_sync_s=0.0))
    assert "FSDP2 gradient reduce-scatter not charged: no DP link" in uncharged
    assert "0.00 ms" not in uncharged.split("pipeline", 1)[1].split(")", 1)[0]
