"""Helpers of several test modules, taken from tests/e2e/test_cli_tune_ranks.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.pipeline_training import to_toml


def tune_job(tmp_path, lora: bool = True):
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("image_audio",), limit=16))
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", ("image_audio",), limit=4))
    job = tiny_config_dict(str(train), str(val), str(tmp_path / "run"),
                           train={"global_batch_size": 4, "microbatch_size": 4, "steps": 8, "lr": 3e-3, "threads": 1,
                                  "max_new_tokens": 2},
                           data={"num_workers": 0})
    if lora:
        job["model"]["llm"]["lora"] = {"r": 4, "alpha": 8.0}
        job["model"]["encoders"]["vision"]["lora"] = {"r": 4, "alpha": 8.0}
    job["model"]["encoders"]["audio"]["freeze"] = True
    path = tmp_path / "job.toml"
    path.write_text(to_toml(job) + "\n")
    return path
