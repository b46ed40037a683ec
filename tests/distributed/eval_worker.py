"""Worker for the evaluation tests: train a job (config JSON) for its steps (``fit`` validates at the end) and
check, at every forward-only pipeline pass and after ``fit``, that the only live materialised parameters of this
process are its trainer's (no rank builds parameters outside its stages). Rank 0 writes the evaluation report and
the predictions file's lines."""

import gc
import warnings
import json
import sys

import torch

import plait.train.replica_eval as replica_eval
from plait.config.loader import config_from_dict
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer


def live_parameters() -> set[int]:
    """ids of every live materialised (non-meta) ``nn.Parameter`` of this process."""
    gc.collect()
    warnings.simplefilter("ignore", FutureWarning)  # isinstance on deprecated torch objects warns
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Parameter) and o.device.type != "meta"}


def main(config_path: str, out_path: str) -> None:
    cfg = config_from_dict(json.loads(open(config_path).read()))
    cls = PipelineTrainer if cfg.parallel.pp.degree > 1 else Trainer
    trainer = cls.build(cfg)
    owned = {id(p) for p in trainer.model.parameters() if p.device.type != "meta"}
    calls = [0]
    if cls is PipelineTrainer:
        run = replica_eval.run_pipeline_forward  # the one forward-only pass of every pipeline evaluation

        def checked(*args, **kwargs):
            if calls[0] == 0 or calls[0] % 5 == 0:
                extra = live_parameters() - owned
                if extra:
                    raise AssertionError(f"rank {trainer.info.rank}: {len(extra)} parameters outside its stages")
            calls[0] += 1
            return run(*args, **kwargs)

        replica_eval.run_pipeline_forward = checked
    result = trainer.fit()
    extra = live_parameters() - owned
    assert not extra, f"rank {trainer.info.rank}: {len(extra)} parameters outside its stages after evaluate"
    all_params = sum(p.numel() for p in trainer.model.parameters() if p.device.type != "meta")
    if trainer.info.is_main:
        report = trainer.last_eval
        lines = open(report.predictions_path).read().splitlines()
        torch.save({"eval": result["eval"], "report": report, "predictions": [json.loads(x) for x in lines],
                    "forward_calls": calls[0], "params": all_params, "world": trainer.info.world_size}, out_path)
    if trainer.info.world_size > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
