"""Pipeline x context parallelism: PP 2 x CP 2 on 4 gloo processes equals one process on the same global
batches (fp32, relative tolerance 1e-5 on losses, every trainable parameter's gradient and the clipped norm).

The spawned job (``cp_worker`` in tests/distributed/pipeline_worker.py) runs three cases on images + audio +
text microbatches with the ``bidirectional_items`` mask and LPT token distribution over blocks of 4 tokens
(uneven shards, checked): encoder_parallel with the LLM split over both pipeline ranks, tied embeddings and
gradient clipping (1F1B); the same with frozen encoders and LLM, trainable projectors (GPipe; coordinates from
a ``("dp", "pp", "cp")`` DeviceMesh); encoders_colocated with packed documents and split backward (1F1B).
Each case runs 2 optimizer steps (SGD) of 2 microbatches (gradient accumulation). The rank layout
``(dp * pp + pp_rank) * cp + cp_rank`` is checked too. ``plait train`` with PP 2 x CP 2 (4 ranks with torchrun's
variables) logs the single-process losses; an LLM stage without its CP shard is refused.
"""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.models.units import model_units
from plait.parallel.context import build_cp_shard
from plait.parallel.pipeline import PipelineComm, run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum
from plait.train.metrics import read_metrics
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.distributed.pipeline_worker import (
    COLOC,
    cp_assignment,
    cp_worker,
    make_batch,
    mask_of,
    packed,
    tiny_model,
    with_items,
)
from tests.distributed.spawning import free_port, spawn_and_wait
from tests.helpers.pipeline_training import torchrun_train


def test_pp2_x_cp2_matches_single_process():
    spawn_and_wait(cp_worker, (4, free_port(), 2), 4, 240, "PP x CP test")


def test_packed_batch_metadata_by_hand():
    """The packing helper of the PP x CP cases: one row, documents and items as worked out by hand."""
    batch = with_items(make_batch("ia", 3))  # 2 rows of 23 tokens, row 0's last 2 padded
    assert batch.item_ids[0, 1:5].tolist() == [0] * 4 and int(batch.item_ids[0].max()) == 0
    assert batch.item_ids[1, :12].tolist() == [0] * 12 and batch.item_ids[1, 13:20].tolist() == [1] * 7
    assert batch.document_ids[0].tolist() == [0] * 21 + [-1] * 2
    row = packed(make_batch("ia", 3))
    assert row.input_ids.shape == (1, 21 + 23)
    assert row.document_ids[0].tolist() == [0] * 21 + [1] * 23
    assert row.position_ids[0].tolist() == list(range(21)) + list(range(23))
    assert row.item_ids[0, 1:5].tolist() == [0] * 4
    assert row.item_ids[0, 21:33].tolist() == [1] * 12 and row.item_ids[0, 34:41].tolist() == [2] * 7
    assert int((row.item_ids >= 0).sum()) == 4 + 12 + 7
    assert row.target_tokens == make_batch("ia", 3).target_tokens


def test_plait_train_pp2_x_cp2_equals_one_process(tmp_path):
    """``plait train`` on 4 processes with torchrun's variables (PP 2 x CP 2, encoders_colocated, 1F1B, LPT over
    blocks of 16 tokens, bidirectional items, packed documents) logs the single-process ``Trainer``'s losses (rel
    1e-5)."""
    records = (demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("image_digit",), limit=1)
               + demo_records("train", ("text",), limit=1))
    data = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(data), None, str(tmp_path / "single"), data={"shuffle": False, "packing": True},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"mask": "bidirectional_items", "block_size": 16}, parallel={"timeout_s": 60})
    single = Trainer.build(config_from_dict(job)).fit()
    job["metrics"]["run_dir"] = str(tmp_path / "ppcp")
    job["parallel"].update(cp=2, pp={"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"})
    proc = torchrun_train(job, tmp_path, "ppcp", nproc=4)  # forked ranks: no launcher, no interpreter start each
    assert "x CP 2" in proc.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ppcp" / "metrics.jsonl") if "loss" in r}
    assert sorted(losses) == [1, 2]
    torch.testing.assert_close(torch.tensor([losses[1], losses[2]]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)


def test_llm_stage_refuses_missing_or_foreign_cp_shard():
    """With cp_size 2 an LLM stage without this rank's shard would count every token twice: refused before any
    communication (one process, every stage on pipeline rank 0); a shard without CP is refused too."""
    model = tiny_model()
    plan = plan_pipeline(model_units(model), "encoders_colocated", stages_per_module=COLOC["stages_per_module"],
                         ranks=(0, 0, 0, 0))
    stages = build_rank_stages(model, plan, 0)
    batch = with_items(make_batch("t", 0))
    schedule = build_schedule(plan, "gpipe", 1)
    with pytest.raises(ValueError, match="gave no plait_cp shard, but this rank is CP rank 1 of cp=2"):
        run_pipeline_step(stages, schedule, [batch], 10, PipelineComm(cp_rank=1, cp_size=2), loss_fn=token_loss_sum)
    shard = build_cp_shard(cp_assignment(batch, 2), 0)
    with pytest.raises(ValueError, match="a plait_cp shard of rank 0 of cp=2, but this rank is CP rank 1 of cp=2"):
        run_pipeline_step(stages, schedule, [batch], 10, PipelineComm(cp_rank=1, cp_size=2),
                          llm_kwargs=[{"plait_mask": mask_of(batch), "plait_cp": shard}], loss_fn=token_loss_sum)
    with pytest.raises(ValueError, match="a plait_cp shard of rank 0 of cp=2, but this rank is CP rank 0 of cp=1"):
        run_pipeline_step(stages, schedule, [batch], 10, llm_kwargs=[{"plait_mask": mask_of(batch), "plait_cp": shard}],
                          loss_fn=token_loss_sum)
