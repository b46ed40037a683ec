"""Worker of the trainer-level tensor-parallel tests (torchrun): train a job (config JSON); every rank gathers the
first step's gradients and the final parameters as full tensors (DTensor shards reassembled, a collective), rank 0
writes them with the per-step losses. With a third argument, the run is resumed from the
newest checkpoint of its run folder (saved under another layout) and trained to its end."""

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from plait.config.loader import config_from_dict
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _trainer(cfg):
    return (PipelineTrainer if cfg.parallel.pp.degree > 1 else Trainer).build(cfg)


def _gathered(named: dict) -> dict:
    """Every rank's ``{name: full tensor}`` merged on rank 0 (pipeline ranks hold different stages)."""
    if not torch.distributed.is_initialized():
        return named
    parts = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(named, parts, dst=0)
    return {k: v for part in parts or [] for k, v in part.items()}


def _named(trainer):
    return [(n, p) for n, p in trainer.model.named_parameters() if not p.is_meta]


def main(config_path: str, out_path: str, resume: str = "") -> None:
    cfg = config_from_dict(json.loads(open(config_path).read()))
    trainer = _trainer(cfg)
    grads = {}
    if not resume:
        first = trainer.loader.epoch_order(0)[: cfg.train.global_batch_size].tolist()
        trainer.forward_backward(first)
        grads = _gathered({n: _full(p.grad) for n, p in _named(trainer) if p.grad is not None})
        for _, p in _named(trainer):
            p.grad = None
    result = trainer.fit(resume=bool(resume))
    params = _gathered({n: _full(p) for n, p in _named(trainer)})
    sharded = sorted(_gathered({n: 0 for n, p in _named(trainer) if isinstance(p, DTensor)}))
    exported = {}
    if trainer.info.is_main:  # what plait train exports to final/ (rank 0, after fit): the whole model, saved
        whole = trainer.full_model()
        whole.save_pretrained(out_path + ".final")
        exported = {n: p.detach().clone() for n, p in whole.named_parameters()}
    if trainer.info.is_main:
        last = getattr(trainer, "last_eval", None)
        evals = {"loss": last.loss_overall, "exact": last.exact_match_overall, "samples": last.samples} if last else {}
        torch.save({"losses": result["losses"], "params": params, "grads": grads, "sharded": sharded, "eval": evals,
                    "world": trainer.info.world_size, "exported": exported}, out_path)
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
