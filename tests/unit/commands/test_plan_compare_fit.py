"""``commands.plan.compare.considered_plans`` with no fitting plan raises ``plait plan``'s one-sentence message (not the
search's list of internal cases), and ``planner.fit.least_need`` bounds FSDP2-sharded pipeline stages too."""

from __future__ import annotations

import dataclasses
import io

import pytest

from plait.commands.plan.command import plan_setup
from plait.commands.plan.compare import considered_plans
from plait.planner.search.fit import least_need
from plait.planner.cost.types import DeviceSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.cost.sharding import rank_memory
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def test_considered_plans_without_a_fitting_plan_say_so_in_one_sentence():
    tiny = dataclasses.replace(DeviceSpec.cpu(), memory_bytes=2**20)  # 0.9 MiB per device: nothing fits
    with pytest.raises(ValueError) as info:
        considered_plans(DEMO, 2, device=tiny, profile_store=None)
    text = str(info.value)
    assert text.startswith("no plan fits in 0.9 MiB per device (0.9 of the 1.0 MiB of a CPU, --memory-fraction)")
    assert "memory_cap=" not in text and "\n" not in text and text.count(";") == 1


def test_least_need_of_sharded_stages_is_a_share_of_their_pipelined_memory():
    setup = plan_setup(DEMO, 8, device=DeviceSpec.cpu(), stream=io.StringIO())
    units, costs, dtype = consistent_units(setup.inputs.units), setup.inputs.costs, setup.machine.dtype
    option = ParallelDegrees(1, 2, "full")  # 8 devices: at most 4 pipeline ranks of FSDP2-sharded stages
    need, best = least_need(units, costs, 8, [option], dtype=dtype)
    flat = rank_memory(units, costs, option, dtype=dtype).total
    staged = rank_memory(units, costs, option, dtype=dtype, pipelined=True).total
    assert best == option and need < flat
    largest = max(rank_memory([u], [c], option, dtype=dtype, pipelined=True).total for u, c in zip(units, costs))
    assert need == pytest.approx(max(largest, staged / 4))
