"""Helpers of several test modules, taken from tests/unit/data/test_mixture.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from tests.helpers.jobs import tiny_config_dict, write_jsonl


def mixture_job(tmp_path, run: str, **train) -> dict:
    """A tiny job on a mixture of the demo's text records (JSONL, weight 3) and image records (Parquet, weight 1),
    each with a validation file."""
    import json

    from plait.data.formats.arrow import write_parquet
    from tests.helpers.jobs import DEMO

    recs = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    text = [r for r in recs if r["task"] == "text"]
    images = [r for r in recs if r["task"] == "image_digit"]
    if not (tmp_path / "text.jsonl").exists():
        write_jsonl(tmp_path / "text.jsonl", text[:30])
        write_jsonl(tmp_path / "text_val.jsonl", text[30:34])
        write_parquet(images[:10], tmp_path / "images.parquet", DEMO)
        write_parquet(images[10:13], tmp_path / "images_val.parquet", DEMO)
    d = tiny_config_dict("", None, str(tmp_path / run), train={"steps": 6, "global_batch_size": 8, **train})
    d["data"]["sources"] = [
        {"path": str(tmp_path / "text.jsonl"), "weight": 3, "val": str(tmp_path / "text_val.jsonl")},
        {"path": str(tmp_path / "images.parquet"), "weight": 1, "val": str(tmp_path / "images_val.parquet")},
    ]
    d["data"]["epoch_samples"] = 24
    return d
