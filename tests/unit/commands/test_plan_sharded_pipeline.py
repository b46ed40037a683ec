"""A plan with FSDP2-sharded pipeline stages (``plan_parallel`` choosing ``dp_shard`` > 1 with ``pp`` > 1) emits a
``[parallel]`` + ``[parallel.pp]`` snippet that loads and lays the job out as planned."""

from __future__ import annotations

import dataclasses
from plait.models.plan_inputs import build_plan_inputs
from plait.commands.plan.snippet import pp_snippet
from plait.config.loader import load_config
from plait.parallel.dims import ParallelDims
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.train.pipeline_trainer import PipelineTrainer
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def test_sharded_pipeline_plan_snippet_loads_as_planned(tmp_path):
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    machine = Machine(dtype=inputs.dtype)
    space = SearchSpace(dp_degrees=[2], virtual_stages=(1,))
    common = dict(microbatches=4)
    plain = plan_layout(inputs.units, inputs.costs, 8, machine=machine, space=space, **common)
    cap = 0.9 * max(plain.stage_memory_bytes)  # 8 devices, 4 microbatches: FSDP2 without stages cannot run
    choice = plan_parallel(inputs.units, inputs.costs, 8, machine=dataclasses.replace(machine, memory_cap=cap),
                           space=dataclasses.replace(space, tp_degrees=[1], dp_shard_degrees=[2],
                                                     checkpointing=["none"], prefer_plain=False), **common)
    assert (choice.dp, choice.dp_shard, choice.plan.num_ranks) == (2, 2, 4) and choice.fits_memory
    snippet, why = pp_snippet(cfg, choice, inputs.units, inputs.unit_source)
    assert snippet is not None, why
    assert "8 processes = dp 1 x dp_shard 2 x pp 4 x tp 1" in snippet.splitlines()[0]
    job = tmp_path / "job.toml"  # the tables pasted in place of the job's [parallel] keys
    job.write_text(DEMO.read_text() + "\n" + snippet)
    planned = load_config(job)
    assert PipelineTrainer.layout(planned, 8) == ParallelDims(dp=1, pp=4, dp_shard=2)
    assert planned.parallel.pp.microbatches == choice.microbatches_per_replica == 2
