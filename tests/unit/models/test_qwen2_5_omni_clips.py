"""A record with a video and its audio track (``[model.encoders.vision.video] audio = true``, the Qwen2.5-Omni
thinker's ``use_audio_in_video``): the processor decodes the track, lays the clip's video and audio tokens out by
2-s chunks, the collator positions them as the thinker does, the metadata pass counts the same, and the composite's
logits on the collated batch equal the thinker's on transformers' inputs for the same clip; a video without its
audio track is refused naming the record and the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.data.collate import collate
from plait.data.metadata import record_metadata
from plait.data.processing import ModalitySpec, MultimodalProcessor
from plait.data.sources import RawSample, SampleError
from plait.data.video import VideoSpec
from plait.models.hf_io_omni import composite_from_thinker
from tests.helpers.qwen2_5_omni import (OMNI_TOKENS, omni_media_processors, omni_tokenizer, tokenizer_thinker,
                                        write_clip)

FIELD = "model.encoders.vision.video"
CLIP = "<|vision_bos|><|audio_bos|><|VIDEO|><|audio_eos|><|vision_eos|>"


@pytest.fixture(scope="module")
def setup():
    tok = omni_tokenizer()
    hf = tokenizer_thinker(tok)
    model = composite_from_thinker(tokenizer_thinker(tok)).eval()
    image_proc, audio_proc = omni_media_processors()
    vision, audio = model.encoders["vision"], model.encoders["audio"]
    ids = dict(zip(OMNI_TOKENS, tok.convert_tokens_to_ids(OMNI_TOKENS)))
    video = VideoSpec("<|VIDEO|>", ids["<|VIDEO|>"], 2.0, 32, FIELD, vision.video_encoding, audio=True)
    specs = [ModalitySpec("vision", "image", "<|IMAGE|>", ids["<|IMAGE|>"], image_proc, vision.feature_count,
                          vision.check_item, video),
             ModalitySpec("audio", "audio", "<|AUDIO|>", ids["<|AUDIO|>"], audio_proc, audio.feature_count,
                          audio.check_item)]
    return tok, hf, model, MultimodalProcessor(tok, specs, 4096), ids


def _record(video: str, rid: str = "clip-1") -> RawSample:
    messages = ({"role": "user", "content": f"{CLIP}What do you hear?"}, {"role": "assistant", "content": "A tone."})
    return RawSample(rid, "t", messages, {"video": (video,)}, "clips.jsonl:1")


def _hf_inputs(batch, ids: dict, clip_tokens: torch.Tensor) -> dict:
    """transformers' inputs of the collated clip: its video tokens as ``<|VIDEO|>``, ``pixel_values_videos``, the
    grid, ``video_second_per_grid`` (2 frames / 2 fps), the audio window with its mask, ``use_audio_in_video``."""
    vision, audio = batch.modality_inputs["vision"], batch.modality_inputs["audio"]
    input_ids = torch.where(clip_tokens, ids["<|VIDEO|>"], batch.input_ids)
    frames = -(-audio["num_samples"] // 160)
    mask = (torch.arange(audio["input_features"].shape[-1])[None] < frames[:, None]).long()
    return dict(input_ids=input_ids, attention_mask=batch.attention_mask, pixel_values_videos=vision["pixel_values"][0],
                video_grid_thw=vision["image_grid_thw"][0][None], video_second_per_grid=torch.tensor([1.0]),
                input_features=audio["input_features"], feature_attention_mask=mask, use_audio_in_video=True)


def test_a_clip_is_processed_positioned_and_computed_as_the_thinker_does(setup, tmp_path):
    tok, hf, model, processor, ids = setup
    clip = write_clip(tmp_path / "clip.mkv", 8, rate=2, audio_s=4.0)  # 4 s: 4 temporal patches, 100 audio tokens
    sample = processor(_record(str(clip)), prompt_only=True)
    assert [n for _, n in sample.meta.items] == [16, 100] and [b for b, _ in sample.meta.items] == ["vision", "audio"]
    runs = [(int(t), len(list(g))) for t, g in __import__("itertools").groupby(sample.item_ids.tolist()) if t >= 0]
    assert runs == [(0, 8), (1, 50), (0, 8), (1, 50)]  # 2-s chunks: video then audio
    assert record_metadata(processor, _record(str(clip)), prompt_only=True) == sample.meta
    batch = collate([sample], processor.pad_id)
    inputs = _hf_inputs(batch, ids, batch.item_ids == 0)
    want, _ = hf.model.get_rope_index(inputs["input_ids"], None, inputs["video_grid_thw"], inputs["attention_mask"],
                                      True, inputs["feature_attention_mask"].sum(-1), inputs["video_second_per_grid"])
    assert torch.equal(batch.rope_position_ids, want)
    with torch.no_grad():
        stock = hf(**inputs).logits
        mine = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                     rope_position_ids=batch.rope_position_ids)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)


def test_a_video_without_its_audio_track_is_refused_naming_record_and_field(setup, tmp_path):
    _, _, _, processor, _ = setup
    silent = str(write_clip(tmp_path / "silent.mkv", 4, rate=2))
    message = rf"record 'clip-9' \(clips.jsonl:1\): video {silent} has no audio track, but {FIELD}.audio = true"
    with pytest.raises(SampleError, match=message):
        processor(_record(silent, "clip-9"))
    with pytest.raises(SampleError, match=message):
        record_metadata(processor, _record(silent, "clip-9"))
    # plait generate: the settings are the saved model's, which no flag changes: the error says what to give
    tok, image, audio = processor.tokenizer, processor.specs["image"], processor.specs["audio"]
    saved = dataclasses.replace(image, video=dataclasses.replace(image.video, saved="runs/omni/final"))
    generating = MultimodalProcessor(tok, [saved, audio], 4096)
    with pytest.raises(SampleError, match=r"has no audio track, but the model runs/omni/final takes each video with "
                                          r"its audio track .*\(give a video with sound, or its frames as images\)$"):
        generating(_record(silent, "clip-9"))


def test_a_clip_without_its_audio_start_and_end_tokens_is_refused_naming_the_field(setup, tmp_path):
    """``<|vision_bos|><|VIDEO|><|vision_eos|>`` around a clip: not the thinker's layout (two tokens each side)."""
    _, _, _, processor, _ = setup
    clip = str(write_clip(tmp_path / "clip.mkv", 4, rate=2, audio_s=2.0))
    messages = ({"role": "user", "content": "<|vision_bos|><|VIDEO|><|vision_eos|>What?"},
                {"role": "assistant", "content": "A tone."})
    message = (rf"record 'bare' \(clips.jsonl:1\): videos\[0\] \({clip}\): a video with its audio track is "
               r"written <\|vision_bos\|><\|audio_bos\|><clip><\|audio_eos\|><\|vision_eos\|>")
    with pytest.raises(SampleError, match=message):
        processor(RawSample("bare", "t", messages, {"video": (clip,)}, "clips.jsonl:1"))
    assert processor(_record(clip)).meta.items == (("vision", 8), ("audio", 50))


