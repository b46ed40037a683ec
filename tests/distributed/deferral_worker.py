"""Worker for the deferral tests: train a job (config JSON) on one fixed global batch; rank 0 writes the first
step's plan (deferred samples), gradients and buffered bytes, the per-step losses and the final parameters."""

import json
import sys

import torch

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer


def main(config_path: str, out_path: str) -> None:
    cfg = config_from_dict(json.loads(open(config_path).read()))
    trainer = Trainer.build(cfg)
    first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
    plan, _ = trainer.plan_step(first)
    trainer.forward_backward(first, plan)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    buffered = torch.tensor([trainer.encoder_buffer_peak_bytes])
    trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.fit()
    if trainer.info.world_size > 1:
        torch.distributed.all_reduce(buffered, op=torch.distributed.ReduceOp.MAX)
    if trainer.info.is_main:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save({"losses": result["losses"], "params": params, "grads": grads, "world": trainer.info.world_size,
                    "deferred": plan.deferred(), "dp": plan.dp, "buffered": int(buffered)}, out_path)
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
