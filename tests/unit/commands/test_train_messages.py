"""What ``plait train`` tells the user: the checkpoint layout names TP and FSDP2 sharding, ``parallel.plan = "auto"``
reports the dp_shard / tp / checkpointing it writes, and one step is "1 step"."""

from __future__ import annotations

from plait.commands.train import auto_plan_replaces
from plait.config.loader import config_from_dict
from plait.train.checkpoint import CheckpointLayout
from tests.helpers.jobs import tiny_config_dict


def test_checkpoint_layout_names_tp_and_dp_shard_and_reads_older_layouts():
    layout = CheckpointLayout(world_size=4, dp=2, pp=1, cp=1, tp=2, dp_shard=2)
    assert layout.describe() == "4 processes (DP 2 x PP 1 x CP 1 x TP 2; DP = 1 replica(s) x FSDP2 dp_shard 2)"
    assert CheckpointLayout(world_size=4, dp=1, pp=2, cp=1, tp=2, plan="p").describe() == (
        "4 processes (DP 1 x PP 2 x CP 1 x TP 2; p)")
    assert CheckpointLayout.from_dict(layout.to_dict()) == layout
    # plait launch after a failure (pipelines of 1 and 2 workers): degrees that do not multiply to the world size
    # are not printed, the plan names the pipelines
    launch = CheckpointLayout(world_size=3, dp=2, pp=2, cp=1, plan="plait launch: workers [0]: 1 stages; workers [1, 2]")
    assert launch.describe() == "3 processes (plait launch: workers [0]: 1 stages; workers [1, 2])"
    older = {"world_size": 2, "dp": 2, "pp": 1, "cp": 1, "plan": ""}  # written before tp / dp_shard were recorded
    assert CheckpointLayout.from_dict(older) == CheckpointLayout(world_size=2, dp=2)
    assert layout != CheckpointLayout(world_size=4, dp=2, pp=1, cp=1, tp=2)  # another shard degree: another layout


def test_auto_plan_reports_the_sharding_tp_and_checkpointing_it_writes():
    cfg = config_from_dict(tiny_config_dict("train.jsonl"))
    resolved = config_from_dict(tiny_config_dict("train.jsonl"))
    resolved.parallel.dp_shard, resolved.parallel.tp = 2, 2
    resolved.train.activation_checkpointing = "full"
    assert auto_plan_replaces(cfg, resolved) == (
        "plait: parallel.plan=auto replaces the job's parallel.dp_shard = 1 -> 2, parallel.tp = 1 -> 2, "
        "train.activation_checkpointing = 'none' -> 'full' (written -> chosen)")


def test_the_setup_line_names_the_layouts_degrees():
    from plait.parallel.dims import ParallelDims
    from plait.train.run_start import layout_description

    assert layout_description(ParallelDims(dp=1, dp_shard=2, tp=2)) == "DP 2 x PP 1 x CP 1 x TP 2; DP = 1 replica(s) x FSDP2 dp_shard 2"
    assert layout_description(ParallelDims(pp=2, tp=2)) == "DP 1 x PP 2 x CP 1 x TP 2"  # PP x TP names TP
    assert layout_description(ParallelDims()) == "DP 1 x PP 1 x CP 1"
    assert layout_description(ParallelDims(dp=2, ep=2)) == ("DP 2 x PP 1 x CP 1; EP 2 (each MoE layer's experts split over 2 "
                                                             "of the DP ranks)")