def test_a_job_asking_for_audio_tracks_needs_an_audio_branch(setup):
    tok, _, _, processor, _ = setup
    with pytest.raises(ValueError, match=f"{FIELD}.audio = true but the model has no audio encoder"):
        MultimodalProcessor(tok, [processor.specs["image"]], 512)


def test_a_silent_video_is_positioned_as_the_thinker_does(setup, tmp_path):
    """``audio = false``: the video alone, positioned by the thinker's rule (its text after the video continues past
    the video's largest temporal position), logits equal the thinker's."""

    tok, hf, model, processor, ids = setup
    image = processor.specs["image"]
    silent = MultimodalProcessor(tok, [dataclasses.replace(image, video=dataclasses.replace(image.video, audio=False)),
                                       processor.specs["audio"]], 4096)
    clip = write_clip(tmp_path / "clip.mkv", 8, rate=2, audio_s=4.0)
    messages = ({"role": "user", "content": "<|vision_bos|><|VIDEO|><|vision_eos|>What is seen?"},
                {"role": "assistant", "content": "grey"})
    batch = collate([silent(RawSample("v", "t", messages, {"video": (str(clip),)}, "x:1"), prompt_only=True)],
                    silent.pad_id)
    vision = batch.modality_inputs["vision"]
    inputs = dict(input_ids=torch.where(batch.item_ids == 0, ids["<|VIDEO|>"], batch.input_ids),
                  attention_mask=batch.attention_mask, pixel_values_videos=vision["pixel_values"][0],
                  video_grid_thw=vision["image_grid_thw"][0][None], video_second_per_grid=torch.tensor([1.0]))
    want, _ = hf.model.get_rope_index(inputs["input_ids"], None, inputs["video_grid_thw"], inputs["attention_mask"],
                                      False, None, inputs["video_second_per_grid"])
    assert torch.equal(batch.rope_position_ids, want)
    with torch.no_grad():
        stock = hf(**inputs).logits
        mine = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                     rope_position_ids=batch.rope_position_ids)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)


