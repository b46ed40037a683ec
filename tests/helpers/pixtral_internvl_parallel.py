"""Helpers of several test modules, taken from tests/distributed/test_pixtral_internvl_parallel.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import numpy as np
from PIL import Image

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl


def two_image_record(tmp_path) -> dict:
    rng = np.random.default_rng(1)
    paths = []
    for i, (h, w) in enumerate([(20, 36), (28, 12)]):
        paths.append(str(tmp_path / f"pair{i}.png"))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    ask = {"role": "user", "content": "<image> <image>\nSame digit?"}
    return {"id": "pair-0", "task": "pair", "images": paths, "messages": [ask, {"role": "assistant", "content": "no"}]}


def vision_job(tmp_path, branch: dict, run: str) -> dict:
    """A 2-step job (run folder ``<tmp_path>/<run>``) whose one vision ``branch`` sees single images, a two-image
    record with images of different sizes and a text-only record."""
    records = demo_records("train", ("image_digit",), limit=2) + [two_image_record(tmp_path)]
    records += demo_records("train", ("text",), limit=1)
    data = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(data), None, str(tmp_path / run), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"block_size": 16}, parallel={"timeout_s": 60})
    job["model"]["encoders"] = {"vision": dict(branch)}
    return job
