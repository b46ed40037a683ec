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
from plait.planner.cost.arch import units_from_configs
from plait.planner.pipeline.plan import plan_pipeline
from plait.config.schema import PipelineConfig
from plait.planner.pipeline.plan import synthetic_units
from plait.commands.plan.command import plan_command, split_global_batch
from plait.models.plan_inputs import MODEL_UNITS, build_plan_inputs, model_parts
from plait.train.job_file import load_config_for_planning
from plait.commands.plan.snippet import pp_snippet
from plait.commands.simulate import simulate_command
from plait.planner.report import PP_TOML_KEY, format_plan, plan_from_json, rank_peak_memory_bytes
from plait.planner.toml_text import toml_value
from plait.planner.search.layout import evaluate_plan
from plait.planner.types import UnitCost
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.jobs import TINY_AUDIO, TINY_LLM, TINY_VISION, tiny_config_dict

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


def _assert_rebuilds(cfg, choice, units=None):
    """The job's ``[parallel.pp]`` gives ``choice``'s stages (modules, units, ranks) on the real model's units."""
    kwargs = pipeline_plan_kwargs(cfg.parallel.pp, list(cfg.model.encoders))
    rebuilt = plan_pipeline(units or _real_units(cfg), cfg.parallel.pp.layout, **kwargs)
    assert [(s.modules, s.units, s.rank) for s in rebuilt.stages] == \
        [(s.modules, s.units, s.rank) for s in choice.plan.stages]


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
    # the analytic flag rules (arch.units_from_configs) agree with the model's on every unit
    configs, frozen, _ = model_parts(cfg)
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
    choice = plan_command(DEMO, 2, overrides=[f"--model.llm.config={toml_value(PHI)}"], device="cpu-preset",
                          dp_degrees=[1], out=out)
    assert choice.plan.num_ranks >= 1
    assert "no [parallel.pp] snippet: the unit names are not the model's: plait cannot build" in out.getvalue()


def test_snippet_pasted_into_the_job_file_is_accepted_and_rebuilds_the_plan(tmp_path):
    out = io.StringIO()
    choice = plan_command(DEMO, 4, tmp_path / "plan.json", device="cpu-preset", dp_degrees=[1], out=out)
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
    _assert_rebuilds(cfg, choice, units)
    names = {u.name for u in units}
    assert all(n in names for boundaries in table.get("splits", {}).values() for n in boundaries)


def test_several_replicas_get_one_replicas_table_and_the_parallel_dp_to_set(tmp_path):
    out = io.StringIO()
    choice = plan_command(DEMO, 4, tmp_path / "plan.json", device="cpu-preset", dp_degrees=[2], out=out)
    assert choice.dp == 2
    replicas = choice.dp // choice.dp_shard  # FSDP2 over the DP ranks when it is faster (it is on the preset)
    snippet = json.loads((tmp_path / "plan.json").read_text())[PP_TOML_KEY]
    assert snippet and snippet in out.getvalue()
    assert tomllib.loads(snippet)["parallel"]["dp"] == replicas
    assert f"processes = dp {replicas} x dp_shard {choice.dp_shard} x" in snippet.splitlines()[0]
    assert plan_from_json((tmp_path / "plan.json").read_text()) == choice
    job = tmp_path / "job.toml"  # the tables pasted as printed
    job.write_text(DEMO.read_text() + "\n" + snippet)
    cfg = load_config(job)
    assert cfg.parallel.dp == replicas and cfg.parallel.pp.degree == choice.plan.num_ranks
    if choice.plan.num_ranks > 1:
        assert cfg.parallel.pp.microbatches == choice.microbatches_per_replica
        _assert_rebuilds(cfg, choice)


def test_single_rank_replicas_snippet_says_no_pipeline_and_parallel_dp():
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    from plait.planner.search.layout import plan_layout

    choice = plan_layout(inputs.units, inputs.costs, 2, microbatches=2, machine=Machine(dtype=inputs.dtype),
                         space=SearchSpace(dp_degrees=[2], virtual_stages=(1,)))
    if choice.plan.num_ranks != 1:  # the demo on 2 CPUs: plain DP is the fastest 2-replica plan
        pytest.skip("the search put a pipeline in each replica")
    snippet, why = pp_snippet(cfg, choice, inputs.units)
    head = snippet.splitlines()[0]
    assert why == "" and tomllib.loads(snippet) == {"parallel": {"plan": "manual", "dp": 2, "dp_shard": 1, "tp": 1,
                                                                 "cp": 1}}
    assert "2 processes = dp 2 x" in head and "no pipeline" in head


