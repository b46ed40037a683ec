"""Worker for the expert-parallel tests: train a job (config JSON) with ``Trainer`` (``PipelineTrainer`` under PP) on
one fixed global batch, then ``fit``; rank 0 writes the per-step losses, the first step's full gradients and the
full final parameters (expert and FSDP2 shards gathered; under PP merged over the pipeline ranks), the shape of an
experts module's local shard and the trainable parameter names. With ``resume_from`` in the JSON it resumes that
checkpoint and trains the remaining steps instead. With ``experts_of_rank0`` true every router's choice is folded
onto experts 0 and 1 (``index % 2``, a forward hook: in one process too), so with ``parallel.ep = 2`` the second EP
rank's experts get no token. Further ``config out`` argument pairs train further jobs in the same processes, one
after the other (one spawn for several jobs; the process group is kept)."""

import json
import sys

import torch
import torch.distributed as dist

from plait.config.loader import config_from_dict
from plait.parallel.expert_parallel import experts_modules
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer
from tests.distributed.fsdp_pipeline_worker import gathered, merged
from tests.distributed.fsdp_worker import full


def fold_routes(model: torch.nn.Module) -> None:
    """Every router's top-k expert ids taken modulo 2 (its outputs ``(logits, weights, indices)``)."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.register_forward_hook(lambda _m, _i, out: (out[0], out[1], out[2] % 2))


def main(config_path: str, out_path: str, *more: str) -> None:
    for path, out in [(config_path, out_path), *zip(more[::2], more[1::2])]:
        train(path, out)
    if dist.is_initialized():
        dist.destroy_process_group()


def train(config_path: str, out_path: str) -> None:
    """Train the job of ``config_path`` and write its results to ``out_path`` (module docstring)."""
    data = json.loads(open(config_path).read())
    resume_from = data.pop("resume_from", None)
    fold = data.pop("experts_of_rank0", False)
    cfg = config_from_dict(data)
    trainer = (PipelineTrainer if cfg.parallel.pp.degree > 1 else Trainer).build(cfg)
    if fold:
        fold_routes(trainer.model)
    grads: dict = {}
    if resume_from is None:
        first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
        plan, _ = trainer.plan_step(first)
        trainer.forward_backward(first, plan)
        grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        if trainer.optimizer is not None:
            trainer.optimizer.zero_grad(set_to_none=True)
        result = trainer.fit()
    else:
        result = trainer.fit(resume=resume_from)
    params = {n: full(p) for n, p in trainer.model.named_parameters()}
    local = [tuple(m.gate_up_proj.to_local().shape) if trainer.experts is not None else tuple(m.gate_up_proj.shape)
             for _, m in experts_modules(trainer.model)]
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    parts = gathered({"grads": grads, "params": params, "local": local, "trained": trained})
    if trainer.info.is_main:
        torch.save({"world": trainer.info.world_size, "losses": result["losses"],
                    "start": result["step"] - result["steps"], "grads": merged([p["grads"] for p in parts]),
                    "params": merged([p["params"] for p in parts]), "local": [p["local"] for p in parts],
                    "trained": sorted({n for p in parts for n in p["trained"]}),
                    "sharded": trainer.sharded is not None}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
