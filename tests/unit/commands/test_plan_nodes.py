"""``plait plan --gpus-per-node``: collectives charged by where their groups sit, and the rank order that keeps
FSDP2's shard pairs inside a node written into the job tables and the command."""

from __future__ import annotations

import io

import pytest

from plait.commands.plan.command import plan_command
from tests.helpers.jobs import ROOT

DEMO_PP = str(ROOT / "configs" / "demo_pp.toml")
COMMON = dict(device="h100", virtual_stages=(1,), attach_encoders=False, profile_store=None,
              overrides=["--parallel.dp_shard=2"])


def test_nodes_of_four_put_the_pipeline_outermost_and_say_so():
    """A 3-rank pipeline with 2 shard ranks per stage (the job keeps dp_shard 2): numbered dp_outer, each stage's
    FSDP2 pair strides over 3 ranks and crosses nodes of 4; pp_outer keeps every pair on one node."""
    text = io.StringIO()
    choice = plan_command(DEMO_PP, 16, None, out=text, gpus_per_node=4, **COMMON)
    assert (choice.rank_order, choice.dp_shard, choice.plan.num_ranks) == ("pp_outer", 2, 3)
    out = text.getvalue()
    assert "nodes of 4 GPUs: NVLink inside a node" in out
    assert 'rank_order = "pp_outer"' in out and "--parallel.rank_order=pp_outer" in out
    assert choice.devices_used == 6 and "2 nodes (the last one runs 2: torchrun needs the same count" in out
    one_node = io.StringIO()
    alone = plan_command(DEMO_PP, 16, None, out=one_node, **COMMON)
    assert alone.rank_order == "dp_outer" and "rank_order" not in one_node.getvalue()


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
