"""PipelineTrainer's checks of the launch and of parallel.pp.microbatches, on stand-ins (no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.parallel.dims import ParallelDims
from plait.parallel.process_group import DistInfo
from plait.train.pipeline_run import check_pipeline_microbatches
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.trainer import Trainer
from tests.helpers.jobs import tiny_config_dict


def job(**parallel):
    pp = {"degree": 2, **parallel.pop("pp", {})}
    return config_from_dict(tiny_config_dict("unused.jsonl", parallel={"pp": pp, **parallel},
                                             train={"global_batch_size": 32, "microbatch_size": 2}))


@pytest.mark.parametrize("dp, cp, world, needed", [(2, 1, 2, 4), (2, 1, 6, 4), (3, 2, 4, 12), (1, 1, 4, 2)])
def test_a_set_dp_asks_for_exactly_dp_x_pp_x_cp_processes(dp, cp, world, needed):
    fake = SimpleNamespace(cfg=job(dp=dp, cp=cp), info=SimpleNamespace(world_size=world))
    with pytest.raises(ValueError, match=rf"= {needed} processes does not fit the world size {world}: launch "
                                         rf"exactly {needed} processes, e.g. torchrun --nproc_per_node {needed} "):
        PipelineTrainer.layout(fake.cfg, fake.info.world_size)


def test_without_dp_any_multiple_of_pp_x_cp_is_asked_for():
    fake = SimpleNamespace(cfg=job(cp=2), info=SimpleNamespace(world_size=6))
    with pytest.raises(ValueError, match=r"launch a multiple of 4 processes, e.g. torchrun --nproc_per_node 4$"):
        PipelineTrainer.layout(fake.cfg, fake.info.world_size)


@pytest.mark.parametrize("microbatches, dp, samples, share", [(64, 1, 100, 32), (17, 2, 100, 16), (11, 1, 10, 10)])
def test_more_microbatches_than_a_replicas_samples_is_refused(microbatches, dp, samples, share):
    fake = SimpleNamespace(cfg=job(pp={"microbatches": microbatches}), dp=dp, train_set=[None] * samples)
    with pytest.raises(ValueError, match=rf"parallel.pp.microbatches={microbatches} is more than the {share} samples "
                                         rf".*global batch of {min(32, samples)} samples.*set parallel.pp.microbatches "
                                         rf"<= {share}"):
        check_pipeline_microbatches(fake.cfg, fake.dp, len(fake.train_set))


@pytest.mark.parametrize("microbatches, dp", [(32, 1), (16, 2), (0, 1)])
def test_up_to_one_sample_per_microbatch_is_accepted(microbatches, dp):
    fake = SimpleNamespace(cfg=job(pp={"microbatches": microbatches}), dp=dp, train_set=[None] * 100)
    check_pipeline_microbatches(fake.cfg, fake.dp, len(fake.train_set))


def test_both_trainers_take_their_layout_from_parallel_dims():
    assert PipelineTrainer.layout(job(cp=2), 8) == ParallelDims(dp=2, pp=2, cp=2)
    assert PipelineTrainer.layout(job(dp=1), 2) == ParallelDims(dp=1, pp=2, cp=1)
    with pytest.raises(ValueError, match="parallel.pp.degree=2: pipeline jobs run with PipelineTrainer"):
        Trainer.layout(job(), 2)
    single = config_from_dict(tiny_config_dict("unused.jsonl", parallel={"cp": 2}))
    assert Trainer.layout(single, 4) == ParallelDims(dp=2, pp=1, cp=2)
    with pytest.raises(ValueError, match="parallel.pp.degree=1 x parallel.cp=2 does not fit the world size 3"):
        Trainer.layout(single, 3)


@pytest.mark.parametrize("cls, pp", [(Trainer, 1), (PipelineTrainer, 2)])
def test_one_process_tp_names_heads_it_cannot_split_before_suggesting_a_launch(cls, pp):
    """parallel.tp=3 on the tiny model (4 query, 2 key/value heads): the one-process error says no launch helps
    instead of suggesting ``torchrun --nproc_per_node``; tp=2 divides the heads, so the launch is suggested."""
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"parallel.tp=3 does not divide the \d heads of .*: parallel.tp=3 cannot "
                                         r"work for this model with any number of processes") as err:
        cls.build(job(tp=3, pp={"degree": pp}), one)
    assert "torchrun" not in str(err.value)
    with pytest.raises(ValueError, match=rf"launch a multiple of {2 * pp} processes, e.g. torchrun --nproc_per_node"):
        cls.build(job(tp=2, pp={"degree": pp}), one)
