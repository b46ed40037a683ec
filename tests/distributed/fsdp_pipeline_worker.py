"""Worker for the PP x FSDP2 tests: train a job (config JSON) with ``PipelineTrainer`` (``Trainer`` when the job has
no pipeline), one fixed global batch first, then ``fit``; rank 0 writes what every rank holds, gathered: the first
step's full gradients, which DP x shard pipelines saw an image, the per-step losses, the full final parameters
(FSDP2 shards gathered over their shard ranks) and the FSDP2 group names per rank. The head's copy of an embedding
tied across pipeline ranks is left out of both (its gradient is the sum of the two copies' like the embedding's)
and written apart, per rank holding it, as ``tied_head``. With ``step_without`` (a modality) in the JSON, one more
step then runs on the samples without it (``fsdp_worker.step_without``: the branch's parameters, gradients kept and
AdamW state, merged over the ranks)."""

import json
import sys

import torch
import torch.distributed as dist

from plait.config.loader import config_from_dict
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer
from tests.distributed.fsdp_worker import full, step_without


def gathered(part: dict) -> list:
    """Every rank's ``part`` on rank 0 (``[part]`` without a process group)."""
    if not dist.is_initialized():
        return [part]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, out, dst=0)
    return out or []


def merged(parts: list) -> dict:
    """One dict from every rank's (a tied embedding's copies are equal after their gradient sum)."""
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def merged_without(parts: list) -> dict:
    """Every rank's ``step_without`` result as one (empty without one)."""
    return {"params": merged([p["params"] for p in parts]), "state": merged([p["state"] for p in parts]),
            "grads": sorted({n for p in parts for n in p["grads"]})}


def main(config_path: str, out_path: str) -> None:
    data = json.loads(open(config_path).read())
    without = data.pop("step_without", None)
    cfg = config_from_dict(data)
    trainer = (PipelineTrainer if cfg.parallel.pp.degree > 1 else Trainer).build(cfg)
    first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
    plan, _ = trainer.plan_step(first)
    trainer.forward_backward(first, plan)
    tied = getattr(getattr(trainer, "stages", None), "tied", None)
    mirror = tied.param if tied is not None and tied.mirror else None  # the head's copy of a tied embedding
    grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None and p is not mirror}
    images = [sum(any(e == "vision" for e, _ in trainer.train_set.sample_meta(first[k]).items)
                  for mb in plan.microbatches[r] for k in mb) for r in range(plan.dp)]
    if trainer.optimizer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.fit()
    params = {n: full(p) for n, p in trainer.model.named_parameters() if p is not mirror}
    groups = list(trainer.sharded.names) if trainer.sharded is not None else []
    head = {"head": full(mirror)} if mirror is not None else {}
    extra = {"without": step_without(trainer, without)} if without is not None else {}
    parts = gathered({"grads": grads, "params": params, "groups": groups, **head, **extra})
    if trainer.info.is_main:
        torch.save({"world": trainer.info.world_size, "sharded": trainer.sharded is not None, "dp": plan.dp,
                    "deferred": plan.deferred(), "images_per_rank": images, "losses": result["losses"],
                    "grads": merged([p["grads"] for p in parts]), "params": merged([p["params"] for p in parts]),
                    "groups": [p["groups"] for p in parts], "tied_head": [p["head"] for p in parts if "head" in p],
                    "without": merged_without([p["without"] for p in parts if "without" in p])},
                   out_path)
    if trainer.info.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
