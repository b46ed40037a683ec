"""Activation checkpointing under pipeline parallelism (issue 14, item 4): 2 gloo processes, PP = 2, in every
freezing mode (all trainable; frozen encoders + trainable projectors and LLM; frozen LLM + trainable encoders;
only the projectors), fused 1F1B and split dX/dW backward, and with deferred encoder outputs: the checkpointed
pipeline's gradients equal the same pipeline without checkpointing (fp32, 1e-6) and one process (1e-5, as the
other pipeline tests), and only layer units that run a backward are checkpointed."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from plait.models.units import model_units
from plait.parallel.activation_checkpointing import apply_activation_checkpointing
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum
from tests.distributed import pipeline_deferral_worker as dw
from tests.distributed.pipeline_worker import COLOC, ENC_PAR, _check_grads, _close, make_batch, reference_step
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait
from tests.helpers.checkpointing import MODES, frozen_model

BATCHES = ("iva", "t", "ia")
# (name, layout, schedule options, policy)
CASES = (
    ("encpar-1f1b-full", ENC_PAR, {}, "full"),
    ("coloc-split-full", COLOC, {"split_backward": True, "defer_weight_grad": True}, "full"),
    ("encpar-1f1b-selective", ENC_PAR, {}, "selective"),
)


def _run(mode: str, layout: dict, options: dict, policy: str, comm, deferral: bool = False):
    """This rank's loss and gradients after one step of the PP = 2 pipeline, plus the reference model."""
    model = frozen_model(mode)
    ref = copy.deepcopy(model)
    units = model_units(model)
    done = apply_activation_checkpointing(model, policy)
    assert all(u.runs_backward and u.kind == "layer" for u in units if u.name in done)
    plan = plan_pipeline(units, layout["layout"], stages_per_module=layout["stages_per_module"],
                         ranks=layout["ranks"])
    stages = build_rank_stages(model, plan, comm.pp_rank)
    schedule = build_schedule(plan, "1f1b", 3, **options)
    if deferral:
        samples = [dw.make_sample(m, t, k) for k, (m, t) in enumerate(dw.SAMPLES)]
        batches, routing, enc_batches = dw.routed_microbatches(dw.deferring_plan(1, 3, 0), 0, samples)
        res = run_pipeline_step(stages, schedule, batches, sum(b.target_tokens for b in samples), comm,
                                routing=routing, encoder_batches=enc_batches, loss_fn=token_loss_sum)
        expected = reference_step(ref, [dw.stack(samples[k : k + 3]) for k in range(0, 7, 3)])
    else:
        batches = [make_batch(k, i) for i, k in enumerate(BATCHES)]
        res = run_pipeline_step(stages, schedule, batches, sum(b.target_tokens for b in batches), comm,
                                loss_fn=token_loss_sum)
        expected = reference_step(ref, batches)
    grads = {n: p.grad.clone() for n, p in stages.trainable_parameters() if p.grad is not None}
    return res.loss, grads, stages, ref, expected


def _check_case(mode: str, name: str, layout: dict, options: dict, policy: str, comm, deferral: bool) -> None:
    where = f"{name} {mode}{' deferral' if deferral else ''} rank {dist.get_rank()}"
    plain_loss, plain, _, _, _ = _run(mode, layout, options, "none", comm, deferral)
    loss, grads, stages, ref, expected = _run(mode, layout, options, policy, comm, deferral)
    _close(loss, expected, f"{where}: loss")
    assert abs(loss - plain_loss) <= 1e-6 * abs(plain_loss), where
    assert grads.keys() == plain.keys(), where
    for n, g in plain.items():
        torch.testing.assert_close(grads[n], g, rtol=0, atol=1e-6, msg=lambda text: f"{where}: {n}\n{text}")
    _check_grads(stages, ref, where)


def worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port, timeout_s=60):
        comm = build_pipeline_comm(2)
        for mode in MODES:
            for name, layout, options, policy in CASES:
                _check_case(mode, name, layout, options, policy, comm, deferral=False)
        for mode in ("all", "frozen-encoders"):
            _check_case(mode, "encpar-1f1b-full", ENC_PAR, {}, "full", comm, deferral=True)


def test_checkpointed_pipeline_equals_no_checkpointing_and_one_process():
    spawn_and_wait(worker, (2, free_port()), 2, 240, "activation checkpointing PP=2 test")


def test_plait_train_pp2_with_checkpointing_trains_like_one_process_without(tmp_path):
    """The PipelineTrainer's setup applies the job's fields (``train.activation_checkpointing = "full"``, the LLM
    overridden to ``"selective"``): ``plait train`` under torchrun, PP = 2, has the losses of one process without
    checkpointing."""
    from plait.config.loader import config_from_dict
    from plait.train.trainer import Trainer
    from tests.helpers.pipeline_training import job_dict, losses_of, torchrun_train

    job = job_dict(tmp_path, "single")
    job["data"]["val"] = None
    ref = Trainer.build(config_from_dict(job)).fit()
    job = job_dict(tmp_path, "pp")
    job["data"]["val"] = None
    job["train"]["activation_checkpointing"] = "full"
    job["model"]["llm"]["activation_checkpointing"] = "selective"
    job["parallel"]["pp"] = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}
    torchrun_train(job, tmp_path, "pp")
    losses = losses_of(tmp_path / "pp")
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
