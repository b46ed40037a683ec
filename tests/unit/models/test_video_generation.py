"""A model whose image branch takes videos, saved as ``plait train`` saves ``final/``: ``plait generate`` and a
``model.pretrained`` job read its video records with the job's video settings (placeholder, fps, max_frames,
kept in ``plait_config.json``), as training's validation read them."""

from __future__ import annotations

import json

import pytest

from plait.commands.generate import generate_command
from plait.config.schema import EncoderConfig, ModelConfig, VideoConfig
from plait.data.sources import SampleError, parse_record
from plait.models.generation import Generator, save_final
from plait.models.registry import build_processor
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records
from tests.media import video_tokenizer, write_video
from tests.unit.models.generation_cases import trainer_predictions

PER_FRAME = 4 * 3  # a 32x24 frame through the tiny SigLIP (patch 8, no resize): 4 x 3 patches


def _video_record(rid: str, video: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": "<video>\nWhat happens?"},
                                    {"role": "assistant", "content": "it fades"}], "videos": [video]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 2 steps on image and video records with ``fps = 2``, ``max_frames = 4`` (not the
    defaults), validated on video records, saved to ``final/``: (trainer, final, val records, folder)."""
    from plait.config.loader import config_from_dict
    from tests.helpers.jobs import tiny_config_dict, write_jsonl

    folder = tmp_path_factory.mktemp("video_gen")
    videos = [str(write_video(folder / f"v{i}.mp4", 6 + i, rate=4)) for i in range(3)]  # 1.5-2 s: 3-4 frames
    train = demo_records("train", ("image_digit",), limit=4) + [_video_record(f"t{i}", v) for i, v in enumerate(videos)]
    val = [_video_record(f"v{i}", v) for i, v in enumerate(videos[:2])]
    cfg = tiny_config_dict(str(write_jsonl(folder / "train.jsonl", train)), str(write_jsonl(folder / "val.jsonl", val)),
                           str(folder / "run"), train={"steps": 2, "max_new_tokens": 4})
    cfg["data"]["tokenizer"] = str(video_tokenizer(folder / "tok"))
    cfg["model"]["encoders"]["vision"]["video"] = {"fps": 2.0, "max_frames": 4}
    trainer = Trainer.build(config_from_dict(cfg))
    trainer.fit()
    save_final(trainer.full_model(), trainer.processor, folder / "final")
    return trainer, folder / "final", folder / "val.jsonl", folder


def test_final_keeps_the_video_settings_and_generate_reads_videos_as_validation(trained):
    trainer, final, val, folder = trained
    saved = json.loads((final / "plait_config.json").read_text())["encoders"]
    assert saved["vision"]["video"] == {"placeholder": "<video>", "fps": 2.0, "max_frames": 4, "audio": False}
    assert "video" not in saved["audio"]
    gen = Generator.from_pretrained(final, device="cpu")
    spec = gen.processor.specs["image"].video
    assert (spec.placeholder, spec.fps, spec.max_frames, spec.saved) == ("<video>", 2.0, 4, str(final))
    raws = [parse_record(json.loads(line), f"val.jsonl:{i}", folder)
            for i, line in enumerate(val.read_text().splitlines(), 1)]
    image_id = gen.processor.specs["image"].placeholder_id
    for raw, theirs in zip(raws, (trainer.val_set[j] for j in range(len(trainer.val_set)))):
        mine = gen.processor(raw, prompt_only=True)
        assert mine.input_ids.tolist() == theirs.input_ids.tolist(), raw.id
    # 6 frames at 4 fps sampled at 2 fps: 3 frames (the default 1 fps would give 2)
    assert int((gen.processor(raws[0], prompt_only=True).input_ids == image_id).sum()) == 3 * PER_FRAME
    out = folder / "pred.jsonl"
    assert generate_command(final, input_path=val, output_path=out, max_new_tokens=4, device="cpu") == 0
    predictions = [json.loads(line)["prediction"] for line in out.read_text().splitlines()]
    assert predictions == trainer_predictions(trainer)


def test_a_video_over_the_saved_frame_limit_is_refused_naming_the_field(trained):
    _, final, _, folder = trained
    gen = Generator.from_pretrained(final, device="cpu")
    long = write_video(folder / "long.mp4", 12, rate=4)  # 3 s at 2 fps: 6 frames > max_frames 4 (default 32)
    raw = parse_record(_video_record("long", str(long)), "long.jsonl:1", folder)
    with pytest.raises(SampleError, match=r"more than model.encoders.vision.video.max_frames = 4"):
        gen.generate_raw([raw], max_new_tokens=2)


def test_a_pretrained_job_takes_the_saved_video_settings_and_overrides_what_it_sets(trained):
    trainer, final, _, _ = trained
    gen = Generator.from_pretrained(final, device="cpu")
    inherit = build_processor(ModelConfig(pretrained=str(final)), gen.model, gen.tokenizer, 256)
    assert inherit.specs["image"].video.fps == 2.0 and inherit.specs["image"].video.max_frames == 4
    job = ModelConfig(pretrained=str(final), encoders={"vision": EncoderConfig(video=VideoConfig(max_frames=8))})
    override = build_processor(job, gen.model, gen.tokenizer, 256).specs["image"].video
    assert (override.placeholder, override.fps, override.max_frames) == ("<video>", 2.0, 8)


def test_generate_prompt_with_video_samples_frames_as_training(trained, capsys):
    """``plait generate --prompt ... --video clip.mp4``: the prompt's video is sampled and processed as the same
    video in a validation record (the saved fps = 2, max_frames = 4), and answered as that record is."""
    from plait.commands.generate import prompt_sample

    trainer, final, val, folder = trained
    gen = Generator.from_pretrained(final, device="cpu")
    video = str(folder / "v0.mp4")
    raw = prompt_sample(gen, "What happens?", videos=[video])
    assert raw.messages[0]["content"] == "<video>\nWhat happens?" and raw.media["video"] == (video,)
    mine = gen.processor(raw, prompt_only=True)
    assert mine.input_ids.tolist() == trainer.val_set[0].input_ids.tolist()  # 3 frames x PER_FRAME placeholders
    record = parse_record(json.loads(val.read_text().splitlines()[0]), "val.jsonl:1", folder)
    expected = gen.generate_raw([record], max_new_tokens=4)[0]
    from plait.cli import main

    assert main(["generate", "--model", str(final), "--prompt", "What happens?", "--video", video,
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_generate_refuses_an_unreadable_video_naming_it(trained, tmp_path):
    _, final, _, _ = trained
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"not a video at all" * 10)
    with pytest.raises(SampleError, match=rf"record 'prompt' \(the prompt\): cannot decode video {bad}: .*Invalid data"):
        generate_command(final, prompt="What happens?", videos=[str(bad)], max_new_tokens=2, device="cpu")
    with pytest.raises(ValueError, match="--image/--audio/--video go with --prompt"):
        generate_command(final, input_path=tmp_path / "x.jsonl", output_path=tmp_path / "y.jsonl",
                         videos=[str(bad)])
