"""``parallel.plan = "auto"`` follows ``plait plan``: for the same job and costs both choose the same plan, here on a
job where only FSDP2-sharded pipeline stages fit and on a model where only FSDP2 CPU offload fits
(``planner.auto_plan.plan_auto_layout`` runs ``search_parallel.plan_parallel`` with its filling layout search)."""

from __future__ import annotations

import dataclasses
import copy
import io

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.config.schema import JobConfig, PipelineConfig
from plait.parallel.dims import ParallelDims
from plait.planner.search.auto_layout import AUTO_MACHINE, plan_auto_layout
from plait.planner.cost.types import DeviceSpec, ParallelDegrees
from plait.planner.report import pp_toml
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.planner.cost.sharding import rank_memory
from plait.planner.pipeline.types import P2PModel
from plait.train.apply_plan import apply_layout_choice, resolve_auto_plan
from plait.train.pipeline_trainer import PipelineTrainer
from tests.helpers.jobs import ROOT
from tests.helpers.sharding import vit_llm

DEMO = ROOT / "configs" / "demo.toml"
JOB = ["--train.microbatch_size=8", "--train.activation_checkpointing=full"]  # 32 samples: 4 microbatches
CAP = 13.5e6  # bytes per device: 8 pipeline ranks need 13.6 MB, dp 1 x dp_shard 2 x pp 4 needs 13.0 MB


def test_auto_plan_and_plait_plan_choose_the_same_sharded_pipeline():
    spec = DeviceSpec.cpu()
    fraction = CAP / spec.memory_bytes
    out = io.StringIO()
    setup = plan_setup(DEMO, 8, overrides=JOB, device=spec, memory_fraction=fraction, stream=out)
    units, costs, machine = setup.inputs.units, setup.inputs.costs, setup.machine
    assert machine.memory_cap == pytest.approx(CAP)
    with pytest.raises(ValueError, match="no plan fits"):  # without sharding nothing fits, with any TP degree
        plan_parallel(units, costs, 8, microbatches=4, machine=machine,
                      space=SearchSpace(dp_shard_degrees=[1], base_checkpointing="full"))
    flat = rank_memory(units, costs, ParallelDegrees(dp_shard=2, checkpointing="full"), dtype=setup.inputs.dtype)
    assert flat.total > CAP  # every rank a DP rank (pp = 1) does not fit either: the whole model's activations

    planned = plan_command(DEMO, 8, overrides=JOB, device=spec, memory_fraction=fraction, profile_store=None,
                           out=out)
    cfg = copy.deepcopy(setup.cfg)
    cfg.parallel.plan = "auto"
    resolved, auto = resolve_auto_plan(cfg, 8, units, costs, machine=dataclasses.replace(
        AUTO_MACHINE, p2p=machine.p2p, dp_link=machine.dp_link, memory_cap=machine.memory_cap, dtype=setup.inputs.dtype,
        overheads=machine.overheads))
    assert (auto.dp, auto.dp_shard, auto.tp, auto.plan.num_ranks, auto.checkpointing) == (2, 2, 1, 4, "full")
    assert (planned.dp, planned.dp_shard, planned.tp, planned.checkpointing) == (2, 2, 1, "full")
    assert [(s.units, s.rank) for s in auto.plan.stages] == [(s.units, s.rank) for s in planned.plan.stages]
    assert auto.iteration_s == pytest.approx(planned.iteration_s, rel=1e-12)
    assert auto.iteration_s == pytest.approx(0.1762, abs=5e-4)
    assert max(auto.stage_memory_bytes) <= CAP and auto.shard_buffer_bytes == 0
    assert "8 processes = dp 1 x dp_shard 2 x pp 4 x tp 1" in out.getvalue()
    assert (resolved.parallel.dp, resolved.parallel.dp_shard, resolved.parallel.tp) == (1, 2, 1)
    assert isinstance(resolved.parallel.pp, PipelineConfig) and resolved.parallel.pp.microbatches == 2  # per DP rank
    assert PipelineTrainer.layout(resolved, 8) == ParallelDims(dp=1, pp=4, dp_shard=2)


def test_auto_plan_keeps_the_jobs_own_degrees_as_plait_plan_does():
    out = io.StringIO()
    setup = plan_setup(DEMO, 4, overrides=["--parallel.dp_shard=2"], device=DeviceSpec.cpu(), stream=out)
    machine = setup.machine
    cfg = copy.deepcopy(setup.cfg)
    cfg.parallel.plan = "auto"
    _, auto = resolve_auto_plan(cfg, 4, setup.inputs.units, setup.inputs.costs, machine=dataclasses.replace(
        AUTO_MACHINE, p2p=machine.p2p, dp_link=machine.dp_link, memory_cap=machine.memory_cap, dtype=setup.inputs.dtype,
        overheads=machine.overheads))
    planned = plan_command(DEMO, 4, overrides=["--parallel.dp_shard=2"], device=DeviceSpec.cpu(),
                           profile_store=None, out=out)
    assert (auto.dp_shard, auto.tp) == (planned.dp_shard, planned.tp) == (2, 1)  # the plain plan fits, yet kept
    assert (auto.dp, auto.plan.num_ranks) == (planned.dp, planned.plan.num_ranks)
    cfg.parallel.dp_shard = 3
    with pytest.raises(ValueError, match="parallel.dp_shard = 3 does not divide the 4 processes"):
        resolve_auto_plan(cfg, 4, setup.inputs.units, setup.inputs.costs)


def test_auto_plan_offloads_where_plait_plan_does_and_writes_it():
    units, costs = vit_llm()  # nothing fits 4 devices at a tenth of the whole model's memory, except FSDP2 CPU offload
    link = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)
    cap = 0.1 * sum(plan_layout(units, costs, 1, microbatches=8).stage_memory_bytes)
    planned = plan_parallel(units, costs, 4, microbatches=8,
                            machine=Machine(memory_cap=cap, p2p=link, dp_link=link, dtype="float32"),
                            space=SearchSpace(virtual_stages=(1, 2, 4), attach_encoders=True))
    auto = plan_auto_layout(units, costs, 4, 8, machine=dataclasses.replace(AUTO_MACHINE, memory_cap=cap, p2p=link,
                                                                            dp_link=link))
    assert (auto.offload, auto.dp, auto.dp_shard, auto.tp, auto.plan.num_ranks) == ("cpu", 4, auto.dp_shard, 1, 1)
    assert (planned.offload, planned.dp, planned.dp_shard, planned.checkpointing) == \
        (auto.offload, auto.dp, auto.dp_shard, auto.checkpointing)
    assert auto.iteration_s == pytest.approx(planned.iteration_s, rel=1e-12) and auto.dp_shard > 1
    cfg = apply_layout_choice(JobConfig(), auto, units)
    assert (cfg.parallel.offload, cfg.parallel.dp_shard, cfg.parallel.dp) == ("cpu", auto.dp_shard, 4 // auto.dp_shard)
    table = pp_toml({"degree": 1}, auto.dp, dict(dp=cfg.parallel.dp, dp_shard=auto.dp_shard, tp=1, offload="cpu"))
    assert 'offload = "cpu"\n' in table and "offload" not in pp_toml({"degree": 1}, 4, dict(dp=4, dp_shard=1, tp=1))