def test_dp_out_of_range_names_the_dp_flag():
    # demo.toml: global batch 32 of microbatch 16 = 2 microbatches, so --dp is at most min(4 devices, 2) = 2
    with pytest.raises(ValueError, match=r"--dp 3: .* 1\.\.2 \(at most --devices 4 and the 2 microbatches"):
        plan_command(DEMO, 4, device="cpu-preset", dp_degrees=[3], out=io.StringIO())


def test_microbatches_split_the_global_batch_and_never_exceed_it():
    cfg = load_config(DEMO)  # global batch 32, microbatch 16
    with pytest.raises(ValueError, match=r"--microbatches 64: must be in 1\.\.32.*global_batch_size 32.*"
                                         r"microbatch_size 16"):
        plan_command(DEMO, 2, device="cpu-preset", microbatches=64, out=io.StringIO())
    for count, size in ((4, 8), (5, 7), (32, 1), (1, 32)):  # ceil(32 / count) samples each
        split = split_global_batch(cfg, count)
        assert split.train.microbatch_size == size and cfg.train.microbatch_size == 16
        inputs = build_plan_inputs(split, "cpu", microbatches=count)
        assert inputs.microbatches == count and inputs.shapes["llm"].tokens == size * 256
    out = io.StringIO()
    choice = plan_command(DEMO, 2, device="cpu-preset", microbatches=4, dp_degrees=[1], out=out)
    assert choice.microbatches == 4 and "4 microbatches of 8 samples (global batch 32)" in out.getvalue()


def test_the_jobs_own_pp_table_is_replaced_not_validated(tmp_path):
    text = DEMO.read_text()
    llm_only = text[:text.index("[model.encoders.vision]")] + text[text.index("[data]"):]
    job = tmp_path / "llm_only.toml"
    job.write_text(llm_only + "\n[parallel]\ndp = 4\n\n[parallel.pp]\nattach_encoders = true\n")
    with pytest.raises(ValueError, match="attach_encoders"):
        load_config(job)  # as a job to train, the table is invalid
    out = io.StringIO()
    choice = plan_command(job, 2, device="cpu-preset", dp_degrees=[1], out=out)
    assert choice.stages_per_module[-1][0] == "llm" and len(choice.stages_per_module) == 1
    assert ("the job's [parallel.pp] table and parallel.dp = 4 is not checked or used: the plan replaces it"
            in out.getvalue())
    cfg, replaced = load_config_for_planning(job, ["--parallel.pp.degree=7", "--train.lr=0.5"])
    assert replaced == "[parallel.pp] table and parallel.dp = 4"
    assert cfg.parallel.pp == PipelineConfig() and cfg.parallel.dp == 0 and cfg.train.lr == 0.5
    assert load_config_for_planning(DEMO) == (load_config(DEMO), "")
    with pytest.raises(ValueError, match="train.lr must be > 0"):  # everything else is still validated
        load_config_for_planning(job, ["--train.lr=-1"])


def test_plan_table_prints_the_per_rank_peak_memory():
    """Four equal trainable LLM units of 1 GiB of fp32 parameters (static: the parameters, 4 B/param gradients and
    12 B/param AdamW state = 5 GiB each; no activations) interleaved two per rank: each stage holds 5 GiB, each
    rank 10 GiB."""
    units = synthetic_units({}, [True] * 4)
    costs = [UnitCost(1e-3, 1e-3, 1e-3, param_bytes=2**30, activation_bytes=0, output_bytes=8) for _ in units]
    plan = plan_pipeline(units, stages_per_module={"llm": 4}, ranks=[0, 1, 0, 1])
    choice = evaluate_plan(plan, units, costs, dp=1, microbatches=4, schedule="interleaved_1f1b",
                           machine=Machine(dtype="float32"))
    assert choice.stage_memory_bytes == (5 * 2**30,) * 4
    text = format_plan(choice)
    assert "peak memory per rank (device) 10.00 GiB (no cap); ranks 10.00 / 10.00 GiB" in text
    assert "stage GiB" in text.splitlines()[0] and text.count("     5.00") == 4


