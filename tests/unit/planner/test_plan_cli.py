"""``plait plan`` names units as the job's model does, and prints / writes a ``[parallel.pp]`` table the config
loader accepts and that rebuilds the chosen plan."""

from __future__ import annotations

import io
import json
import re
import tomllib
from pathlib import Path

import pytest

from plait.config.loader import config_from_dict, load_config, pipeline_plan_kwargs
from plait.models.registry import build_model, load_tokenizer
from plait.models.units import model_units
from plait.planner.cost_model import units_from_configs
from plait.planner.pipeline_plan import plan_pipeline
from plait.planner.plan_cli import (
    MODEL_UNITS,
    PP_TOML_KEY,
    _model_parts,
    _toml_value,
    build_plan_inputs,
    plan_command,
    plan_from_json,
    pp_snippet,
)
from tests.conftest import TINY_AUDIO, TINY_LLM, TINY_VISION, tiny_config_dict

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"

QWEN2 = dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, image_size=32, patch_size=8)
PHI = dict(model_type="phi", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=512)

# hand-written from the Hugging Face module trees (transformers 5): SigLIP/CLIP keep their layers under
# ``encoder.layers``, Whisper's encoder directly under ``layers``; LLaMA/Qwen2 under ``model.layers``
SIGLIP_NAMES = ["encoders.vision.encoder.embeddings", "encoders.vision.encoder.encoder.layers.0",
                "encoders.vision.encoder.encoder.layers.1", "encoders.vision.projector"]
WHISPER_NAMES = ["encoders.audio.encoder.conv1", "encoders.audio.encoder.layers.0",
                 "encoders.audio.encoder.layers.1", "encoders.audio.encoder.layer_norm", "encoders.audio.projector"]


def _llm_names(layers: int) -> list[str]:
    return (["language_model.model.embed_tokens"] + [f"language_model.model.layers.{i}" for i in range(layers)]
            + ["language_model.model.norm", "language_model.lm_head"])


def _job(llm=TINY_LLM, vision=TINY_VISION, audio=TINY_AUDIO, settings=None):
    """A tiny job config; ``settings``: ``{"vision": {...}, "audio": {...}}`` extra fields per branch."""
    data = tiny_config_dict("train.jsonl")
    data["model"]["llm"]["config"] = dict(llm)
    branches = data["model"]["encoders"]
    branches["vision"]["config"], branches["audio"]["config"] = dict(vision), dict(audio)
    for name, fields in (settings or {}).items():
        branches[name].update(fields)
    return config_from_dict(data)


def _real_units(cfg):
    """The units of the model the trainer builds for ``cfg`` (real tokenizer), on the meta device."""
    return model_units(build_model(cfg.model, load_tokenizer(cfg.data.tokenizer), device="meta"))


def _analytic_twin(unit, analytic):
    """The ``units_from_configs`` unit of the same module, kind and layer index as ``unit``."""
    index = re.search(r"(\d+)$", unit.name)
    for u in analytic:
        same_layer = unit.kind != "layer" or u.name.endswith(f".{index.group(1)}")
        if u.module == unit.module and u.kind == unit.kind and same_layer:
            return u
    raise AssertionError(f"no analytic unit for {unit.name}")


