"""``plait plan --gpus-per-node``: collectives charged by where their groups sit, and the rank order that keeps
FSDP2's shard pairs inside a node written into the job tables and the command."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from plait.commands.plan.command import plan_command
from plait.commands.plan.nodes import on_whole_nodes, partial_node_note, whole_node_plan
from plait.planner.search.auto_layout import plan_filling_layout
from plait.planner.search.layout import plan_layout
from tests.helpers.jobs import ROOT

DEMO_PP = str(ROOT / "configs" / "demo_pp.toml")
COMMON = dict(device="h100", virtual_stages=(1,), attach_encoders=False, profile_store=None,
              overrides=["--parallel.dp_shard=2"])


def test_nodes_of_two_put_the_pipeline_outermost_and_say_so():
    """A 3-rank pipeline with 2 shard ranks per stage (the job keeps dp_shard 2): numbered dp_outer, each stage's
    FSDP2 pair strides over 3 ranks and crosses nodes of 2; pp_outer keeps every pair on one node."""
    text = io.StringIO()
    choice = plan_command(DEMO_PP, 16, None, out=text, gpus_per_node=2, **COMMON)
    assert (choice.rank_order, choice.dp_shard, choice.plan.num_ranks) == ("pp_outer", 2, 3)
    out = text.getvalue()
    assert "nodes of 2 GPUs: NVLink inside a node" in out
    assert 'rank_order = "pp_outer"' in out and "--parallel.rank_order=pp_outer" in out
    assert choice.devices_used == 6 and "6 processes on nodes of 2: 3 nodes; start one torchrun per node" in out
    one_node = io.StringIO()
    alone = plan_command(DEMO_PP, 16, None, out=one_node, **COMMON)
    assert alone.rank_order == "dp_outer" and "rank_order" not in one_node.getvalue()


def test_plans_over_several_nodes_keep_to_whole_nodes():
    """On nodes of 4 the search's 6-process plan (one node and a half) is not run: the plan is one node's or fills
    whole nodes, and the printed torchrun line starts exactly its processes."""
    text = io.StringIO()
    choice = plan_command(DEMO_PP, 16, None, out=text, gpus_per_node=4, **COMMON)
    used = choice.devices_used
    assert used <= 4 or used % 4 == 0
    out = text.getvalue()
    if used > 4:
        assert f"torchrun --nnodes {used // 4} --nproc_per_node 4 " in out
    else:
        assert f"torchrun --nproc_per_node {used} " in out and "--nnodes" not in out
    assert "the last one runs" not in out


def test_a_plan_over_whole_nodes_prints_one_nodes_torchrun_line():
    text = io.StringIO()
    choice = plan_command(DEMO_PP, 16, None, out=text, gpus_per_node=2, **COMMON)
    nodes = choice.devices_used // 2
    assert choice.devices_used == 2 * nodes and nodes > 1
    out = text.getvalue()
    assert (f"  torchrun --nnodes {nodes} --nproc_per_node 2 --node_rank $NODE_RANK --master_addr $MASTER_ADDR "
            f"--master_port 29500 -m plait.cli train --config {DEMO_PP} --parallel.dp_shard=2 ") in out
    assert f"{nodes} nodes; start one torchrun per node (the command below, NODE_RANK=0..{nodes - 1}" in out


def test_nodes_need_a_gpu_preset():
    with pytest.raises(ValueError, match="--gpus-per-node plans nodes of GPUs"):
        plan_command(DEMO_PP, 4, None, out=io.StringIO(), gpus_per_node=2,
                     **(COMMON | {"device": "cpu", "overrides": []}))


def test_whole_node_plan_weighs_one_node_and_each_whole_node_count():
    """A plan on 15 of 32 GPUs in nodes of 8 is replaced by the fastest of one node's plan (any count up to 8) and
    the plans filling 2 and 4 nodes; a plan already on whole nodes is kept without searching."""
    calls = []

    def search(count, layout_search):
        calls.append((count, layout_search))
        used = count if layout_search is plan_filling_layout else 7
        return SimpleNamespace(devices_used=used, iteration_s={7: 3.0, 16: 2.0, 32: 2.0}[used])

    chosen = whole_node_plan(SimpleNamespace(devices_used=15, iteration_s=1.0), 32, 8, search)
    assert calls == [(8, plan_layout), (16, plan_filling_layout), (32, plan_filling_layout)]
    assert chosen.devices_used == 16  # ties: fewer processes
    calls.clear()
    kept = SimpleNamespace(devices_used=24, iteration_s=1.0)
    assert whole_node_plan(kept, 32, 8, search) is kept and not calls
    assert on_whole_nodes(8, 8) and on_whole_nodes(5, 8) and on_whole_nodes(24, 8) and not on_whole_nodes(15, 8)


@pytest.mark.parametrize("count", [0, -2])
def test_gpus_per_node_below_one_is_refused_naming_the_flag(count):
    with pytest.raises(ValueError, match=rf"--gpus-per-node must be >= 1 \(the GPUs of one node; leave it out to plan "
                                         rf"one node\), got {count}"):
        plan_command(DEMO_PP, 16, None, out=io.StringIO(), gpus_per_node=count, **COMMON)


def test_the_cli_flag_defaults_to_one_node():
    from plait.cli import build_parser

    assert build_parser().parse_args(["plan", "--config", DEMO_PP, "--devices", "4"]).gpus_per_node is None


def test_devices_past_the_last_whole_node_are_said_to_stay_unused():
    assert partial_node_note(10, 4) == ("--devices 10 is not a multiple of --gpus-per-node 4: the plan keeps to whole "
                                        "nodes (torchrun starts the same count on every node), at most 8 devices on "
                                        "2 nodes")
    assert partial_node_note(8, 4) == partial_node_note(3, 4) == partial_node_note(4, 4) == ""
    text = io.StringIO()
    choice = plan_command(DEMO_PP, 10, None, out=text, gpus_per_node=4, **COMMON)
    assert text.getvalue().count("is not a multiple of --gpus-per-node 4") == 1 and choice.devices_used <= 8
