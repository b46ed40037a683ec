"""``parallel.rank_order = "auto"`` weighs the expert-parallel groups (``topology.plan_rank_order`` given
``parallel.ep``): a layout whose EP groups would cross nodes numbered ``dp_outer`` is numbered ``pp_outer``, where each
EP group's ranks share a node."""

from __future__ import annotations

from plait.parallel.dims import ParallelDims


def _nodes(group, per_node):
    return {r // per_node for r in group}


def test_auto_rank_order_keeps_the_ep_groups_inside_a_node():
    # 16 GPUs in nodes of 4: dp 4 x pp 2 x tp 2, ep 2 (each EP group 2 of the 4 DP replicas)
    plain = ParallelDims(dp=4, pp=2, tp=2)
    assert plain.ordered("auto", gpus_per_node=4).rank_order == "dp_outer"  # without EP nothing favours pp_outer
    base = ParallelDims(dp=4, pp=2, tp=2, ep=2)
    assert all(len(_nodes(g, 4)) == 2 for g in base.expert_groups()[0])  # dp_outer: every EP group spans 2 nodes
    dims = base.ordered("auto", gpus_per_node=4)
    assert dims.rank_order == "pp_outer" and dims.ep == 2
    assert all(len(_nodes(g, 4)) == 1 for g in dims.expert_groups()[0])
    assert all(len(_nodes(g, 4)) == 1 for g in dims.groups(("tp",)))  # TP still inside a node
    assert base.ordered("auto", gpus_per_node=16).rank_order == "dp_outer"  # one node: nothing to keep inside
