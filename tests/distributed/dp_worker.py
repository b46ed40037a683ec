"""Worker for the DP/CP tests: train a job (config JSON); rank 0 writes the first step's gradients, the
per-step losses and the final parameters."""

import json
import sys

import torch

from plait.config.loader import config_from_dict
from plait.parallel.grad_sync import BucketSync
from plait.train.trainer import Trainer


def main(config_path: str, out_path: str) -> None:
    cfg = config_from_dict(json.loads(open(config_path).read()))
    trainer = Trainer.build(cfg)
    first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
    trainer.forward_backward(first)
    sync = trainer.sync  # DP: buckets started during the backward (overlapped)
    early = sync.reducer.started_early if isinstance(sync, BucketSync) else 0
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.fit()
    if trainer.info.is_main:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save({"losses": result["losses"], "params": params, "grads": grads,
                    "world": trainer.info.world_size, "early": early}, out_path)
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
