"""Heterogeneous data parallelism on 3 gloo processes: pipeline 0 runs 2 stages' ranks (ranks 0 and 1, the LLM
split across them, tied embeddings split too), pipeline 1 the whole model on rank 2; per step the loss, every
gradient and (after AdamW steps) every parameter equal one process training the same global batches
(spawned by tests/distributed/test_hetero_dp.py); then both pipelines with deferred samples (a
``FeatureRouting`` each)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.models.units import model_units
from plait.parallel.grad_sync import HeteroSync
from plait.parallel.hetero_dp import build_hetero_dp, clip_grad_norm_hetero, hetero_pipeline_comm
from plait.parallel.pipeline import run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum
from tests.distributed.pipeline_deferral_worker import SAMPLES, deferring_plan, make_sample, routed_microbatches, stack
from tests.distributed.pipeline_worker import _check_grads, _close, apply_mode, make_batch, reference_step, tiny_model
from tests.distributed.spawning import gloo_group

PIPELINES = ((0, 1), (2,))
PLANS = (  # (layout, stages per module, plan rank of each stage) per pipeline: different stage boundaries
    ("encoder_parallel", {"vision": 2, "audio": 1, "llm": 2}, (0, 1, 0, 1, 0)),
    ("encoders_colocated", {"vision": 1, "audio": 1, "llm": 1}, (0, 0)),
)
SPLIT = (2, 1)  # microbatches of pipeline 0 and pipeline 1 (water-filled shares of a global batch of 3)


@dataclass(frozen=True)
class HeteroCase:
    """A mode (``pipeline_worker.apply_mode``), tied embeddings or not, gradient clipping (0: none), the
    schedule of pipeline 0 and per step the kinds of the global batch's microbatches."""

    name: str
    mode: str
    tied: bool
    clip: float
    schedule: str
    steps: tuple[tuple[str, ...], ...]


CASES = (
    HeteroCase("all-tied-clip-1f1b", "all", True, 0.5, "1f1b", (("iva", "t", "i"), ("a", "ia", "t"))),
    HeteroCase("projectors-frozen-gpipe", "projectors", False, 0.0, "gpipe", (("i", "a", "iva"), ("ia", "t", "i"))),
)


def run_case(case: HeteroCase) -> None:
    """Train ``case`` on this rank and on a private one-process reference, checking loss, gradients and
    parameters every step."""
    rank = dist.get_rank()
    comm = hetero_pipeline_comm(PIPELINES)
    layout, per_module, ranks = PLANS[comm.dp_rank]
    model = apply_mode(tiny_model(case.tied), case.mode)
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), layout, stages_per_module=per_module, ranks=ranks)
    stages = build_rank_stages(model, plan, comm.pp_rank)
    hetero = build_hetero_dp(stages, comm)
    m = SPLIT[comm.dp_rank]
    schedule = build_schedule(plan, case.schedule if comm.dp_rank == 0 else "1f1b", m)
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2) if params else None
    ref_opt = torch.optim.AdamW([p for _, p in ref.trainable_parameters()], lr=1e-2)
    first = sum(SPLIT[: comm.dp_rank])
    null: set[str] = set()  # gradients 0 up to rounding (attention key biases: softmax is shift-invariant)
    for step, kinds in enumerate(case.steps):
        where = f"{case.name} step {step} rank {rank}"
        batches = [make_batch(k, 100 * step + i) for i, k in enumerate(kinds)]
        targets = sum(b.target_tokens for b in batches)
        res = run_pipeline_step(stages, schedule, batches[first:first + m], targets, hetero.comm, loss_fn=token_loss_sum,
                                sync=HeteroSync(hetero))
        _close(res.loss, reference_step(ref, batches), f"{where}: loss")
        _check_grads(stages, ref, where)
        null |= _null_gradients(ref)
        if case.clip:
            ref_norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in ref.trainable_parameters()], case.clip))
            _close(clip_grad_norm_hetero(hetero, case.clip), ref_norm, f"{where}: gradient norm")
            _check_grads(stages, ref, where + " after clipping")
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad(set_to_none=True)
    # AdamW divides by sqrt(v): on a gradient that is 0 up to rounding, rounding noise becomes a full +-lr step,
    # so those parameters (checked ~0 above every step) are left out of the final comparison
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, param in stages.model.named_parameters():
        if name in null:
            continue
        torch.testing.assert_close(param, ref_params[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda text: f"{case.name} rank {rank} final {name}\n{text}")


def run_deferral_case(mode: str, steps: int = 2) -> None:
    """Both pipelines run 2 microbatches of the hierarchical plan of :data:`SAMPLES` (dp 2: each pipeline one
    replica's share), which defers samples' LLM work to a later microbatch (``FeatureRouting`` inside each
    pipeline); loss and gradients equal one process on the samples in arrival order."""
    rank = dist.get_rank()
    comm = hetero_pipeline_comm(PIPELINES)
    layout, per_module, ranks = PLANS[comm.dp_rank]
    model = apply_mode(tiny_model(), mode)
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), layout, stages_per_module=per_module, ranks=ranks)
    stages = build_rank_stages(model, plan, comm.pp_rank)
    hetero = build_hetero_dp(stages, comm)
    schedule = build_schedule(plan, "1f1b", 2)
    # SGD, as tests/distributed/pipeline_deferral_worker.py: the deferred order sums gradients in another order and
    # AdamW turns the rounding noise of exactly-0 gradients (key biases) into full +-lr steps
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    ref_opt = torch.optim.SGD([p for _, p in ref.trainable_parameters()], lr=0.5)
    for step in range(steps):
        where = f"deferral-{mode} step {step} rank {rank}"
        mb_plan = deferring_plan(2, 2, step)
        samples = [make_sample(media, text, 100 * step + k) for k, (media, text) in enumerate(SAMPLES)]
        batches, routing, enc_batches = routed_microbatches(mb_plan, comm.dp_rank, samples)
        assert routing.defers, f"{where}: the plan defers nothing"
        targets = sum(b.target_tokens for b in samples)
        res = run_pipeline_step(stages, schedule, batches, targets, hetero.comm, routing=routing,
                                encoder_batches=enc_batches, loss_fn=token_loss_sum, sync=HeteroSync(hetero))
        per = -(-len(samples) // 4)
        _close(res.loss, reference_step(ref, [stack(samples[k:k + per]) for k in range(0, len(samples), per)]),
               f"{where}: loss")
        _check_grads(stages, ref, where)
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad(set_to_none=True)


def _null_gradients(ref) -> set[str]:
    """Names of the reference's parameters whose gradient is below 1e-7 of the largest (``_check_grads``'s rule)."""
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    largest = max(float(g.abs().max()) for g in grads.values())
    return {n for n, g in grads.items() if float(g.abs().max()) < 1e-7 * largest}


def worker(rank: int, world: int, port: int) -> None:
    """Entry point of one spawned process: every case."""
    with gloo_group(rank, world, port, timeout_s=60):
        for case in CASES:
            run_case(case)
        run_deferral_case("all")
