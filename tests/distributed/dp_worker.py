"""Worker for the DP test: train a job (config JSON) and write losses and final parameters (rank 0)."""

import json
import sys

import torch

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer


def main(config_path: str, out_path: str) -> None:
    cfg = config_from_dict(json.loads(open(config_path).read()))
    trainer = Trainer(cfg)
    result = trainer.fit()
    if trainer.info.is_main:
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.save({"losses": result["losses"], "params": params, "world": trainer.info.world_size}, out_path)
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
