"""``model.pretrained`` jobs whose ``[model.encoders.<name>]`` tables only add flags: each branch's modality,
placeholder and processor default to the checkpoint's (``plait_config.json``, ``processors/<name>/``), the job's
explicit fields override, and a field that contradicts the checkpoint is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from plait.config.loader import config_from_dict
from plait.data.sources import parse_record
from plait.models.generation import save_final
from plait.models.registry import build_model, build_processor, load_tokenizer
from tests.helpers.jobs import DEMO, demo_records, tiny_config_dict


@pytest.fixture(scope="module")
def final(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """A tiny model saved as ``plait train`` saves ``final/`` (model, tokenizer, processors) and the token count
    of an image+audio sample under the job it was built from."""
    root = tmp_path_factory.mktemp("pretrained")
    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok)
    proc = build_processor(cfg.model, model, tok, 256)
    save_final(model, proc, root / "final")
    return root / "final", _counts(proc)


def _counts(proc) -> dict[str, int]:
    """Sequence length and placeholder tokens per modality of the first image+audio demo record."""
    sample = proc(parse_record(demo_records("train", ("image_audio",), limit=1)[0], "test:1", DEMO))
    ids = sample.input_ids
    return {"tokens": int(ids.numel()), **{n: int((ids == s.placeholder_id).sum()) for n, s in proc.specs.items()}}


def _job(final: Path, encoders: dict):
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"] = {"pretrained": str(final), "llm": {"attn_implementation": "eager"}, "encoders": encoders}
    return config_from_dict(cfg)


def _build(final: Path, encoders: dict):
    cfg = _job(final, encoders)
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok, device="meta")
    return model, build_processor(cfg.model, model, tok, 256)


def test_flag_only_tables_take_modality_placeholder_and_processor_from_the_checkpoint(final):
    folder, counts = final
    model, proc = _build(folder, {"vision": {"lora": {"r": 4, "alpha": 8.0}}, "audio": {"freeze": True}})
    vision, audio = proc.specs["image"], proc.specs["audio"]
    assert (vision.modality, vision.placeholder, audio.modality, audio.placeholder) == (
        "image", "<image>", "audio", "<audio>")
    assert vision.hf_processor.do_resize is False and list(vision.hf_processor.image_mean) == [0.5, 0.5, 0.5]
    assert isinstance(audio.hf_processor, transformers.WhisperFeatureExtractor)
    assert audio.hf_processor.hop_length == 160 and audio.hf_processor.sampling_rate == 16000
    # the same sample as under the job that trained the checkpoint: 32x32 image -> 16 patches, not 224x224's 784
    assert _counts(proc) == counts and counts["image"] == 16
    assert model.encoders["vision"].modality == "image" and model.encoders["audio"].downsample == 4


def test_explicit_processor_fields_override_the_saved_settings(final):
    _, proc = _build(final[0], {"vision": {"processor": {"image_mean": [0.25, 0.25, 0.25]}}})
    hf = proc.specs["image"].hf_processor
    assert list(hf.image_mean) == [0.25, 0.25, 0.25] and list(hf.image_std) == [0.5, 0.5, 0.5]
    assert hf.do_resize is False


def test_repeating_the_checkpoint_settings_is_allowed(final):
    _, proc = _build(final[0], {"vision": {"modality": "image", "placeholder": "<image>"},
                                "audio": {"modality": "audio", "downsample": 4, "projector": "linear"}})
    assert proc.specs["audio"].placeholder == "<audio>" and _counts(proc) == final[1]


@pytest.mark.parametrize("encoders,message", [
    ({"vision": {"modality": "audio"}},
     r"model.encoders.vision.modality = 'audio' but the checkpoint .* has 'image' for branch 'vision'"),
    ({"audio": {"downsample": 2}}, r"model.encoders.audio.downsample = 2 but the checkpoint .* has 4"),
    ({"vision": {"feature_layer": -2}}, r"model.encoders.vision.feature_layer = -2 but the checkpoint .* has -1"),
    ({"vision": {"select": "drop_cls"}}, r"model.encoders.vision.select = 'drop_cls' but the checkpoint .* has 'full'"),
    ({"vision": {"placeholder": "<audio>"}},
     r"model.encoders.vision.placeholder = '<audio>' but the checkpoint .* uses '<image>'"),
])
def test_a_field_that_contradicts_the_checkpoint_is_refused_naming_it(final, encoders, message):
    with pytest.raises(ValueError, match=message):
        _build(final[0], encoders)


def test_the_checkpoint_records_the_audio_window(final):
    meta = json.loads((final[0] / "plait_config.json").read_text())["encoders"]
    assert (meta["audio"]["hop_length"], meta["audio"]["sampling_rate"]) == (160, 16000)
    assert "hop_length" not in meta["vision"]


def test_without_saved_processors_the_job_table_is_used_with_the_checkpoint_modality(final, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for item in final[0].iterdir():
        if item.name != "processors":
            (bare / item.name).symlink_to(item)
    _, proc = _build(bare, {"audio": {"freeze": True}})
    assert isinstance(proc.specs["audio"].hf_processor, transformers.WhisperFeatureExtractor)
    assert proc.specs["audio"].placeholder == "<audio>"
