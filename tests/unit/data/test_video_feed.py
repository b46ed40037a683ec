"""A video whose header reads but whose frames do not decode is found at load time: dropped from its step, counted
and reported like any failed decode (train/feed), or the run stops naming the record and file with on_error=raise."""

from __future__ import annotations

import json

import pytest

from plait.data.sources import SampleError
from plait.train.trainer import Trainer
from tests.media import video_tokenizer, write_video


def video_job(tiny_job, tmp_path, run: str, on_error: str):
    good = [write_video(tmp_path / f"good{i}.mp4", n) for i, n in enumerate((3, 5, 4))]
    whole = write_video(tmp_path / "whole.mkv", 8).read_bytes()
    bad = tmp_path / "truncated.mkv"
    bad.write_bytes(whole[:900])  # the header reads (the metadata pass accepts it), the later frames do not
    recs = [{"id": f"v{i}", "messages": [{"role": "user", "content": "<video>\nWhat happens?"},
                                         {"role": "assistant", "content": f"it fades {i}"}], "videos": [str(v)]}
            for i, v in enumerate([good[0], bad, *good[1:]])]
    # one DataLoader worker (spawned): the processor and its video settings travel to it and back
    return tiny_job(recs, train={"steps": 1, "global_batch_size": 4, "microbatch_size": 2},
                    data={"shuffle": False, "on_error": on_error, "num_workers": 1,
                          "tokenizer": str(video_tokenizer(tmp_path / "tok")), "metadata_cache": "off"},
                    metrics={"run_dir": str(tmp_path / run), "progress": False, "tensorboard": False}), bad


def test_an_undecodable_video_is_dropped_counted_and_reported(tiny_job, tmp_path):
    cfg, bad = video_job(tiny_job, tmp_path, "skip", "skip")
    trainer = Trainer.build(cfg)
    result = trainer.fit()
    assert result["dropped"] == 1 and [(s.id, s.source) for s in trainer.dropped] == [("v1", f"{cfg.data.train}:2")]
    assert trainer.dropped[0].reason.startswith(f"record 'v1' ({cfg.data.train}:2): cannot decode video {bad}: the "
                                                "stream ends after 2 frame(s) but its header says 8")
    reference = Trainer.build(cfg).train_step([0, 2, 3])  # the global batch without the undecodable video
    assert result["losses"] == [reference.loss]
    row = json.loads((tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["dropped_samples"] == 1 and row["target_tokens"] == reference.target_tokens


def test_an_undecodable_video_stops_the_run_with_on_error_raise(tiny_job, tmp_path):
    cfg, bad = video_job(tiny_job, tmp_path, "raise", "raise")
    with pytest.raises(SampleError, match=rf"^step 1: record 'v1' \({cfg.data.train}:2\): cannot decode video {bad}"):
        Trainer.build(cfg).fit()
