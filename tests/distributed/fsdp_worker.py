"""Worker for the FSDP2 tests: train a job (config JSON) on one fixed global batch, then ``fit``; rank 0 writes the
first step's plan (deferred samples), full gradients, which DP ranks saw an image, the per-step losses and the
full final parameters (sharded tensors gathered), the FSDP2 group names, the parameters left replicated and
whether every group offloads to the host or reduce-scatters after every microbatch, which groups keep their gathered
parameters from forward to backward (``parallel.fsdp_reshard``) and how many all-gathers the first step ran. With ``resume_from`` in the JSON, it first resumes that
checkpoint (written with another layout) and trains the remaining steps instead. With ``step_without`` (a modality)
it then runs one more step on the samples without that modality (:func:`step_without`)."""

import json
from contextlib import contextmanager
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter or gradient; collective for a DTensor."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@contextmanager
def counted_all_gathers():
    """Within: ``dist.all_gather_single`` calls (FSDP2's parameter all-gathers) counted in the yielded list's item."""
    count, original = [0], dist.all_gather_single

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_gather_single = counting
    try:
        yield count
    finally:
        dist.all_gather_single = original


def step_without(trainer, modality: str) -> dict:
    """One more optimizer step on the training samples with no item of ``modality`` (a global batch that never
    runs its encoder branch); returns that branch's full parameters, the names of those that got a gradient in
    the step's backward, and its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``; gathered) after the step.
    Collective."""
    meta = trainer.train_set.sample_meta
    indices = [i for i in range(len(trainer.train_set)) if all(e != modality for e, _ in meta(i).items)]
    named = [(n, p) for n, p in trainer.model.named_parameters() if n.startswith(f"encoders.{modality}.")]
    trainer.forward_backward(indices, trainer.plan_step(indices)[0])
    kept = [n for n, p in named if p.grad is not None]
    trainer.optimizer_step()
    state = trainer.optimizer.state if trainer.optimizer is not None else {}  # a pipeline rank may train nothing
    states = {n: state.get(p, {}) for n, p in named}
    return {"params": {n: full(p) for n, p in named}, "grads": kept,
            "state": {n: {k: full(v) for k, v in sorted(st.items())} for n, st in states.items()}}


def main(config_path: str, out_path: str) -> None:
    data = json.loads(open(config_path).read())
    resume_from = data.pop("resume_from", None)
    without = data.pop("step_without", None)
    cfg = config_from_dict(data)
    trainer = Trainer.build(cfg)
    out: dict = {"world": trainer.info.world_size, "sharded": trainer.sharded is not None}
    if resume_from is None:
        first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
        plan, _ = trainer.plan_step(first)
        with counted_all_gathers() as gathers:
            trainer.forward_backward(first, plan)
        out["all_gathers"] = gathers[0]
        out["grads"] = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        images = [sum(any(e == "vision" for e, _ in trainer.train_set.sample_meta(first[k]).items)
                      for mb in plan.microbatches[r] for k in mb) for r in range(plan.dp)]
        out.update(deferred=plan.deferred(), dp=plan.dp, images_per_rank=images)
        trainer.optimizer.zero_grad(set_to_none=True)
        result = trainer.fit()
    else:
        result = trainer.fit(resume=resume_from)
    out["losses"], out["start"] = result["losses"], result["step"] - result["steps"]
    out["params"] = {n: full(p) for n, p in trainer.model.named_parameters()}
    if without is not None:
        out["without"] = step_without(trainer, without)
    out["groups"] = list(trainer.sharded.names) if trainer.sharded is not None else []
    out["replicated"] = len(trainer.sharded.replicated) if trainer.sharded is not None else 0
    states = [s for g in (trainer.sharded.all_groups() if trainer.sharded is not None else [])
              for s in g._get_fsdp_state()._fsdp_param_groups]
    out["reduce_each_microbatch"] = trainer.sharded is not None and trainer.sharded.reduce_each_microbatch
    out["kept_after_forward"] = [s.post_forward_mesh_info is None for s in states]
    out["offloaded"] = bool(states) and all(isinstance(s.offload_policy, CPUOffloadPolicy) for s in states)
    if trainer.info.is_main:
        torch.save(out, out_path)
    if trainer.info.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
