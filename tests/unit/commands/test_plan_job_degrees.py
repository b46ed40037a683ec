"""``plait plan`` keeps a job's own ``parallel.tp`` / ``parallel.dp_shard`` (it planned as if they were 1 and the
pasted table then asked for more processes than planned: found by a fresh-user pass)."""

from __future__ import annotations

import io

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.planner.cost.types import DeviceSpec
from plait.train.plan_search import search_plan
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


@pytest.mark.parametrize("override, tp, shard", [("--parallel.dp_shard=2", 1, 2), ("--parallel.tp=2", 2, 1)])
def test_plan_keeps_the_jobs_tp_and_dp_shard(override, tp, shard):
    out = io.StringIO()
    choice = plan_command(DEMO, 4, None, overrides=[override], device=DeviceSpec.cpu(), out=out, profile_store=None)
    text = out.getvalue()
    assert (choice.tp, choice.dp_shard) == (tp, shard)
    assert choice.dp * choice.tp * choice.plan.num_ranks == 4  # the plan uses the 4 devices with those degrees
    assert f"the job sets parallel.tp = {tp}, parallel.dp_shard = {shard}: the plan keeps them" in text
    assert f"dp_shard = {shard}\ntp = {tp}\n" in text  # the pasted [parallel] table carries them


def test_plan_refuses_job_degrees_that_do_not_divide_the_devices():
    with pytest.raises(ValueError, match=r"parallel.tp = 3 x parallel.dp_shard = 1 does not divide --devices 4"):
        plan_command(DEMO, 4, None, overrides=["--parallel.tp=3"], device=DeviceSpec.cpu(), out=io.StringIO(),
                     profile_store=None)


def test_plan_without_job_degrees_weighs_them_whether_or_not_the_plain_plan_fits():
    out = io.StringIO()
    choice = plan_command(DEMO, 4, None, device=DeviceSpec.cpu(), out=out, profile_store=None, prefer_within=0)
    assert "the plan keeps them" not in out.getvalue()
    setup = plan_setup(DEMO, 4, device=DeviceSpec.cpu())
    plain = search_plan(setup, 4, 0.9, tp_degrees=[1], dp_shard_degrees=[1], virtual_stages=(1, 2, 4),
                        attach_encoders=True)
    assert plain.fits_memory and choice.iteration_s <= plain.iteration_s
    if (choice.tp, choice.dp_shard) != (1, 1):  # chosen although the plain plan fits: it is faster
        assert choice.iteration_s < plain.iteration_s


def test_plan_keeps_the_jobs_cpu_offload_and_fsdp_reshard_and_its_table_carries_them():
    out = io.StringIO()
    overrides = ["--parallel.dp_shard=2", "--parallel.offload=cpu", "--parallel.fsdp_reshard=after_backward"]
    choice = plan_command(DEMO, 2, None, overrides=overrides, device=DeviceSpec.cpu(), out=out, profile_store=None)
    text = out.getvalue()
    assert (choice.offload, choice.fsdp_reshard, choice.dp_shard, choice.plan.num_ranks) == (
        "cpu", "after_backward", 2, 1)
    assert ("the job sets parallel.tp = 1, parallel.dp_shard = 2, parallel.fsdp_reshard = 'after_backward', "
            "parallel.offload = 'cpu': the plan keeps them") in text
    assert 'dp_shard = 2\ntp = 1\ncp = 1\noffload = "cpu"\nfsdp_reshard = "after_backward"\n' in text  # the pasted table