CASES = {
    "siglip+whisper+llama, all trainable": (
        _job, {}, SIGLIP_NAMES + WHISPER_NAMES + _llm_names(2)),
    "frozen encoders and llm, trainable projectors": (
        _job, dict(vision={"freeze": True}, audio={"freeze": True}), SIGLIP_NAMES + WHISPER_NAMES + _llm_names(2)),
    "clip (second-to-last layer, no CLS) + whisper (second-to-last) + qwen2": (
        lambda settings: _job(llm=QWEN2, vision=CLIP, settings=settings),
        dict(vision={"feature_layer": -2, "select": "drop_cls", "freeze": True},
             audio={"feature_layer": -2, "freeze_projector": True}),
        ["encoders.vision.encoder.embeddings", "encoders.vision.encoder.encoder.layers.0",
         "encoders.vision.encoder.encoder.layers.1", "encoders.vision.projector"]
        + WHISPER_NAMES[:2] + WHISPER_NAMES[4:] + _llm_names(3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_plan_units_are_the_models_units_by_name_order_and_flags(case):
    make, settings, expected = CASES[case]
    cfg = make(settings=settings)
    if "frozen encoders" in case:
        cfg.model.llm.freeze = True
    inputs = build_plan_inputs(cfg, "cpu")
    real = _real_units(cfg)
    assert inputs.unit_source == MODEL_UNITS
    assert [u.name for u in inputs.units] == [u.name for u in real] == expected
    assert inputs.units == real  # kinds, modules and frozen-aware flags too
    # the analytic flag rules (cost_model.units_from_configs) agree with the model's on every unit
    configs, frozen, _ = _model_parts(cfg)
    analytic = units_from_configs(configs, frozen)
    for unit in real:
        twin = _analytic_twin(unit, analytic)
        assert (twin.trainable, twin.needs_input_grad) == (unit.trainable, unit.needs_input_grad), unit.name
    assert len(inputs.costs) == len(real)


def test_a_model_plait_cannot_build_keeps_analytic_names_and_gets_no_snippet():
    cfg = _job(llm=PHI)  # Phi's final norm is model.final_layernorm: no pipeline layout in plait.models.hf
    inputs = build_plan_inputs(cfg, "cpu")
    assert inputs.unit_source.startswith("plait cannot build this model") and "no pipeline layout" in inputs.unit_source
    assert [u.name for u in inputs.units if u.module == "llm"][:2] == ["llm.embed_tokens", "llm.layers.0"]
    out = io.StringIO()
    choice = plan_command(DEMO, 2, overrides=[f"--model.llm.config={_toml_value(PHI)}"], device="cpu",
                          dp_degrees=[1], out=out)
    assert choice.plan.num_ranks >= 1
    assert "no [parallel.pp] snippet: the unit names are not the model's: plait cannot build" in out.getvalue()


def test_snippet_pasted_into_the_job_file_is_accepted_and_rebuilds_the_plan(tmp_path):
    out = io.StringIO()
    choice = plan_command(DEMO, 4, tmp_path / "plan.json", device="cpu", dp_degrees=[1], out=out)
    written = json.loads((tmp_path / "plan.json").read_text())
    snippet = written[PP_TOML_KEY]
    assert snippet and snippet in out.getvalue()
    assert plan_from_json((tmp_path / "plan.json").read_text()) == choice
    table = tomllib.loads(snippet)["parallel"]["pp"]
    assert table["degree"] == choice.plan.num_ranks and table["layout"] == choice.layout
    assert table["stages"] == dict(choice.stages_per_module) and table["schedule"] == choice.schedule
    assert table["microbatches"] == choice.microbatches_per_replica
    job = tmp_path / "job.toml"
    job.write_text(DEMO.read_text() + "\n" + snippet)  # pasted at the end of the job file
    cfg = load_config(job)
    assert cfg.parallel.pp.degree == choice.plan.num_ranks
    # the pasted table gives the planned stages on the real model's units
    units = _real_units(cfg)
    kwargs = pipeline_plan_kwargs(cfg.parallel.pp, list(cfg.model.encoders))
    rebuilt = plan_pipeline(units, cfg.parallel.pp.layout, **kwargs)
    assert [(s.modules, s.units, s.rank) for s in rebuilt.stages] == \
        [(s.modules, s.units, s.rank) for s in choice.plan.stages]
    names = {u.name for u in units}
    assert all(n in names for boundaries in table.get("splits", {}).values() for n in boundaries)


def test_no_snippet_for_several_replicas(tmp_path):
    out = io.StringIO()
    choice = plan_command(DEMO, 4, tmp_path / "plan.json", device="cpu", dp_degrees=[2], out=out)
    assert choice.dp == 2
    assert json.loads((tmp_path / "plan.json").read_text())[PP_TOML_KEY] is None
    assert "no [parallel.pp] snippet: the plan has 2 data-parallel replicas" in out.getvalue()
    assert plan_from_json((tmp_path / "plan.json").read_text()) == choice


def test_interleaved_plan_snippet_is_accepted_and_rebuilds_the_plan(tmp_path):
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    from plait.planner.search import plan_layout

    choice = plan_layout(inputs.units, inputs.costs, 3, microbatches=4, dp_degrees=[1], dtype=inputs.dtype,
                         layouts=["encoders_colocated"], virtual_stages=(2,))
    assert choice.schedule == "interleaved_1f1b" and choice.plan.num_stages > choice.plan.num_ranks
    snippet, why = pp_snippet(cfg, choice, inputs.units)
    assert why == "", why
    table = tomllib.loads(snippet)["parallel"]["pp"]
    assert table["virtual_stages"] == 2 and table["schedule"] == "interleaved_1f1b"
    job = tmp_path / "job.toml"
    job.write_text(DEMO.read_text() + "\n" + snippet)
    cfg = load_config(job)
    kwargs = pipeline_plan_kwargs(cfg.parallel.pp, list(cfg.model.encoders))
    rebuilt = plan_pipeline(_real_units(cfg), cfg.parallel.pp.layout, **kwargs)
    assert [(s.modules, s.units, s.rank) for s in rebuilt.stages] == \
        [(s.modules, s.units, s.rank) for s in choice.plan.stages]


def test_single_rank_plan_snippet_is_degree_one():
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    from plait.planner.search import plan_layout

    choice = plan_layout(inputs.units, inputs.costs, 1, microbatches=2, dp_degrees=[1], dtype=inputs.dtype)
    snippet, why = pp_snippet(cfg, choice, inputs.units)
    assert why == "" and tomllib.loads(snippet) == {"parallel": {"pp": {"degree": 1}}}


@pytest.mark.parametrize("value", [
    7, True, False, "language_model.model.layers.3", 'quote " backslash \\ tab \t é', ["a", "b.c"],
    {"vision": 1, "audio-2": 2, "odd.key": 3, "spaced key": ["x"]}, {},
])
def test_toml_values_read_back_as_written(value):
    assert tomllib.loads(f"v = {_toml_value(value)}")["v"] == value


def test_toml_value_rejects_other_types():
    for bad in (1.5, None):
        with pytest.raises(ValueError, match="no TOML form"):
            _toml_value(bad)
