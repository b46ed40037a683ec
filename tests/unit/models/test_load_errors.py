"""A wrong model folder or a typo in a ``config`` table names the job's field (found by a fresh-user pass)."""

from __future__ import annotations

import re

import pytest
from transformers import CLIPVisionConfig

from plait.config.loader import config_from_dict
from plait.models.registry import compose_model, load_tokenizer
from tests.helpers.jobs import tiny_config_dict


def _compose(tmp_path, edit):
    data = tiny_config_dict(str(tmp_path / "t.jsonl"))
    edit(data["model"])
    cfg = config_from_dict(data)
    return compose_model(cfg.model, load_tokenizer(cfg.data.tokenizer), weights=False)


def test_an_llm_path_holding_a_vision_model_names_the_field(tmp_path):
    folder = tmp_path / "clip"
    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)

    def edit(model):
        model["llm"] = {"path": str(folder)}
    with pytest.raises(ValueError, match=re.escape(f"model.llm.path {folder} holds a clip_vision_model, not a causal LM")):
        _compose(tmp_path, edit)


def test_an_encoder_path_without_config_json_names_the_field(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()

    def edit(model):
        name = next(n for n, e in model["encoders"].items() if e.get("modality") == "image")
        model["encoders"][name] = {**model["encoders"][name], "path": str(folder)}
        model["encoders"][name].pop("config")
    with pytest.raises(ValueError, match=re.escape(f".path {folder} has no config.json")) as info:
        _compose(tmp_path, edit)
    assert str(info.value).startswith("model.encoders.")


def test_typos_in_config_tables_namethe_table(tmp_path):
    def llm_typo(model):
        model["llm"]["config"] = {**model["llm"]["config"], "hiden_size": 8}
    with pytest.raises(ValueError, match=re.escape("model.llm.config: ") + r".* config has no field\(s\) \['hiden_size'\]"):
        _compose(tmp_path, llm_typo)

    def llm_type(model):
        model["llm"]["config"] = {**model["llm"]["config"], "model_type": "lama"}
    with pytest.raises(ValueError, match=re.escape("model.llm.config: unknown model_type 'lama'")):
        _compose(tmp_path, llm_type)

    def encoder_typo(model):
        name = next(iter(model["encoders"]))
        model["encoders"][name]["config"] = {**model["encoders"][name]["config"], "hiden_size": 8}
    with pytest.raises(ValueError, match=r"model\.encoders\.\w+\.config: .* config has no field\(s\) \['hiden_size'\]"):
        _compose(tmp_path, encoder_typo)


@pytest.mark.parametrize("table, value, message", [
    ("llm", {"hidden_size": "abc"}, r"model\.llm\.config: Validation error for field 'hidden_size': TypeError: "
                                    r"Field 'hidden_size' expected int, got str \(value: 'abc'\)"),
    ("llm", {"num_attention_heads": 3}, r"model\.llm\.config: .*The hidden size \(\d+\) is not a multiple of the "
                                        r"number of attention heads \(3\)"),
    ("llm", {"hidden_size": -64}, r"model\.llm\.config: cannot build the model from this table: .*negative "
                                  r"dimension -64"),
    ("encoder", {"hidden_size": -32}, r"model\.encoders\.\w+\.config: cannot build the model from this table: "
                                      r".*negative dimension -32"),
])
def test_bad_values_in_config_tables_name_the_table_and_the_librarys_reason(tmp_path, table, value, message):
    """Bad values (not typos) in a ``config`` table ended in a traceback (found by a fresh-user pass)."""
    def edit(model):
        target = model["llm"] if table == "llm" else next(iter(model["encoders"].values()))
        target["config"] = {**target["config"], **value}
    for weights in (False, True):
        data = tiny_config_dict(str(tmp_path / "t.jsonl"))
        edit(data["model"])
        cfg = config_from_dict(data)
        with pytest.raises(ValueError, match=message) as info:
            compose_model(cfg.model, load_tokenizer(cfg.data.tokenizer), weights=weights)
        assert "\n" not in str(info.value)
