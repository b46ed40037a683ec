"""``parallel.dp_shard`` and ``parallel.tp`` from TOML overrides into the config, their validation, and the layout
the trainers derive from them."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, load_config, validate
from plait.parallel.dims import ParallelDims
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer
from tests.helpers.jobs import ROOT, tiny_config_dict


def test_overrides_set_dp_shard_and_tp_and_the_layout_follows():
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--parallel.dp_shard=2", "--parallel.tp=2"])
    assert (cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.tp) == (0, 2, 2)
    assert Trainer.layout(cfg, 8) == ParallelDims(dp=2, pp=1, cp=1, dp_shard=2, tp=2)
    default = load_config(ROOT / "configs" / "demo.toml")
    assert (default.parallel.dp_shard, default.parallel.tp) == (1, 1)
    pp = load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.tp=2"])
    assert PipelineTrainer.layout(pp, 16) == ParallelDims(dp=2, pp=4, cp=1, tp=2)
    sharded = load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.dp_shard=2"])  # FSDP2 per stage
    assert PipelineTrainer.layout(sharded, 16) == ParallelDims(dp=2, pp=4, cp=1, dp_shard=2)
    nodes = load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.dp_shard=2", "--parallel.gpus_per_node=2"])
    assert PipelineTrainer.layout(nodes, 16).rank_order == "pp_outer"  # each stage's FSDP2 pair on one node


@pytest.mark.parametrize("field,value,message", [
    ("dp_shard", 0, "parallel.dp_shard must be >= 1 \\(1: no sharding\\), got 0"),
    ("tp", -1, "parallel.tp must be >= 1 \\(1: no tensor parallelism\\), got -1"),
    ("rank_order", "tp_outer", "parallel.rank_order must be auto, dp_outer or pp_outer, got 'tp_outer'"),
    ("gpus_per_node", -8, "parallel.gpus_per_node must be an integer >= 0 \\(0: from torchrun\\), got -8"),
    ("ep", 0, "parallel.ep must be an integer >= 1 \\(1: no expert parallelism\\), got 0"),
])
def test_bad_degrees_are_refused_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        validate(config_from_dict(tiny_config_dict("train.jsonl", parallel={field: value})))


def test_expert_parallelism_without_tp_with_cp():
    with pytest.raises(ValueError, match="parallel.ep = 2 works with parallel.tp = 1, got tp = 2"):
        validate(config_from_dict(tiny_config_dict("train.jsonl", parallel={"ep": 2, "tp": 2})))
    validate(config_from_dict(tiny_config_dict("train.jsonl", parallel={"ep": 2, "cp": 2})))
    assert Trainer.layout(config_from_dict(tiny_config_dict("t.jsonl", parallel={"ep": 2})), 4).ep == 2