def test_an_embedded_clip_reads_as_its_file(setup, tmp_path):
    """A clip embedded in the data file (Parquet/Arrow ``videos`` bytes, :class:`MediaBytes`) gives the file's items,
    tokens and metadata; an embedded silent video is refused naming its label and the field."""
    from plait.data.sources import MediaBytes

    _, _, _, processor, _ = setup
    clip = write_clip(tmp_path / "clip.mkv", 8, rate=2, audio_s=3.0)
    embedded = MediaBytes(clip.read_bytes(), "videos[0] of clips.parquet:row 0 (embedded)")
    from_file, from_bytes = processor(_record(str(clip))), processor(_record(embedded))
    assert torch.equal(from_file.input_ids, from_bytes.input_ids) and from_file.meta == from_bytes.meta
    assert record_metadata(processor, _record(embedded)) == from_bytes.meta
    silent = MediaBytes(write_clip(tmp_path / "s.mkv", 4, rate=2).read_bytes(), "videos[0] of clips.parquet:row 1")
    with pytest.raises(SampleError, match=rf"video videos\[0\] of clips.parquet:row 1 has no audio track, but {FIELD}"):
        processor(_record(silent))


def test_a_silent_video_is_skipped_and_counted_with_on_error_skip(setup, tmp_path):
    """``data.on_error = "skip"``: the dataset keeps the clip, leaves the silent video out and reports it (id,
    file:line, the reason naming the field); ``"raise"`` stops with the same reason."""
    import json

    from plait.data.loader import MultimodalDataset

    _, _, _, processor, _ = setup
    clip, silent = write_clip(tmp_path / "a.mkv", 4, audio_s=2.0), write_clip(tmp_path / "b.mkv", 4)
    rows = [{"id": rid, "videos": [str(v)], "messages": [{"role": "user", "content": f"{CLIP}What is heard?"},
                                                          {"role": "assistant", "content": "x"}]}
            for rid, v in (("ok", clip), ("mute", silent))]
    data = tmp_path / "clips.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = MultimodalDataset(data, processor, on_error="skip", cache_dir=tmp_path / "cache")
    assert len(kept) == 1 and [s.id for s in kept.skipped] == ["mute"]
    assert kept.skipped[0].source == f"{data}:2" and f"has no audio track, but {FIELD}.audio" in kept.skipped[0].reason
    with pytest.raises(SampleError, match=f"record 'mute' .*has no audio track, but {FIELD}.audio = true"):
        MultimodalDataset(data, processor, cache_dir=tmp_path / "cache2")


def test_audio_tracks_need_a_tower_that_encodes_a_video_as_one_timed_item(setup, tmp_path):
    """Per-frame video items (another tower's encoding) cannot take the track: refused naming the video and field,
    by the processor and the metadata pass alike."""

    from plait.data.processing import PerFrame

    tok, _, _, processor, _ = setup
    image = processor.specs["image"]
    frames = dataclasses.replace(image, video=dataclasses.replace(image.video, encoding=PerFrame()))
    per_frame = MultimodalProcessor(tok, [frames, processor.specs["audio"]], 4096)
    clip = str(write_clip(tmp_path / "clip.mkv", 4, audio_s=2.0))
    message = f"video {clip}: {FIELD}.audio = true needs a tower that encodes a video as one timed item"
    with pytest.raises(SampleError, match=message):
        per_frame(_record(clip))
    with pytest.raises(SampleError, match=message):
        record_metadata(per_frame, _record(clip))


def test_two_videos_without_text_between_them_are_refused_by_processing(setup, tmp_path):
    """Two videos with no text token between them cannot be positioned: the record's processing refuses it naming
    the record, its file and line and the field (``videos[1]``), so ``data.on_error = "skip"`` drops it when the
    step loads it (the feed's failures) instead of the collator stopping the run."""
    import dataclasses
    import json

    from plait.data.loader import MultimodalDataset, SampleFeed

    tok, _, _, processor, _ = setup
    image = processor.specs["image"]
    silent = MultimodalProcessor(tok, [dataclasses.replace(image, video=dataclasses.replace(image.video, audio=False)),
                                       processor.specs["audio"]], 4096)
    clips = [str(write_clip(tmp_path / f"v{i}.mkv", 4)) for i in range(2)]
    good = "<|vision_bos|><|VIDEO|><|vision_eos|> and <|vision_bos|><|VIDEO|><|vision_eos|>"
    rows = [{"id": rid, "videos": clips, "messages": [{"role": "user", "content": f"{text} What is seen?"},
                                                       {"role": "assistant", "content": "x"}]}
            for rid, text in (("ok", good), ("tight", "<|vision_bos|><|VIDEO|><|VIDEO|><|vision_eos|>"))]
    data = tmp_path / "videos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = MultimodalDataset(data, silent, on_error="skip", cache_dir=tmp_path / "cache")
    assert len(dataset) == 2 and dataset.load(0).meta.id == "ok"
    message = (rf"record 'tight' \({data}:2\): item 1 \(video\) needs 1 text token.*item 1 is videos\[1\] "
               rf"\({clips[1]}\)")
    with pytest.raises(SampleError, match=message):
        dataset.load(1)
    loaded = SampleFeed(dataset, [(0, 1)]).next()
    assert sorted(loaded.samples) == [0] and "videos[1]" in loaded.failed[1]
