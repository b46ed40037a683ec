"""The planner's per-rank memory (``planner.sharding.rank_memory``) against real tensors: parameter bytes of the real
demo model per unit, and ``bench/memory.py``'s measured bytes (real storages) of one process, with and without
activation checkpointing, within 15% (issue 14, acceptance)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from bench.memory import KINDS, covering_batch, job_config, measure, predicted
from bench.plan_holds import small_train_set
from plait.models.units import unit_specs
from plait.planner.cost.types import OptimizerSpec, ParallelDegrees
from plait.planner.cost.sharding import rank_memory
from plait.planner.types import UnitCost
from plait.train.trainer import Trainer
from tests.helpers.jobs import ROOT


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def _unit_bytes(model, spec) -> int:
    seen = {}
    for name in spec.modules:
        for p in model.get_submodule(name).parameters():
            seen[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def test_predicted_parameter_bytes_per_rank_are_the_real_model_over_dp_shard(folder):
    train = small_train_set(ROOT / "data" / "demo" / "train.jsonl", 8, folder)
    trainer = Trainer.build(job_config("demo", 1, 1, "none", 4, str(train), str(folder / "params_run")))
    specs = unit_specs(trainer.model)
    units = [s.unit for s in specs]
    real = [_unit_bytes(trainer.model, s) for s in specs]
    costs = [UnitCost(1.0, 1.0, 1.0, param_bytes=b) for b in real]
    opt = OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8)
    trained = sum(b for u, b in zip(units, real) if u.trainable)
    frozen = sum(b for u, b in zip(units, real) if not u.trainable)
    assert trained > 0
    for shards in (1, 2, 4):
        memory = rank_memory(units, costs, ParallelDegrees(dp_shard=shards), dtype="fp32", optimizer=opt)
        assert memory.parameters == frozen + trained / shards  # every demo tensor splits evenly
        assert memory.gradients == trained / shards and memory.optimizer == 2 * trained / shards


@pytest.mark.parametrize("policy", ["none", "full"])
def test_planner_within_15_percent_of_measured_storages(folder, policy):
    torch.manual_seed(0)
    train = small_train_set(ROOT / "data" / "demo" / "train.jsonl", 8, folder)
    cfg = job_config("demo", 1, 1, policy, 4, str(train), str(folder / f"run_{policy}"))
    trainer = Trainer.build(cfg)
    got = measure(trainer, covering_batch(trainer, cfg.train.global_batch_size))
    pred = predicted(trainer, "DDP", got["rank_llm_tokens"])
    for kind in ("parameters", "gradients", "optimizer"):
        assert pred[kind] == pytest.approx(got[kind], rel=0.15), kind
    total = sum(got[k] for k in KINDS)
    assert sum(pred.values()) == pytest.approx(total, rel=0.15)
    assert pred["activations"] == pytest.approx(got["activations"], rel=0.15)