def test_plan_and_simulate_print_the_same_peak_memory(tmp_path):
    out, sim = io.StringIO(), io.StringIO()
    choice = plan_command(DEMO, 3, tmp_path / "plan.json", device="cpu-preset", dp_degrees=[1], out=out)
    simulate_command(tmp_path / "plan.json", tmp_path / "sim", out=sim)
    planned = re.search(r"peak memory per rank \(device\) ([\d.]+ [GM]iB)", out.getvalue()).group(1)
    simulated = re.search(r"peak memory ([\d.]+ [GM]iB)", sim.getvalue()).group(1)
    assert planned == simulated
    for rank in range(choice.plan.num_ranks):  # a rank holds at least the static bytes of all its stages
        static = sum(choice.stage_static_bytes[s.index] for s in choice.plan.stages if s.rank == rank)
        assert rank_peak_memory_bytes(choice)[rank] >= static


@pytest.mark.parametrize("kind", ["profile", "trace", "no_plan_key", "list"])
def test_simulate_names_a_file_that_is_not_a_plan(tmp_path, kind):
    plan_json = tmp_path / "plan.json"
    choice = plan_command(DEMO, 2, plan_json, device="cpu-preset", dp_degrees=[1], out=io.StringIO())
    data = {
        "profile": {"format": 1, "key": {}, "units": [], "measurements": [], "chunk_overhead_s": {}},
        "trace": {"traceEvents": [{"ph": "X", "name": "F0"}], "displayTimeUnit": "ms"},
        "no_plan_key": {k: v for k, v in choice.to_dict().items() if k != "plan"},
        "list": [1, 2],
    }[kind]
    bad = tmp_path / f"{kind}.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        simulate_command(bad, tmp_path / "sim", out=io.StringIO())
    message = str(info.value)
    assert f"--plan {bad} is not a plan JSON written by `plait plan --out`" in message
    assert "LayoutChoice.__init__" not in message and "unknown field" not in message
    if kind == "no_plan_key":
        assert "missing ['plan']" in message
    if kind in ("profile", "trace"):
        assert ("a profile" if kind == "profile" else "a Chrome trace") in message


def test_interleaved_plan_snippet_is_accepted_and_rebuilds_the_plan(tmp_path):
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    from plait.planner.search.layout import plan_layout

    choice = plan_layout(inputs.units, inputs.costs, 3, microbatches=4, machine=Machine(dtype=inputs.dtype),
                         space=SearchSpace(dp_degrees=[1], layouts=["encoders_colocated"], virtual_stages=(2,)))
    assert choice.schedule == "interleaved_1f1b" and choice.plan.num_stages > choice.plan.num_ranks
    snippet, why = pp_snippet(cfg, choice, inputs.units)
    assert why == "", why
    table = tomllib.loads(snippet)["parallel"]["pp"]
    assert table["virtual_stages"] == 2 and table["schedule"] == "interleaved_1f1b"
    job = tmp_path / "job.toml"
    job.write_text(DEMO.read_text() + "\n" + snippet)
    cfg = load_config(job)
    _assert_rebuilds(cfg, choice)


def test_single_rank_plan_snippet_is_degree_one():
    cfg = load_config(DEMO)
    inputs = build_plan_inputs(cfg, "cpu")
    from plait.planner.search.layout import plan_layout

    choice = plan_layout(inputs.units, inputs.costs, 1, microbatches=2, machine=Machine(dtype=inputs.dtype),
                         space=SearchSpace(dp_degrees=[1]))
    snippet, why = pp_snippet(cfg, choice, inputs.units)
    assert why == "" and tomllib.loads(snippet) == {"parallel": {"plan": "manual", "dp": 1, "dp_shard": 1, "tp": 1,
                                                                 "cp": 1}}


@pytest.mark.parametrize("value", [
    7, True, False, "language_model.model.layers.3", 'quote " backslash \\ tab \t é', ["a", "b.c"],
    {"vision": 1, "audio-2": 2, "odd.key": 3, "spaced key": ["x"]}, {},
])
def test_toml_values_read_back_as_written(value):
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_toml_value_rejects_other_types():
    for bad in (1.5, None):
        with pytest.raises(ValueError, match="no TOML form"):
            toml_value(bad)
