"""A misspelt key of a ``[model.encoders.<name>.processor]`` table is refused when the job is built, naming the
field and the close matches, for every family (transformers keeps an unknown key as an unused attribute)."""

from __future__ import annotations

import pytest
import transformers as T

from plait.config.loader import config_from_dict
from plait.models.processor_table import check_processor_table, processor_keys
from tests.helpers.jobs import TINY_AUDIO, TINY_VISION, tiny_config_dict, write_jsonl
from tests.helpers.pixtral_internvl import TINY_INTERNVL, TINY_PIXTRAL
from tests.helpers.qwen2_5_vl import TINY_QWEN2_5_VL
from tests.helpers.qwen2_audio import TINY_QWEN2_AUDIO
from tests.helpers.siglip2 import TINY_SIGLIP2

BRANCHES = {
    "siglip": {"modality": "image", "config": TINY_VISION},
    "siglip2": {"modality": "image", "config": TINY_SIGLIP2},
    "pixtral": {"modality": "image", "config": TINY_PIXTRAL},
    "internvl": {"modality": "image", "config": TINY_INTERNVL, "select": "drop_cls", "downsample": 2},
    "qwen2_5_vl": {"modality": "image", "config": TINY_QWEN2_5_VL, "select": "full"},
    "whisper": {"modality": "audio", "config": TINY_AUDIO, "downsample": 4, "projector": "linear"},
    "qwen2_audio": {"modality": "audio", "config": TINY_QWEN2_AUDIO, "projector": "linear"},
}


def _build(tmp_path, family: str, table: dict):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    data = write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"))
    cfg["model"]["encoders"] = {"enc": {**BRANCHES[family], "config": dict(BRANCHES[family]["config"]),
                                        "processor": table}}
    cfg = config_from_dict(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    return build_processor(cfg.model, build_model(cfg.model, tokenizer), tokenizer, 256).specs


@pytest.mark.parametrize("family, good, bad, message", [
    ("siglip", {"do_resize": False}, {"resample_x": 2}, r"resample_x: SiglipImageProcessorPil has no such setting "
                                                        r"\(did you mean resample or do_rescale\?\)"),
    ("siglip2", {"max_num_patches": 8}, {"max_num_patch": 8}, r"max_num_patch: Siglip2ImageProcessorPil has no such "
                                                              r"setting \(did you mean max_num_patches"),
    ("pixtral", {"size": {"longest_edge": 16}}, {"longest_edge": 16}, r"longest_edge: PixtralImageProcessorPil has "
                                                                      r"no such setting"),
    ("internvl", {"max_patches": 6}, {"max_patch": 6}, r"max_patch: GotOcr2ImageProcessorPil has no such setting "
                                                       r"\(did you mean max_patches"),
    ("qwen2_5_vl", {"image_mean": [0.25, 0.5, 0.75]}, {"max_pixel": 28 * 28 * 30},
     r"max_pixel: Qwen2VLImageProcessor(Pil)? has no such setting \(did you mean max_pixels"),
    ("whisper", {"hop_length": 160}, {"hop_lenght": 160}, r"hop_lenght: WhisperFeatureExtractor has no such setting "
                                                           r"\(did you mean hop_length"),
    ("qwen2_audio", {"dither": 0.0}, {"dithering": 0.0}, r"dithering: WhisperFeatureExtractor has no such setting "
                                                         r"\(did you mean dither"),
])
def test_a_misspelt_processor_key_is_refused_naming_field_and_close_matches(tmp_path, family, good, bad, message):
    specs = _build(tmp_path, family, good)  # a real key goes through and takes effect
    hf = next(iter(specs.values())).hf_processor
    key, value = next(iter(good.items()))
    got = getattr(hf, key)
    if isinstance(value, dict):
        assert {k: got[k] for k in value} == value
    else:
        assert (list(got) if isinstance(value, list) else got) == value
    with pytest.raises(ValueError, match=r"^model\.encoders\.enc\.processor\." + message):
        _build(tmp_path, family, bad)


def test_the_known_keys_are_the_class_settings_and_plaits_own():
    keys = processor_keys(T.WhisperFeatureExtractor)
    assert {"feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_side"} <= keys
    assert "resample" in processor_keys(T.Siglip2ImageProcessorPil)
    check_processor_table(T.Siglip2ImageProcessorPil(), {"class": "Siglip2ImageProcessorPil", "resample": 2})
    with pytest.raises(ValueError, match=r"processor.zzz: WhisperFeatureExtractor has no such setting \(its "
                                         r"settings: chunk_length, class, dither,"):
        check_processor_table(T.WhisperFeatureExtractor(), {"zzz": 1})


@pytest.mark.parametrize("family, table, message", [
    ("qwen2_5_vl", {"max_pixels": "abc"}, r"max_pixels: expected an integer, got 'abc'$"),
    ("siglip", {"do_resize": "no"}, r"do_resize: expected true or false, got 'no'$"),
    ("whisper", {"dither": "x"}, r"dither: expected a number, got 'x'$"),
])
def test_a_value_of_the_wrong_type_names_the_field_and_the_type(tmp_path, family, table, message):
    with pytest.raises(ValueError, match=r"^model\.encoders\.enc\.processor\." + message):
        _build(tmp_path, family, table)


def test_expected_types_follow_the_class_annotations_and_defaults():
    from plait.models.processor_table import expected_type, processor_types

    qwen, whisper = processor_types(T.Qwen2VLImageProcessorPil), processor_types(T.WhisperFeatureExtractor)
    assert expected_type(qwen["max_pixels"], 1003520) is None and expected_type(qwen["max_pixels"], True) == "an integer"
    assert expected_type(qwen["size"], "x") == "an integer or a list or a table"
    assert expected_type(qwen["size"], {"longest_edge": 100}) is None
    assert expected_type(qwen["image_mean"], [0.25, 0.5, 0.75]) is None and expected_type(qwen["image_mean"], 1) is None
    assert expected_type(qwen["resample"], "anything") is None  # an enum forward reference: not judged
    assert whisper["hop_length"] is int and whisper["dither"] is float and whisper["return_attention_mask"] is bool
    assert expected_type(whisper["dither"], 0) is None and expected_type(whisper["dither"], "0") == "a number"
