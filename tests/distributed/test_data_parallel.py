"""DP=2 (gloo; ranks started with torchrun's variables) equals one process on the same global batches."""

from __future__ import annotations


import torch

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.data_parallel import assert_same_training, run


def test_dp2_equals_single_process_even_when_a_rank_never_sees_an_image(tmp_path):
    images = demo_records("train", ("image_digit",), limit=4)
    others = demo_records("train", ("audio_transcribe",), limit=2) + demo_records("train", ("text",), limit=2)
    # file order, strided DP split: rank 0 gets the even positions (images), rank 1 the odd ones (never an image)
    records = [r for pair in zip(images, others) for r in pair]
    data = write_jsonl(tmp_path / "train.jsonl", records)
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                           data={"shuffle": False},
                           train={"steps": 3, "global_batch_size": 4, "microbatch_size": 1, "threads": 1},
                           parallel={"timeout_s": 60})
    single = run(cfg, tmp_path, "single", 1)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_dp")
    dp = run(cfg, tmp_path, "dp", 2)
    assert dp["world"] == 2 and single["world"] == 1
    assert dp["early"] >= 1  # the LLM's gradient buckets started during the last backward, before the reduction
    assert len(dp["losses"]) == 3
    torch.testing.assert_close(torch.tensor(dp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_training(single, dp)
