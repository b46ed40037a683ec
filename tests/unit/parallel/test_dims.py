"""The one rank layout (plait.parallel.dims): coordinates, groups and the world-size errors, without processes."""

from __future__ import annotations

import pytest

from plait.parallel.dims import ParallelDims, RankCoords


def test_rank_and_coords_follow_the_cp_innermost_layout():
    dims = ParallelDims(dp=2, pp=3, cp=2)
    assert dims.world_size == 12
    assert dims.rank(0, 0, 0) == 0 and dims.rank(0, 0, 1) == 1 and dims.rank(0, 1, 0) == 2
    assert dims.rank(1, 0, 0) == 6 and dims.rank(1, 2, 1) == 11
    assert dims.coords(7) == RankCoords(dp=1, pp=0, cp=1)
    assert dims.coords(4) == RankCoords(dp=0, pp=2, cp=0)
    assert [dims.rank(**vars(dims.coords(r))) for r in range(12)] == list(range(12))


def test_groups_span_the_named_axes():
    dims = ParallelDims(dp=2, pp=2, cp=2)
    assert dims.groups(("cp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups(("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.groups(("pp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups(("dp", "cp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert dims.pipeline_ranks(5) == (5, 7) and dims.pipeline_ranks(2) == (0, 2)
    assert ParallelDims(dp=3).groups(("dp",)) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="unknown axes"):
        dims.groups(("ep",))  # tp is an axis now (issue 14); expert parallelism is not


def test_from_world_derives_dp_or_says_how_many_processes_to_launch():
    assert ParallelDims.from_world(8, pp=2, cp=2) == ParallelDims(2, 2, 2)
    assert ParallelDims.from_world(4, cp=2, dp=2) == ParallelDims(2, 1, 2)
    assert ParallelDims.from_world(1) == ParallelDims(1, 1, 1)
    with pytest.raises(ValueError, match=r"parallel.dp=3 x parallel.pp.degree=1 x parallel.cp=2 = 6 processes does "
                                         r"not fit the world size 4: launch exactly 6 processes"):
        ParallelDims.from_world(4, cp=2, dp=3)
    with pytest.raises(ValueError, match=r"parallel.pp.degree=2 x parallel.cp=2 does not fit the world size 6: "
                                         r"launch a multiple of 4 processes, e.g. torchrun --nproc_per_node 4$"):
        ParallelDims.from_world(6, pp=2, cp=2)
    with pytest.raises(ValueError, match="degrees must be >= 1"):
        ParallelDims(dp=0)
    with pytest.raises(ValueError, match="rank 8 outside"):
        ParallelDims(2, 2, 2).coords(8)


def test_dp_shard_and_tp_axes_follow_the_shared_layout():
    dims = ParallelDims(dp=2, pp=2, cp=1, dp_shard=2, tp=2)
    assert dims.world_size == 16 and dims.sizes == (2, 2, 2, 1, 2) and dims.batch == 4
    # rank = ((((dp * dp_shard + shard) * pp + pp_rank) * cp + cp_rank) * tp + tp_rank)
    assert dims.rank(dp=1, pp=1, cp=0, dp_shard=0, tp=1) == ((1 * 2 + 0) * 2 + 1) * 2 + 1 == 11
    assert dims.coords(11) == RankCoords(dp=1, pp=1, cp=0, dp_shard=0, tp=1)
    assert [dims.rank(**vars(dims.coords(r))) for r in range(16)] == list(range(16))
    assert dims.groups(("tp",))[:2] == [[0, 1], [2, 3]]
    assert dims.groups(("dp_shard",))[:2] == [[0, 4], [1, 5]]
    assert dims.groups(("dp", "dp_shard"))[0] == [0, 4, 8, 12]
    assert [dims.batch_rank(r) for r in (0, 1, 4, 8, 13)] == [0, 0, 1, 2, 3]
    assert dims.pipeline_ranks(5) == (5, 7)


def test_trivial_new_axes_keep_todays_ranks():
    old = ParallelDims(dp=2, pp=3, cp=2)
    assert old == ParallelDims(2, 3, 2, dp_shard=1, tp=1)
    assert [old.rank(d, p, c) for d in range(2) for p in range(3) for c in range(2)] == list(range(12))


def test_from_world_with_dp_shard_and_tp():
    assert ParallelDims.from_world(8, dp_shard=2) == ParallelDims(dp=4, dp_shard=2)
    assert ParallelDims.from_world(4, dp=2, dp_shard=2) == ParallelDims(dp=2, dp_shard=2)
    assert ParallelDims.from_world(8, pp=2, dp_shard=2, tp=2) == ParallelDims(dp=1, pp=2, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"parallel.dp=2 x parallel.pp.degree=1 x parallel.cp=1 x parallel.dp_shard=2 "
                                         r"x parallel.tp=2 = 8 processes does not fit the world size 4"):
        ParallelDims.from_world(4, dp=2, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"x parallel.dp_shard=3 does not fit the world size 4: launch a multiple "
                                         r"of 3"):
        ParallelDims.from_world(4, dp_shard=3)
    with pytest.raises(ValueError, match="degrees must be >= 1"):
        ParallelDims(tp=0)


def test_pp_outer_numbers_the_pipeline_outermost():
    """``((((pp_rank * dp + dp) * dp_shard + shard) * cp + cp_rank) * tp + tp_rank)``; every rank once."""
    dims = ParallelDims(dp=2, pp=2, cp=1, dp_shard=2, tp=2, rank_order="pp_outer")
    assert dims.order == ("pp", "dp", "dp_shard", "cp", "tp")
    assert dims.rank(dp=1, pp=1, cp=0, dp_shard=0, tp=1) == ((1 * 2 + 1) * 2 + 0) * 2 + 1 == 13
    assert dims.coords(13) == RankCoords(dp=1, pp=1, cp=0, dp_shard=0, tp=1)
    assert sorted(dims.rank(**vars(dims.coords(r))) for r in range(16)) == list(range(16))
    assert dims.groups(("pp",))[0] == [0, 8] and dims.groups(("dp_shard",))[0] == [0, 2]
    assert dims.pipeline_ranks(13) == (5, 13)
    with pytest.raises(ValueError, match="rank_order must be one of"):
        ParallelDims(rank_order="tp_outer")


def _nodes(group, per_node):
    return {r // per_node for r in group}


def test_auto_rank_order_keeps_every_fsdp2_and_tp_group_inside_a_node():
    """32 GPUs in nodes of 8, pp 4, tp 2, dp_shard 4: numbered dp_outer every FSDP2 shard group spans 4 nodes (its
    stride is pp x cp x tp = 8); ``auto`` picks pp_outer, where each pipeline rank's 8 GPUs are one node."""
    base = ParallelDims(dp=1, pp=4, cp=1, dp_shard=4, tp=2)
    assert [len(_nodes(g, 8)) for g in base.groups(("dp_shard",))] == [4] * 8
    dims = base.ordered("auto", gpus_per_node=8)
    assert dims.rank_order == "pp_outer"
    for axes in (("dp_shard",), ("tp",), ("dp", "dp_shard", "tp")):
        assert all(len(_nodes(g, 8)) == 1 for g in dims.groups(axes)), axes
    assert all(len(_nodes(g, 8)) == 4 for g in dims.groups(("pp",)))  # the pipeline crosses nodes instead
    assert base.ordered("auto", gpus_per_node=32).rank_order == "dp_outer"  # one node: nothing to keep inside
    assert base.ordered("pp_outer").rank_order == "pp_outer" and base.ordered("dp_outer") == base


def test_auto_rank_order_reads_torchruns_local_world_size(monkeypatch):
    base = ParallelDims(dp=1, pp=4, cp=1, dp_shard=4, tp=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert base.ordered("auto").rank_order == "pp_outer"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert base.ordered("auto").rank_order == "dp_outer"  # unset: all 32 processes on one node


def test_a_node_size_that_disagrees_with_torchrun_is_refused(monkeypatch):
    base = ParallelDims(dp=1, pp=4, cp=1, dp_shard=4, tp=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"parallel.gpus_per_node=4 but torchrun runs 8 processes per node"):
        base.ordered("auto", gpus_per_node=4)
    assert base.ordered("auto", gpus_per_node=8).rank_order == "pp_outer"
    assert base.ordered("dp_outer", gpus_per_node=4).rank_order == "dp_outer"  # an explicit order needs no node size


def test_expert_parallel_groups_split_the_batch_axis_of_each_stage():
    """dp 2 x dp_shard 2 x pp 2, ep 2: the EP groups are consecutive batch ranks of one pipeline rank, the expert
    replicas the batch ranks with the same ``b % ep``; both orders give the same groups of batch ranks."""
    for order in ("dp_outer", "pp_outer"):
        dims = ParallelDims(dp=2, pp=2, dp_shard=2, ep=2, rank_order=order)
        ep_groups, replicas = dims.expert_groups()
        assert len(ep_groups) == 4 and len(replicas) == 4
        for g in ep_groups:
            assert len({dims.coords(r).pp for r in g}) == 1
            assert [dims.batch_rank(r) for r in g] in ([0, 1], [2, 3]) and [dims.ep_rank(r) for r in g] == [0, 1]
        for g in replicas:
            assert len({dims.ep_rank(r) for r in g}) == 1 and len({dims.coords(r).pp for r in g}) == 1
    assert ParallelDims.from_world(4, dp_shard=2, ep=4).ep == 4


def test_an_ep_that_does_not_divide_the_data_parallel_ranks_is_refused():
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide the data-parallel ranks dp x dp_shard = 2 x 1"):
        ParallelDims.from_world(2, ep=3)
    with pytest.raises(ValueError, match=r"parallel.ep=2 must divide"):
        ParallelDims.from_world(2, pp=2, ep=2)  # dp x dp_shard = 1
