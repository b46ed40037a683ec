"""A Qwen3-VL job builds and trains on images; a record with a video is refused when it is read, naming the record
(Qwen3-VL writes a timestamp before each temporal patch, which plait's video placeholder does not)."""

from __future__ import annotations

import pytest

from plait.commands.import_hf import import_checkpoint
from plait.config.loader import load_config
from plait.data.sources import SampleError
from plait.train.trainer import Trainer
from tests.helpers.hf_io_qwen2_5_vl import PAD
from tests.helpers.jobs import demo_records, write_jsonl
from tests.media import write_video
from tests.helpers.qwen3_vl import save_qwen3_vl


def test_a_video_record_is_refused_by_name(tmp_path):
    _, job = import_checkpoint(save_qwen3_vl(tmp_path / "qwen3-vl"), tmp_path / "imported")
    records = [dict(r, messages=[{"role": "user", "content": r["messages"][0]["content"].replace("<image>", PAD)},
                                 r["messages"][1]]) for r in demo_records("train", ("image_digit",), limit=2)]
    video = {"id": "clip7", "videos": [str(write_video(tmp_path / "clip.mp4", 4))],
             "messages": [{"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>What happens?"},
                          {"role": "assistant", "content": "it fades"}]}
    data = write_jsonl(tmp_path / "train.jsonl", [*records, video])
    common = [f"--data.train={data}", "--train.steps=1", "--train.global_batch_size=2", "--train.microbatch_size=2",
              "--train.device=cpu", "--data.num_workers=0", "--data.metadata_cache=off", "--data.shuffle=false",
              "--model.encoders.vision.video.placeholder=<|video_pad|>", f"--metrics.run_dir={tmp_path / 'run'}",
              "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.every=0"]
    with pytest.raises(SampleError, match=r"^record .clip7. \(.*train\.jsonl:3\).*Qwen3-VL video records need a "
                                          r"timestamp"):
        Trainer.build(load_config(job, [*common, "--data.on_error=raise"])).fit()
