"""Video records: headers without decoding, frame sampling, placeholder expansion (frames x per-frame features),
the metadata pass equal to the decoding path, every data format, and one test per kind of bad video."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from plait.data.collate import collate
from plait.data.formats import open_source
from plait.data.formats.arrow import write_parquet
from plait.data.metadata import metadata_pass, record_metadata
from plait.data.processing import PerFrame
from plait.data.sources import SampleError, parse_record, sample_at
from plait.data.video import VideoHeader, VideoSpec, load_video, read_video_header, sample_indices
from plait.models.registry import build_model, build_processor, load_tokenizer
from tests.helpers.jobs import DEMO, tiny_config_dict, write_jsonl
from tests.media import video_tokenizer, write_image, write_video

PER_FRAME = 4 * 3  # a 32x24 frame through the tiny SigLIP (patch 8, no resize): 4 x 3 patches


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from plait.config.loader import config_from_dict

    folder = tmp_path_factory.mktemp("video")
    cfg = tiny_config_dict("unused.jsonl")
    cfg["data"]["tokenizer"] = str(video_tokenizer(folder / "tok"))
    cfg["model"]["encoders"]["vision"]["video"] = {"fps": 2.0, "max_frames": 4}
    cfg = config_from_dict(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok)
    return folder, tok, model, build_processor(cfg.model, model, tok, 256)


def video_record(rid: str, videos: list, images: list | None = None, text: str = "<video>\nWhat happens?") -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "it fades"}],
            "images": images or [], "videos": videos}


# ------------------------------------------------------------------------------------------- headers, sampling
@pytest.mark.parametrize("ext", [".mp4", ".mkv", ".webm"])
def test_the_header_gives_frames_rate_and_size(tmp_path, ext):
    # mp4 counts the frames in its header; Matroska / WebM give the duration (1.5 s x 4 fps = 6 frames)
    path = write_video(tmp_path / f"v{ext}", 6, width=32, height=24, rate=4)
    assert read_video_header(str(path)) == VideoHeader(6, Fraction(4), 32, 24, estimated=ext != ".mp4")
    assert read_video_header(path.read_bytes()).frames == 6


def test_the_header_is_read_without_decoding_a_frame(tmp_path, monkeypatch):
    import av.container

    path = write_video(tmp_path / "v.mp4", 6)
    monkeypatch.setattr(av.container.InputContainer, "decode", lambda *a, **k: pytest.fail("decoded a frame"))
    assert read_video_header(str(path)).frames == 6


@pytest.mark.parametrize("fps, expected", [
    (2.0, [0, 2, 4]),            # every second frame of a 4 fps video
    (3.0, [0, 1, 2, 4, 5]),      # ceil(6 x 3 / 4) = 5 frames at floor(k x 4 / 3)
    (1.0, [0, 4]),
    (4.0, [0, 1, 2, 3, 4, 5]),   # the video's own rate: every frame
    (10.0, [0, 1, 2, 3, 4, 5]),  # above it: every frame, none repeated
    (0.0, [0, 1, 2, 3, 4, 5]),   # 0: every frame
])
def test_frames_are_sampled_at_the_configured_rate(fps, expected):
    assert sample_indices(VideoHeader(6, Fraction(4), 32, 24), fps, 32) == expected


def test_sampling_is_exact_for_ntsc_rates():
    # 30 frames at 29.97 fps (30000/1001) last 1.001 s: at 1 fps ceil(30 x 1001 / 30000) = 2 frames, the second
    # the one shown at 1 s, floor(30000 / 1001) = 29
    header = VideoHeader(30, Fraction(30000, 1001), 32, 24)
    assert sample_indices(header, 1.0, 32) == [0, 29]


def test_more_frames_than_the_limit_names_the_limit_and_the_field():
    header = VideoHeader(40, Fraction(4), 32, 24)
    with pytest.raises(SampleError) as info:
        sample_indices(header, 2.0, 8, "video clip.mp4", "model.encoders.vision.video")
    field = "model.encoders.vision.video"
    assert str(info.value) == (f"video clip.mp4 gives 20 frames (10.00 s sampled at 2 frames per second), more than "
                               f"{field}.max_frames = 8; raise {field}.max_frames or lower {field}.fps")


def test_every_frame_over_the_limit_says_to_set_fps():
    with pytest.raises(SampleError, match=r"sampled at every frame\), more than f.max_frames = 4; raise f.max_frames "
                                          r"or set f.fps$"):
        sample_indices(VideoHeader(6, Fraction(4), 32, 24), 0.0, 4, "video v.mp4", "f")


def test_decoded_frames_are_the_sampled_ones(tmp_path):
    path = write_video(tmp_path / "v.mkv", 6)  # FFV1: lossless
    frames = load_video(str(path), VideoSpec("<video>", 1, 2.0, 8, "f", PerFrame()))
    assert len(frames) == 3
    for frame, index in zip(frames, [0, 2, 4]):
        arr = np.asarray(frame)
        assert frame.size == (32, 24) and frame.mode == "RGB"
        assert abs(int(arr[5, 10, 0]) - (20 + 30 * index)) <= 2  # the grey level of frame `index` (yuv420p rounding)


def test_video_settings_are_checked_naming_the_field():
    with pytest.raises(ValueError, match=r"^model.encoders.vision.video.max_frames must be >= 1, got 0$"):
        VideoSpec("<video>", 1, 1.0, 0, "model.encoders.vision.video", PerFrame())
    with pytest.raises(ValueError, match=r"^model.encoders.vision.video.fps must be >= 0 \(0: every frame\), got -1"):
        VideoSpec("<video>", 1, -1.0, 4, "model.encoders.vision.video", PerFrame())


# ------------------------------------------------------------------------------------------- processing
def test_a_video_expands_to_frames_times_per_frame_features_in_placeholder_order(setup):
    folder, tok, model, proc = setup
    video = write_video(folder / "six.mp4", 6)  # 1.5 s at 4 fps, sampled at 2 fps: frames 0, 2, 4
    image = DEMO / "img" / "000000.png"  # 24 x 24: 3 x 3 patches
    rec = video_record("v1", [str(video)], [str(image)], "<image> then <video>\nWhat happens?")
    s = proc(parse_record(rec, "t.jsonl:1", folder))
    vision = model.placeholder_ids["vision"]
    assert int((s.input_ids == vision).sum()) == 9 + 3 * PER_FRAME
    assert tok.convert_tokens_to_ids("<video>") not in s.input_ids.tolist()  # expanded into image placeholders
    assert s.meta.items == (("vision", 9), ("vision", PER_FRAME), ("vision", PER_FRAME), ("vision", PER_FRAME))
    assert [tuple(it["pixel_values"].shape) for it in s.inputs["vision"]] == [(3, 24, 24)] + [(3, 24, 32)] * 3
    # each frame is its own item: item ids 0 (image), 1, 2, 3 (frames), in sequence order
    items = s.item_ids[s.item_ids >= 0]
    assert items.tolist() == [0] * 9 + [1] * PER_FRAME + [2] * PER_FRAME + [3] * PER_FRAME
    # the metadata pass (headers only) gives the same meta
    assert record_metadata(proc, parse_record(rec, "t.jsonl:1", folder)) == s.meta
    # and the model takes the batch: features fill exactly the placeholders
    batch = collate([s], proc.pad_id)
    with torch.no_grad():
        logits = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids)
    assert logits.shape[:2] == batch.input_ids.shape


def test_frames_of_the_video_are_the_processed_decoded_frames(setup):
    folder, _, _, proc = setup
    video = write_video(folder / "lossless.mkv", 4)
    s = proc(parse_record(video_record("v2", [str(video)]), "t.jsonl:1", folder))
    hf = proc.specs["image"].hf_processor
    expected = [hf(images=[f], return_tensors="pt")["pixel_values"][0]
                for f in load_video(str(video), proc.specs["image"].video)]
    assert len(s.inputs["vision"]) == 2
    for item, ref in zip(s.inputs["vision"], expected):
        torch.testing.assert_close(item["pixel_values"], ref, rtol=0, atol=0)


def test_metadata_pass_reads_no_frame_and_equals_the_decoded_samples(setup, monkeypatch):
    folder, _, _, proc = setup
    videos = [write_video(folder / f"m{i}.mp4", n) for i, n in enumerate((2, 5, 8))]
    recs = [video_record(f"m{i}", [str(v)]) for i, v in enumerate(videos)]
    source = open_source(write_jsonl(folder / "meta.jsonl", recs))
    decoded = [proc(sample_at(source, i)).meta for i in range(len(source))]
    import plait.data.video as video_module

    monkeypatch.setattr(video_module, "_decode", lambda *a: pytest.fail("the metadata pass decoded frames"))
    table = metadata_pass(source, proc)
    assert [table.meta(i) for i in range(len(table))] == decoded
    assert [len(m.items) for m in decoded] == [1, 3, 4]  # 0.5 s, 1.25 s, 2 s at 2 fps
    assert {str(v) for v in videos} <= set(table.media)  # stamped: a changed video makes a cached table stale


def test_every_format_reads_videos(setup):
    folder, _, _, proc = setup
    video = write_video(folder / "fmt.mp4", 4)
    rec = video_record("f1", ["fmt.mp4"])
    jsonl = open_source(write_jsonl(folder / "fmt.jsonl", [rec]))
    parquet = open_source(write_parquet([rec], folder / "fmt.parquet", folder))
    llava_path = folder / "fmt.json"
    llava_path.write_text(json.dumps([
        {"id": "f1", "video": "fmt.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                           {"from": "gpt", "value": "it fades"}]},
        # LLaVA-Video's convention: <image> placeholders with a video and no image are the video's
        {"id": "f2", "video": "fmt.mp4", "conversations": [{"from": "human", "value": "<image>\nWhat happens?"},
                                                           {"from": "gpt", "value": "it fades"}]}]))
    llava = open_source(llava_path)
    samples = [proc(sample_at(src, 0)) for src in (jsonl, parquet, llava)] + [proc(sample_at(llava, 1))]
    assert isinstance(sample_at(parquet, 0).media["video"][0], bytes)  # embedded in the Parquet file
    assert str(sample_at(parquet, 0).media["video"][0]).startswith("videos[0] of ")
    for s in samples[1:]:
        assert torch.equal(s.input_ids, samples[0].input_ids)
        for a, b in zip(s.inputs["vision"], samples[0].inputs["vision"]):
            assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert len(samples[0].meta.items) == 2 and video.exists()


def test_a_llava_record_with_video_placeholders_not_matching_is_refused():
    from plait.data.formats.llava import llava_record

    with pytest.raises(ValueError, match=r"^0 <video> placeholder\(s\) in conversations but 2 video\(s\) in 'video'$"):
        llava_record({"id": "x", "video": ["a.mp4", "b.mp4"], "image": "c.png", "conversations": [
            {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "ok"}]})


# ------------------------------------------------------------------------------------------- bad videos
def _bad(proc, folder, rec):
    raw = parse_record(rec, f"{folder}/bad.jsonl:3", folder)
    errors = []
    for run in (lambda: proc(raw), lambda: record_metadata(proc, raw)):
        with pytest.raises(SampleError) as info:
            run()
        errors.append(str(info.value))
    return errors


def test_an_undecodable_video_is_refused_naming_record_and_file(setup):
    folder, _, _, proc = setup
    path = folder / "garbage.mp4"
    path.write_bytes(b"this is not a video at all" * 10)
    for error in _bad(proc, folder, video_record("g1", [str(path)])):
        assert error == (f"record 'g1' ({folder}/bad.jsonl:3): cannot decode video {path}: its data is not a video "
                         "FFmpeg can read: the file is truncated, damaged, or not a video (FFmpeg: Invalid data found "
                         "when processing input)")


@pytest.mark.parametrize("cut, ffmpeg", [(50, "End of file"), (300, "Input/output error")])
def test_a_video_cut_inside_its_header_says_truncated_in_plain_words(setup, cut, ffmpeg):
    """A file cut before its stream headers end: the record, the file and what is wrong, without PyAV's
    ``[Errno 541478725] ...: '<path>'``."""
    folder, _, _, proc = setup
    path = folder / f"cut{cut}.mkv"
    path.write_bytes(write_video(folder / "whole8.mkv", 8).read_bytes()[:cut])
    why = ("the file ends early: it is truncated (cut off while it was written, copied or downloaded)" if cut == 50
           else "FFmpeg cannot read its data: the file is truncated or damaged")
    for error in _bad(proc, folder, video_record("c1", [str(path)])):
        assert error == f"record 'c1' ({folder}/bad.jsonl:3): cannot decode video {path}: {why} (FFmpeg: {ffmpeg})"
        assert "Errno" not in error


def test_an_mp4_cut_anywhere_says_truncated_naming_record_and_file(setup):
    """Every cut of an MP4 before its end: the record and file, "truncated" (or "cut off") in the message, and no
    errno or Python internals (a cut inside the stream header read as ``'NoneType' object has no attribute
    'width'``)."""
    folder, _, _, proc = setup
    whole = write_video(folder / "whole8.mp4", 8).read_bytes()
    errors = []
    for cut in range(40, len(whole) - 120, 60):
        path = folder / f"cut{cut}.mp4"
        path.write_bytes(whole[:cut])
        raw = parse_record(video_record("c2", [str(path)]), f"{folder}/bad.jsonl:3", folder)
        for run in (lambda: proc(raw), lambda: record_metadata(proc, raw)):
            try:
                run()
            except SampleError as exc:
                errors.append((path, str(exc)))
    assert len(errors) >= 10
    for path, error in errors:
            assert error.startswith(f"record 'c2' ({folder}/bad.jsonl:3): ") and str(path) in error, error
            assert ("truncated" in error or "cut off" in error) and "Errno" not in error and "NoneType" not in error


def test_a_truncated_video_passes_the_header_pass_and_fails_to_decode_naming_the_file(setup):
    folder, _, _, proc = setup
    data = write_video(folder / "whole.mkv", 8).read_bytes()
    path = folder / "truncated.mkv"
    path.write_bytes(data[:900])  # the header (duration 2 s) and the first frames only
    raw = parse_record(video_record("t1", [str(path)]), f"{folder}/bad.jsonl:3", folder)
    assert len(record_metadata(proc, raw).items) == 4  # 2 s at 2 fps, from the header
    with pytest.raises(SampleError) as info:
        proc(raw)
    assert str(info.value) == (f"record 't1' ({folder}/bad.jsonl:3): cannot decode video {path}: the stream ends "
                               "after 2 frame(s) but its header says 8 (frame 2 is sampled); the file is truncated or "
                               "corrupt")


def test_a_video_with_more_frames_than_the_limit_names_the_limit_and_the_field(setup):
    folder, _, _, proc = setup
    path = write_video(folder / "long.mp4", 20)  # 5 s at 2 fps: 10 frames > max_frames = 4
    for error in _bad(proc, folder, video_record("l1", [str(path)])):
        assert error == (f"record 'l1' ({folder}/bad.jsonl:3): video {path} gives 10 frames (5.00 s sampled at 2 "
                         "frames per second), more than model.encoders.vision.video.max_frames = 4; raise "
                         "model.encoders.vision.video.max_frames or lower model.encoders.vision.video.fps")


@pytest.mark.parametrize("kind", ["no frames", "empty file", "image file"])
def test_a_zero_length_video_is_refused_naming_record_and_file(setup, kind):
    """Also an image file named as a video (a PNG renamed .mp4): not a video, not "zero length"."""
    folder, _, _, proc = setup
    if kind == "image file":
        path = folder / "still.mp4"
        path.write_bytes((DEMO / "img" / "000000.png").read_bytes())
        reason = ("is not a video container or stream plait can decode: FFmpeg reads it as a still image (piped png "
                  "sequence); give an image as an image, a video as a video file (MP4, MKV, WebM, ...)")
    elif kind == "no frames":
        path = write_video(folder / "zero.mp4", 0)
        reason = ("has no video stream: zero length, not a video (an empty or audio-only container), or a file cut off "
                  "before its video stream")
    else:
        path = folder / "empty.mp4"
        path.write_bytes(b"")
        reason = "is empty (0 bytes): zero length"
    for error in _bad(proc, folder, video_record("z1", [str(path)])):
        assert error == f"record 'z1' ({folder}/bad.jsonl:3): video {path} {reason}"


def test_a_missing_video_is_refused_naming_record_and_file(setup):
    folder, _, _, proc = setup
    for error in _bad(proc, folder, video_record("m1", [str(folder / "nope.mp4")])):
        assert error == f"record 'm1' ({folder}/bad.jsonl:3): video file {folder}/nope.mp4 does not exist"


def test_videos_and_placeholders_must_match(setup):
    folder, _, _, proc = setup
    path = write_video(folder / "pair.mp4", 2)
    for error in _bad(proc, folder, video_record("p1", [str(path)] * 2)):
        assert error == f"record 'p1' ({folder}/bad.jsonl:3): 1 <video> placeholder(s) in the text but 2 video item(s)"


def test_a_video_placeholder_that_is_not_a_token_names_the_field(tmp_path):
    from plait.config.loader import config_from_dict

    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))  # the demo tokenizer has no <video>
    tok = load_tokenizer(cfg.data.tokenizer)
    proc = build_processor(cfg.model, build_model(cfg.model, tok, device="meta"), tok, 256)
    path = write_video(tmp_path / "v.mp4", 2)
    for error in _bad(proc, tmp_path, video_record("n1", [str(path)])):
        assert error == (f"record 'n1' ({tmp_path}/bad.jsonl:3): has 1 video item(s) but the video placeholder "
                         "'<video>' is not a token of the tokenizer (model.encoders.vision.video.placeholder)")


def test_a_video_placeholder_set_in_the_job_that_is_not_a_token_is_refused_at_build(tmp_path):
    from plait.config.loader import config_from_dict

    data = tiny_config_dict("unused.jsonl")  # the demo tokenizer has no <vid>: refused as an image placeholder is
    data["model"]["encoders"]["vision"]["video"] = {"placeholder": "<vid>"}
    cfg = config_from_dict(data)
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok, device="meta")
    with pytest.raises(ValueError, match=r"^model\.encoders\.vision\.video\.placeholder: '<vid>' is not a token of "
                                         r"the tokenizer \(set a single token of it, or leave the default '<video>'"):
        build_processor(cfg.model, model, tok, 256)


def test_videos_of_different_sizes_and_images_collate_into_one_batch(setup):
    folder, _, model, proc = setup
    small = write_video(folder / "small.mp4", 2, width=16, height=16)
    wide = write_video(folder / "wide.mp4", 4, width=40, height=24)
    image = write_image(folder / "tall.png", 24, 40)
    a = proc(parse_record(video_record("c1", [str(small)]), "t:1", folder))
    b = proc(parse_record(video_record("c2", [str(wide)], [str(image)], "<video><image> What?"), "t:2", folder))
    assert [n for _, n in a.meta.items] == [4]
    assert [n for _, n in b.meta.items] == [15, 15, 15]  # 2 frames of 5 x 3 patches, then the 3 x 5 image
    batch = collate([a, b], proc.pad_id)
    assert len(batch.modality_inputs["vision"]["pixel_values"]) == 4
    with torch.no_grad():
        feats = model.encode("vision", batch.modality_inputs["vision"])
    assert feats.shape[0] == 4 + 45 == int((batch.input_ids == model.placeholder_ids["vision"]).sum())


def test_a_video_feeds_a_siglip2_naflex_branch_frame_by_frame(tmp_path):
    """A variable-resolution tower: each frame is resized by the NaFlex processor to its own patch grid (here 5 x 3
    patches for 40 x 24 frames, 4 x 4 for a 16 x 16 image) and encoded as one image item."""
    from plait.config.loader import config_from_dict

    siglip2 = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, patch_size=4, num_patches=16, num_channels=3)
    cfg = tiny_config_dict("unused.jsonl")
    cfg["data"]["tokenizer"] = str(video_tokenizer(tmp_path / "tok"))
    cfg["model"]["encoders"] = {"vision": {"modality": "image", "config": siglip2, "video": {"fps": 0}}}
    cfg = config_from_dict(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok)
    proc = build_processor(cfg.model, model, tok, 256)
    video = write_video(tmp_path / "wide.mp4", 3, width=40, height=24)
    image = write_image(tmp_path / "square.png", 16, 16)
    raw = parse_record(video_record("s1", [str(video)], [str(image)], "<video> <image> What?"), "t:1", tmp_path)
    s = proc(raw)
    assert s.meta.items == (("vision", 15),) * 3 + (("vision", 16),)
    assert [tuple(it["spatial_shapes"].tolist()) for it in s.inputs["vision"]] == [(3, 5)] * 3 + [(4, 4)]
    assert record_metadata(proc, raw) == s.meta
    batch = collate([s], proc.pad_id)
    with torch.no_grad():
        logits = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids)
    assert logits.shape[1] == batch.input_ids.shape[1] and int((batch.input_ids == model.placeholder_ids["vision"])
                                                                .sum()) == 61


@pytest.mark.parametrize("name, codec", [("h264.mp4", "libx264"), ("mpeg4.mp4", None), ("vp8.webm", None),
                                         ("ffv1.mkv", None)])
def test_seeking_to_sparse_frames_gives_the_frames_decoding_every_frame_gives(tmp_path, monkeypatch, name, codec):
    import plait.data.video as video_module

    path = write_video(tmp_path / name, 96, rate=8, codec=codec, gop=8)  # 12 s, a keyframe a second
    spec = VideoSpec("<video>", 1, 0.25, 32, "f", PerFrame())  # frames 0, 32, 64: 4 s apart (> SEEK_GAP_S)
    seeks = []
    seek = video_module._seek
    monkeypatch.setattr(video_module, "_seek", lambda *a: (seeks.append(a[-1]), seek(*a)))
    sought = load_video(str(path), spec)
    assert len(seeks) == 2
    monkeypatch.setattr(video_module, "SEEK_GAP_S", float("inf"))
    decoded = load_video(str(path), spec)
    assert len(seeks) == 2 and len(sought) == len(decoded) == 3
    for a, b, index in zip(sought, decoded, [0, 32, 64]):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert abs(int(np.asarray(a)[12, 20, 0]) - (20 + 30 * index) % 250) <= 3  # frame `index`'s grey level


def test_a_family_encoding_that_refuses_the_frames_names_record_and_file(setup, monkeypatch):
    folder, _, _, proc = setup

    class Refusing(PerFrame):
        def items(self, hf_processor, frames):
            raise ValueError("video frames give different patch grids")

        def sizes(self, frames, frame_size):
            raise ValueError("video frames give different patch grids")

    import dataclasses

    spec = proc.specs["image"]
    monkeypatch.setitem(proc.specs, "image", dataclasses.replace(
        spec, video=dataclasses.replace(spec.video, encoding=Refusing())))
    path = write_video(folder / "refused.mp4", 2)
    for error in _bad(proc, folder, video_record("r1", [str(path)])):
        assert error == f"record 'r1' ({folder}/bad.jsonl:3): video {path}: video frames give different patch grids"


@pytest.mark.parametrize("table, branch, message", [
    ({"audio": True}, "vision", r"^model\.encoders\.vision\.video\.audio = true needs a tower that encodes a video as "
                                r"one timed item .* this branch's tower \(SigLIP\) does not: set it to false$"),
    ({"fps": 3.0}, "audio", r"^model\.encoders\.audio\.video: branch 'audio' is an audio branch and takes no videos"),
])
def test_a_video_table_the_branch_cannot_take_is_a_job_error(tmp_path, table, branch, message):
    """Refused when the job is built, naming the field (not once per record, not silently dropped)."""
    from plait.config.loader import config_from_dict

    cfg = tiny_config_dict("unused.jsonl")
    cfg["data"]["tokenizer"] = str(video_tokenizer(tmp_path / "tok"))
    cfg["model"]["encoders"][branch]["video"] = table
    cfg = config_from_dict(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    with pytest.raises(ValueError, match=message):
        build_processor(cfg.model, build_model(cfg.model, tok), tok, 256)
