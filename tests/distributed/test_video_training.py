"""Acceptance: video samples and multi-image samples with images of different sizes train end to end, in one
process and under DP=2 (torchrun, gloo), DP=2 equal to one process."""

from __future__ import annotations

import torch

from tests.helpers.jobs import DEMO, tiny_config_dict, write_jsonl
from tests.helpers.data_parallel import assert_same_training, run
from tests.media import video_tokenizer, write_image, write_video


def _records(folder) -> list[dict]:
    videos = [write_video(folder / "a.mp4", 6), write_video(folder / "b.mkv", 4, width=40, height=24),
              write_video(folder / "c.webm", 3, width=16, height=16)]
    images = [DEMO / "img" / "000000.png", write_image(folder / "wide.png", 40, 32),
              write_image(folder / "tall.png", 24, 40, level=60)]  # 24x24, 40x32, 24x40: 9, 20 and 15 features

    def rec(rid, text, answer, imgs=(), vids=()):
        return {"id": rid, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": answer}],
                "images": [str(p) for p in imgs], "videos": [str(p) for p in vids]}

    return [rec("v0", "<video>\nWhat happens?", "it gets brighter", vids=videos[:1]),
            rec("m0", "<image> and <image>: same digit?", "no", imgs=images[:2]),
            rec("v1", "<video> then <image>", "a wide clip, then a tall image", imgs=images[2:], vids=videos[1:2]),
            rec("m1", "<image><image><image> Which is widest?", "the second", imgs=images),
            rec("v2", "Compare <video> with <video>.", "the first is larger", vids=[videos[1], videos[2]]),
            rec("t0", "Say hi.", "hi"),
            rec("m2", "<image>\n<image>", "two images", imgs=[images[2], images[0]]),
            rec("v3", "<image> <video>", "an image and a short clip", imgs=images[1:2], vids=videos[2:])]


def test_video_and_multi_image_samples_train_under_dp2_equal_to_one_process(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", _records(tmp_path))
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                           data={"shuffle": False, "tokenizer": str(video_tokenizer(tmp_path / "tok")),
                                 "metadata_cache": "off", "num_workers": 0},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 1, "threads": 1},
                           parallel={"timeout_s": 60})  # 2 steps of 4: every record once
    cfg["model"]["encoders"]["vision"]["video"] = {"fps": 2.0, "max_frames": 8}
    single = run(cfg, tmp_path, "single", 1)
    cfg["metrics"]["run_dir"] = str(tmp_path / "run_dp")
    dp = run(cfg, tmp_path, "dp", 2)
    assert dp["world"] == 2 and single["world"] == 1 and len(single["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(single["losses"])))
    # the vision tower and its projector learn from the frames and images (non-zero gradients)
    assert any(n.startswith("encoders.vision.encoder.") and g.abs().max() > 0 for n, g in single["grads"].items())
    torch.testing.assert_close(torch.tensor(dp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert_same_training(single, dp)
