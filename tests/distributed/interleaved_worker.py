"""Interleaved 1F1B cases for tests/distributed/test_interleaved_pipeline.py: 2 ranks each hold 2 LLM stages
(LLM stage j on rank j mod 2) and the encoder stage(s) sit on rank 0 with the first LLM stage. Per step: loss
and every trainable parameter's gradient equal the single-process reference (model, batches and checks from
tests/distributed/pipeline_worker.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from plait.models.units import model_units
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step
from plait.train.loss import token_loss_sum
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedule_ir import check_schedule
from plait.planner.pipeline.schedules import build_schedule
from tests.distributed.pipeline_worker import _check_grads, _close, apply_mode, make_batch, reference_step, tiny_model
from tests.distributed.spawning import gloo_group

# (name, layout, stages per module, stage ranks, mode, steps (kinds of each step's microbatches), options)
COLOC = ("encoders_colocated", {"vision": 1, "audio": 1, "llm": 4}, (0, 0, 1, 0, 1))
ENC_PAR = ("encoder_parallel", {"vision": 1, "audio": 1, "llm": 4}, (0, 0, 0, 1, 0, 1))
CASES = (
    ("coloc-projectors-m4", *COLOC, "projectors", (("iva", "t", "i", "a"), ("a", "i", "t", "ia")), {}),
    ("coloc-all-m3", *COLOC, "all", (("iva", "t", "i"), ("a", "ia", "t")), {}),
    ("encpar-llm-m5-split", *ENC_PAR, "llm", (("i", "a", "t", "ia", "iva"),), {"split_backward": True}),
    ("encpar-all-m4-group3", *ENC_PAR, "all", (("ia", "t", "i", "a"),), {"group_size": 3}),
)


def run_case(name, layout, stages_per_module, ranks, mode, steps, options) -> None:
    comm = build_pipeline_comm(2)
    model = apply_mode(tiny_model(), mode)
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), layout, stages_per_module=stages_per_module, ranks=ranks)
    assert plan.virtual_stages == 2, name
    stages = build_rank_stages(model, plan, comm.pp_rank)
    schedule = build_schedule(plan, "interleaved_1f1b", len(steps[0]), **options)
    check_schedule(schedule)
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2) if params else None
    ref_opt = torch.optim.AdamW([p for _, p in ref.trainable_parameters()], lr=1e-2)
    for step, kinds in enumerate(steps):
        where = f"{name} step {step} rank {dist.get_rank()}"
        batches = [make_batch(k, 100 * step + i) for i, k in enumerate(kinds)]
        targets = sum(b.target_tokens for b in batches)
        res = run_pipeline_step(stages, schedule, batches, targets, comm, loss_fn=token_loss_sum)
        _close(res.loss, reference_step(ref, batches), f"{where}: loss")
        compared = _check_grads(stages, ref, where)
        everything: list = [None] * dist.get_world_size()
        dist.all_gather_object(everything, compared)
        needed = {n for n, p in ref.trainable_parameters() if p.grad is not None}
        missing = needed - set().union(*map(set, everything))
        assert not missing, f"{where}: never compared {sorted(missing)[:5]}"
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad(set_to_none=True)


def worker(rank: int, world: int, port: int) -> None:
    """Entry point of one spawned process: run every case."""
    with gloo_group(rank, world, port):
        for case in CASES:
            run_case(*case)
