"""TOML job files, dotted overrides and validation errors."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, load_config, parse_overrides
from tests.helpers.jobs import ROOT, tiny_config_dict


def test_demo_config_loads_with_overrides():
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--train.lr=5e-4", "--data.on_error=skip",
                                                       "--model.encoders.audio.freeze=true"])
    assert cfg.train.lr == 5e-4
    assert cfg.data.on_error == "skip"
    assert cfg.model.encoders["audio"].freeze is True
    assert cfg.model.encoders["vision"].config["patch_size"] == 4
    assert cfg.train.betas == (0.9, 0.95)


def test_override_values_are_typed():
    assert parse_overrides(["--a.b=3", "--a.c=0.5", "--a.d=true", "--a.e=hello", "--a.f=[1, 2]"]) == {
        "a.b": 3, "a.c": 0.5, "a.d": True, "a.e": "hello", "a.f": [1, 2]}
    with pytest.raises(ValueError, match="must look like --section.key=value"):
        parse_overrides(["--train.lr"])
    with pytest.raises(ValueError, match="key must be dotted"):
        parse_overrides(["--lr=1"])


@pytest.mark.parametrize("override, message", [
    ("--train.lrr=1", r"unknown config key\(s\) \['train.lrr'\]"),
    ("--train.steps=ten", "train.steps: expected int, got 'ten'"),
    ("--train.dtype=fp8", "train.dtype must be auto, fp32 or bf16"),
    ("--data.on_error=ignore", "data.on_error must be 'raise' or 'skip'"),
    ("--model.encoders.vision.projector=conv", "model.encoders.vision.projector must be 'linear', 'mlp' or 'gemma3'"),
    ("--train.microbatch_size=0", "train.microbatch_size must be >= 1"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(ROOT / "configs" / "demo.toml", [override])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(bad)


def test_llm_needs_exactly_one_source():
    data = tiny_config_dict("t.jsonl")
    data["model"]["llm"]["path"] = "somewhere"
    cfg = config_from_dict(data)
    from plait.config.loader import validate

    with pytest.raises(ValueError, match="model.llm: give exactly one of path and config"):
        validate(cfg)


def test_typos_in_hugging_face_config_tables_are_refused(tmp_path):
    from plait.models.hf import build_causal_lm

    with pytest.raises(ValueError, match=r"llama config has no field\(s\) \['hidden_sise'\]"):
        build_causal_lm(config={"model_type": "llama", "hidden_sise": 64}, vocab_size=10)
    with pytest.raises(ValueError, match="unknown model_type 'lama'"):
        build_causal_lm(config={"model_type": "lama"}, vocab_size=10)


def test_missing_tokenizer_directory_names_the_field(tmp_path):
    from plait.models.registry import load_tokenizer

    with pytest.raises(FileNotFoundError, match="data.tokenizer: tokenizer directory .* does not exist"):
        load_tokenizer(str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="data.tokenizer: cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_microbatch_larger_than_the_global_batch_is_reported(caplog):
    with caplog.at_level("WARNING", logger="plait.config.loader"):
        load_config(ROOT / "configs" / "demo.toml", ["--train.global_batch_size=4"])
    assert "train.microbatch_size (16) is larger than train.global_batch_size (4)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="plait.config.loader"):
        load_config(ROOT / "configs" / "demo.toml")
    assert "microbatch_size" not in caplog.text


def test_feature_layer_outside_the_encoder_names_the_branch():
    from plait.models.registry import build_model, load_tokenizer

    cfg = load_config(ROOT / "configs" / "demo.toml", ["--model.encoders.vision.feature_layer=-5"])
    with pytest.raises(ValueError, match=r"model.encoders.vision: feature_layer=-5 is outside this 3-layer "
                                         r"encoder's hidden states \(-4..3\)"):
        build_model(cfg.model, load_tokenizer(cfg.data.tokenizer), device="meta")
    cfg = load_config(ROOT / "configs" / "demo.toml", ["--model.encoders.vision.feature_layer=-4"])
    build_model(cfg.model, load_tokenizer(cfg.data.tokenizer), device="meta")  # the embeddings' output: valid
