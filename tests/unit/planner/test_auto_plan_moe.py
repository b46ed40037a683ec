"""``parallel.plan = "auto"`` picks expert parallelism where ``plait plan`` does: the demo job with a 64-expert
Qwen3-MoE LLM on 8 devices of 73.7 MiB fits only with the experts split (``tests/unit/commands/test_plan_moe.py``);
the auto plan given the job's MoE layers (``plan_search.job_expert_layers``) chooses the same EP degree and layout as
``plait plan``, writes ``parallel.ep`` into the job, and the trainer's layout takes it; without the MoE layers the
same search finds no fitting plan with the experts whole (or only one with CPU offload)."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.config.loader import validate
from plait.planner.search.auto_layout import AUTO_MACHINE
from plait.planner.search.types import NoPlanFits
from plait.train.apply_plan import resolve_auto_plan
from plait.train.plan_search import job_expert_layers
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer
from tests.helpers.moe import DEMO, OVERRIDES, TIGHT


def test_auto_plan_chooses_expert_parallelism_as_plait_plan_does(tmp_path):
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=TIGHT)
    planned = plan_command(DEMO, 8, tmp_path / "plan.json", device=TIGHT, out=io.StringIO(), profile_store=None,
                           overrides=OVERRIDES)
    units, costs, machine = setup.inputs.units, setup.inputs.costs, setup.machine
    experts = job_expert_layers(setup.cfg, units, TIGHT, setup.inputs.dtype)
    assert len(experts) == 4 and all(e.experts == 64 and not e.load for e in experts)
    cfg = copy.deepcopy(setup.cfg)
    cfg.parallel.plan = "auto"
    auto_machine = dataclasses.replace(AUTO_MACHINE, p2p=machine.p2p, dp_link=machine.dp_link,
                                       shard_link=machine.shard_link, memory_cap=machine.memory_cap,
                                       dtype=setup.inputs.dtype, overheads=machine.overheads)
    resolved, auto = resolve_auto_plan(cfg, 8, units, costs, machine=auto_machine, experts=experts)
    assert auto.ep == planned.ep > 1 and auto.fits_memory and auto.offload != "cpu"
    assert (auto.dp, auto.dp_shard, auto.tp, auto.plan.num_ranks) == (
        planned.dp, planned.dp_shard, planned.tp, planned.plan.num_ranks)
    assert auto.iteration_s == pytest.approx(planned.iteration_s, rel=1e-9)
    par = resolved.parallel
    assert (par.ep, par.dp * par.dp_shard, par.tp, par.plan) == (auto.ep, auto.dp, 1, "manual")
    validate(resolved)
    trainer = PipelineTrainer if par.pp.degree > 1 else Trainer
    assert trainer.layout(resolved, 8).ep == auto.ep
    # the same search without the MoE layers keeps every expert on every rank: nothing fits without offload
    try:
        _, whole = resolve_auto_plan(cfg, 8, units, costs, machine=auto_machine)
    except NoPlanFits:
        return
    assert whole.ep == 1 and whole.offload == "cpu"


def test_a_job_without_experts_has_no_expert_layers():
    setup = plan_setup(DEMO, 2, device="cpu-preset")
    assert job_expert_layers(setup.cfg, setup.inputs.units, "cpu", setup.inputs.dtype) == ()
