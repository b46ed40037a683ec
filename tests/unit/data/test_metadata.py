"""The metadata pass: the same SampleMeta as processing every sample, from headers; sharded over workers and
ranks; cached, and a stale cache recomputed."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch.distributed as dist

from plait.data.loader import MultimodalDataset
from plait.data.metadata import MetadataTable, metadata_key, metadata_pass, this_process_only
from plait.data.sources import JsonlSource, SampleError, sample_at
from tests.helpers.jobs import DEMO, demo_records, write_jsonl
from tests.helpers.processing import setup  # noqa: F401  (fixture: tokenizer, model, processor)


def eager_metas(source, proc):
    """The reference: every record processed (pixels and waveforms decoded), as the eager loader did."""
    out = []
    for i in range(len(source)):
        try:
            out.append(proc(sample_at(source, i)).meta)
        except SampleError:
            pass
    return out


def test_metadata_equals_processing_on_demo_records(setup, tmp_path):
    _, _, proc = setup
    recs = demo_records("train", limit=240)  # text, image and audio records
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", recs))
    table = metadata_pass(src, proc, workers=2, chunk=32)
    assert len(table) == 240 and table.skipped == ()
    assert {0, 1, 2} <= {len(m.items) for m in (table.meta(i) for i in range(240))}
    assert [table.meta(i) for i in range(len(table))] == eager_metas(src, proc)


def test_workers_and_chunks_do_not_change_the_table(setup, tmp_path):
    _, _, proc = setup
    recs = demo_records("train", limit=60)
    recs[40] = {**recs[3]}  # a repeated id across chunks: the later use is refused
    recs[10] = {**recs[10], "messages": []}
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", recs))
    a = metadata_pass(src, proc, workers=0, chunk=1000)
    b = metadata_pass(src, proc, workers=2, chunk=7)
    for name in ("rows", "counts", "item_offsets", "item_branch", "item_tokens", "id_blob", "id_offsets"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.skipped == b.skipped and [s.source for s in a.skipped] == [f"{src.path}:11", f"{src.path}:41"]
    assert a.skipped[1].reason == f"record {recs[3]['id']!r} ({src.path}:41): the id is already used at {src.path}:4"
    assert len(a) == 58 and a.rows[10] == 11


def test_a_pass_of_this_process_only_enters_no_collective(setup, tmp_path, monkeypatch):
    _, _, proc = setup
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", demo_records("train", limit=12)))
    alone = metadata_pass(src, proc, chunk=5)  # no process group: the reference

    def never(*args, **kwargs):
        raise AssertionError("a collective")

    # a process group of 2 ranks in which the other rank never joins this pass (rank 0 building a profile's data)
    for name, value in (("is_initialized", lambda: True), ("get_world_size", lambda: 2), ("get_rank", lambda: 1)):
        monkeypatch.setattr(dist, name, value)
    monkeypatch.setattr(dist, "all_gather_object", never)
    with this_process_only():
        table = metadata_pass(src, proc, chunk=5, cache_dir=tmp_path / "cache")
    for name in ("rows", "counts", "item_offsets", "item_branch", "item_tokens", "id_blob", "id_offsets"):
        assert np.array_equal(getattr(alone, name), getattr(table, name)), name
    assert len(table) == 12 and len(list((tmp_path / "cache").glob("*.npz"))) == 1  # all rows; cached by itself
    with pytest.raises(AssertionError, match="a collective"):  # outside it the pass is collective again
        metadata_pass(src, proc, chunk=5)


def test_cache_is_reused_when_fresh_and_recomputed_when_stale(setup, tmp_path, caplog):
    _, _, proc = setup
    img = tmp_path / "img.png"
    shutil.copy(DEMO / "img" / "000000.png", img)
    recs = demo_records("train", ("image_digit",), limit=3)
    recs[0]["images"] = [str(img)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    cache = tmp_path / "cache"
    first = metadata_pass(JsonlSource(path), proc, cache_dir=cache)
    files = list(cache.iterdir())
    assert len(files) == 1 and str(img) in first.media
    again = MetadataTable.load(files[0], first.key)
    assert again is not None and again.meta(0) == first.meta(0) and again.skipped == first.skipped
    os.utime(img, ns=(1, 1))  # a media file changed (mtime): the cached counts may be wrong
    with caplog.at_level(logging.WARNING):
        assert MetadataTable.load(files[0], first.key) is None
    assert "is stale" in caplog.text
    recs[1]["messages"][-1]["content"] = "a much longer answer than before"
    write_jsonl(path, recs)  # the data file changed: a new key, the old entry is not used
    changed = metadata_pass(JsonlSource(path), proc, cache_dir=cache)
    assert changed.key != first.key and changed.meta(1).target_tokens > first.meta(1).target_tokens
    assert MetadataTable.load(files[0], changed.key) is None


def test_the_key_follows_every_setting_that_changes_counts(setup, tmp_path):
    _, _, proc = setup
    src = JsonlSource(write_jsonl(tmp_path / "d.jsonl", demo_records("train", limit=2)))
    base = metadata_key(src, proc, False, 2)
    assert metadata_key(src, proc, False, 2) == base
    assert metadata_key(src, proc, True, 2) != base and metadata_key(src, proc, False, 1) != base
    max_length = proc.max_length
    proc.max_length = 128
    try:
        assert metadata_key(src, proc, False, 2) != base
    finally:
        proc.max_length = max_length
    tok = proc.tokenizer
    template = tok.chat_template
    tok.chat_template = template + " "
    try:
        assert metadata_key(src, proc, False, 2) != base
    finally:
        tok.chat_template = template


def test_a_corrupt_image_body_passes_the_pass_and_fails_at_load_naming_the_record(setup, tmp_path):
    _, _, proc = setup
    bad = tmp_path / "bad.png"
    data = (DEMO / "img" / "000001.png").read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # the header reads, the pixels do not decode
    recs = demo_records("train", ("image_digit",), limit=2)
    recs[1]["images"] = [str(bad)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    ds = MultimodalDataset(path, proc, on_error="raise")
    assert len(ds) == 2 and len(ds.sample_meta(1).items) == 1
    with pytest.raises(SampleError, match=rf"record '{recs[1]['id']}' \({path}:2\): cannot decode image"):
        ds.load(1)
    assert ds.where(1) == f"{path}:2" and ds[0].meta == ds.sample_meta(0)
