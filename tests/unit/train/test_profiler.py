"""Profiler, profile store and the automatic plan: bytes checked against the parameters and tensor shapes,
freezing against the frozen-aware rules, the store's hit and miss on every key field, stage costs by hand,
and the automatic plan against brute force over every runnable plan."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json

import pytest
import torch

from plait.config.loader import config_from_dict, config_to_dict, pipeline_plan_kwargs, validate
from plait.models.units import model_units, unit_specs
from plait.commands.profile import ProfileStore, load_or_measure
from plait.planner.auto_plan import plan_auto_layout
from plait.planner.pipeline_plan import plan_pipeline, synthetic_units
from plait.planner.profile import (
    Profile,
    ProfileKey,
    UnitMeasurement,
    profile_mismatch,
    stage_action_costs,
)
from plait.planner.search import evaluate_plan
from plait.planner.types import UnitCost
from plait.train.auto_plan import resolve_auto_plan
from plait.train.profiler import measure_profile, microbatch_shapes, profile_key
from tests.conftest import tiny_config_dict
from tests.distributed.pipeline_worker import apply_mode, make_batch, tiny_model

KEY = ProfileKey({"llm": {"hidden_size": 32}, "freeze": False}, [{"input_ids": [2, 9]}], "float32",
                 "cpu x86_64 (1 threads)", "0.1.0", "2.13.0")


def _measurement(name: str, f: float = 1.0, dx: float = 0.5, dw: float = 0.75, fused: float = 1.0) -> UnitMeasurement:
    return UnitMeasurement(name, f, dx, dw, fused, 400, 400, 800, 100, 50)


def _profile(key: ProfileKey = KEY) -> Profile:
    units = synthetic_units({"vision": [False, True]}, [True, True])
    return Profile(key, units, tuple(_measurement(u.name) for u in units), {"vision": {"F": 0.1, "B": 0.2}}, 3, 1)


# ----- store ------------------------------------------------------------------------------------------------
def test_store_hit_round_trips_the_profile(tmp_path):
    store = ProfileStore(tmp_path)
    profile = _profile()
    path = store.save(profile)
    loaded, reason = store.load(ProfileKey.from_dict(json.loads(json.dumps(KEY.to_dict()))))
    assert reason == "hit" and path == store.path_for(KEY)
    assert loaded == profile and loaded.costs == profile.costs


@pytest.mark.parametrize("field, value, where", [
    ("model", {"llm": {"hidden_size": 64}, "freeze": False}, "model.llm.hidden_size"),
    ("model", {"llm": {"hidden_size": 32}, "freeze": True}, "model.freeze"),
    ("shapes", [{"input_ids": [2, 10]}], "shapes[0].input_ids[1]"),
    ("dtype", "bfloat16", "dtype"),
    ("device", "NVIDIA H200", "device"),
    ("plait_version", "0.2.0", "plait_version"),
    ("torch_version", "2.14.0", "torch_version"),
    ("clock", "thread", "clock"),
])
def test_store_misses_on_every_changed_key_field(tmp_path, field, value, where):
    store = ProfileStore(tmp_path)
    target = tmp_path / "profile.json"
    store.save(_profile(), target)  # an explicit file: the key is still checked field by field
    wanted = dataclasses.replace(KEY, **{field: value})
    loaded, reason = store.load(wanted, target)
    assert loaded is None and "stale" in reason and f"{where} differs" in reason
    assert profile_mismatch(KEY, wanted).startswith(f"{where} differs")
    assert store.load(wanted)[1].startswith("no stored profile")  # its own file name differs too


def test_store_rejects_unreadable_files(tmp_path):
    target = tmp_path / "bad.json"
    target.write_text(json.dumps({"format": 99}))
    loaded, reason = ProfileStore(tmp_path).load(KEY, target)
    assert loaded is None and "unreadable" in reason


def test_load_or_measure_reuses_only_a_matching_profile(tmp_path):
    store, calls, out = ProfileStore(tmp_path), [], io.StringIO()

    def measure(key):
        def run():
            calls.append(key)
            return _profile(key)
        return run

    first = load_or_measure(store, KEY, measure(KEY), out=out)
    again = load_or_measure(store, KEY, measure(KEY), out=out)
    other = dataclasses.replace(KEY, dtype="bfloat16")
    store.save(_profile(), store.path_for(other))  # a stale file under the other key's name
    load_or_measure(store, other, measure(other), out=out)
    forced = load_or_measure(store, KEY, measure(KEY), force=True, out=out)
    assert calls == [KEY, other, KEY] and first == again == forced
    text = out.getvalue()
    assert "reusing" in text and "dtype differs (stored 'float32', wanted 'bfloat16')" in text


@pytest.mark.parametrize("text, why", [
    ("not json at all", "not JSON"),
    (json.dumps([1, 2]), "a JSON list, not an object"),
    (json.dumps({"dp": 1, "plan": {"stages": []}, "parallel_pp_toml": None}), "no profile 'format' or 'key' key"),
    (json.dumps({"format": 1, "units": []}), "no profile 'key' key"),
])
@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_load_or_measure_never_overwrites_a_file_that_is_not_a_profile(tmp_path, text, why, force, explicit):
    store, calls = ProfileStore(tmp_path), []
    target = tmp_path / "mine.json" if explicit else store.path_for(KEY)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)

    def measure():
        calls.append(1)
        return _profile()

    with pytest.raises(ValueError, match=f"profile file {target} exists and is not a plait profile .*{why}"):
        load_or_measure(store, KEY, measure, path=target if explicit else None, force=force, out=io.StringIO())
    assert calls == [] and target.read_text() == text  # refused before measuring, file untouched
    with pytest.raises(ValueError, match="refusing to overwrite"):
        store.save(_profile(), target)
    assert target.read_text() == text


def test_load_or_measure_replaces_a_profile_of_another_key_or_format(tmp_path):
    store, out = ProfileStore(tmp_path), io.StringIO()
    target = tmp_path / "p.json"
    store.save(_profile(dataclasses.replace(KEY, dtype="bfloat16")), target)  # a readable profile, other key
    assert load_or_measure(store, KEY, _profile, path=target, out=out) == _profile()
    assert "stale: dtype differs" in out.getvalue() and store.load(KEY, target)[1] == "hit"
    target.write_text(json.dumps({"format": 0, "key": {"dtype": "float32"}}))  # an older plait profile
    assert load_or_measure(store, KEY, _profile, path=target, out=out) == _profile()
    assert "profile format 0 is not 1" in out.getvalue() and store.load(KEY, target)[1] == "hit"


def test_format_profile_explains_negative_chunk_overheads():
    from plait.planner.report import format_profile

    positive = _profile()  # vision chunk overhead F 0.1 s, B 0.2 s
    assert "chunk overhead vision: F 100.000 ms, B 200.000 ms" in format_profile(positive)
    assert "negative" not in format_profile(positive)
    negative = dataclasses.replace(positive, chunk_overhead_s={"vision": {"F": -0.006533, "B": 0.001}})
    text = format_profile(negative)
    assert "chunk overhead vision: F -6.533 ms, B 1.000 ms" in text
    note = [line for line in text.splitlines() if "negative" in line]
    assert len(note) == 1 and "faster as one chunk than its units measured apart" in note[0]
    assert "kept as a correction" in note[0]


# ----- costs from measurements ----------------------------------------------------------------------------------
def test_unit_cost_backward_is_what_the_runtime_runs():
    units = synthetic_units({"vision": [True, True]}, [True])
    first, second = units[0], units[1]
    assert not first.needs_input_grad and second.needs_input_grad
    m = _measurement("x", f=2.0, dx=0.5, dw=0.75, fused=1.0)
    assert m.to_cost(first) == UnitCost(2.0, 0.5, 0.75, 400, 100, 50)  # dW alone: no input gradient needed
    cost = m.to_cost(second)
    assert cost.weight_grad_s == 0.5 and cost.backward_s(second) == 1.0  # fused = dX + (fused - dX)


def test_stage_action_costs_by_hand():
    # vision: frozen embed (no backward), trainable layer; llm: two trainable units
    profile = _profile()
    names = [u.name for u in profile.units]
    plan = plan_pipeline(profile.units, "encoder_parallel")  # stage 0: vision, stage 1: llm
    got = stage_action_costs(plan, profile)
    # vision: F = 1 + 1 + 0.1; B: unit 0 runs none, unit 1 trains without input gradient: dW = 0.75, + 0.2
    assert got[(0, "F")] == pytest.approx(2.1) and got[(0, "B")] == pytest.approx(0.95)
    # llm: both need an input gradient (a vision unit trains): fused 1.0 each, no overhead
    assert got[(1, "F")] == pytest.approx(2.0) and got[(1, "B")] == pytest.approx(2.0)
    split = stage_action_costs(plan, profile, split_backward=True)
    assert split[(1, "B")] == pytest.approx(1.0) and split[(1, "W")] == pytest.approx(1.0)
    assert split[(0, "B")] == 0.0 and split[(0, "W")] == pytest.approx(0.95)
    assert len(names) == 4
    busy = stage_action_costs(plan, dataclasses.replace(profile, action_overhead_s=0.01))  # every action pays it
    assert [busy[k] - got[k] for k in sorted(got) if k[1] != "W"] == pytest.approx([0.01] * 4)


# ----- the profiler on a real (tiny) model ----------------------------------------------------------------------
def _bytes_of(model, spec) -> tuple[int, int]:
    params = {id(p): p for m in spec.modules for p in model.get_submodule(m).parameters()}.values()
    total = sum(p.numel() * 4 for p in params)
    return total, sum(p.numel() * 4 for p in params if p.requires_grad), len([p for p in params if p.requires_grad])


@pytest.mark.parametrize("mode", ["all", "projectors"])
def test_profiler_measures_every_unit_of_a_real_model(mode):
    torch.set_num_threads(1)
    model = apply_mode(tiny_model(), mode)
    flags = [p.requires_grad for p in model.parameters()]
    batch = make_batch("ia", 3)
    key = profile_key({"mode": mode}, [batch], torch.float32, "cpu")
    profile = measure_profile(model, [batch], key, repeats=1, warmup=0)
    assert [p.requires_grad for p in model.parameters()] == flags  # flags restored
    assert profile.units == model_units(model) and key.shapes == microbatch_shapes([batch])
    by_name = {m.name: m for m in profile.measurements}
    for spec in unit_specs(model):
        m, unit = by_name[spec.unit.name], spec.unit
        param, grad, tensors = _bytes_of(model, spec)
        assert (m.param_bytes, m.grad_bytes) == (param, grad), unit.name
        assert m.optimizer_bytes == 2 * grad + 4 * tensors, unit.name  # AdamW: exp_avg, exp_avg_sq, step
        assert m.forward_s > 0 and min(m.input_grad_s, m.weight_grad_s, m.fused_backward_s) >= 0
        if unit.kind == "embed":
            assert m.input_grad_s == 0  # raw pixels, features or token ids
        elif unit.kind == "layer":
            assert m.input_grad_s > 0 and m.weight_grad_s > 0 and m.fused_backward_s > 0
        if not unit.runs_backward:
            assert m.activation_bytes == 0, unit.name  # ran under no_grad, kept nothing
        elif unit.kind == "layer":
            assert m.activation_bytes > 0, unit.name
    b, n = batch.input_ids.shape
    hidden, vocab = 32, 50
    head = by_name["language_model.lm_head"]
    # a trainable linear keeps its input (the norm's output) for dW; a frozen one needs only its weight for dX
    assert head.activation_bytes == (b * n * hidden * 4 if mode == "all" else 0)
    assert head.output_bytes == b * n * vocab * 4
    assert set(profile.chunk_overhead_s) == {"vision", "audio", "llm"}


# ----- parallel.plan = "auto" ------------------------------------------------------------------------------
def _skewed():
    """One encoder (3 units, frozen) and an LLM of 5 trainable units with uneven layer costs."""
    units = synthetic_units({"vision": [False, False, True]}, [True] * 5)
    forward = [1.0, 1.0, 0.2, 0.5, 6.0, 1.0, 1.0, 0.5]
    costs = [UnitCost(f, f, f, 1000, 100, 10) for f in forward]
    return units, costs


def _brute_force(units, costs, world, microbatches):
    """Every plan the trainer can run on ``world`` processes (one stage per rank, dp x ranks = world)."""
    best = None
    by_module = {m: [u.name for u in units if u.module == m] for m in ("vision", "llm")}
    for dp in [d for d in range(1, world + 1) if world % d == 0]:
        ranks, mb = world // dp, -(-microbatches // dp)
        plans = []
        if ranks == 1:
            plans.append(plan_pipeline(units, "encoders_colocated", ranks=[0, 0]))
        for enc in range(1, ranks):
            llm = ranks - enc
            for cuts in itertools.product(itertools.combinations(by_module["vision"][1:], enc - 1),
                                          itertools.combinations(by_module["llm"][1:], llm - 1)):
                for layout in ("encoder_parallel", "encoders_colocated"):
                    plans.append(plan_pipeline(units, layout, splits={"vision": list(cuts[0]), "llm": list(cuts[1])}))
        for plan in plans:
            t = evaluate_plan(plan, units, costs, dp=1, microbatches=mb, dtype="float32").iteration_s
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("world, microbatches", [(1, 4), (2, 4), (3, 6), (4, 2)])
def test_auto_plan_is_the_best_runnable_plan(world, microbatches):
    units, costs = _skewed()
    choice = plan_auto_layout(units, costs, world, microbatches)
    assert choice.dp * choice.plan.num_ranks == world
    assert choice.iteration_s <= _brute_force(units, costs, world, microbatches) * 1.01


def test_auto_plan_writes_a_config_that_rebuilds_the_plan(tmp_path):
    units, costs = _skewed()
    job = tiny_config_dict(str(tmp_path / "t.jsonl"), train={"global_batch_size": 8, "microbatch_size": 1})
    job["parallel"] = {"plan": "auto"}
    del job["model"]["encoders"]["audio"]  # the model of the synthetic units: one vision branch and the LLM
    cfg = config_from_dict(job)
    resolved, choice = resolve_auto_plan(cfg, 3, units, costs, memory_cap=16000)  # no single device fits
    assert cfg.parallel.plan == "auto" and resolved.parallel.plan == "manual"  # the input is not modified
    again = config_from_dict(json.loads(json.dumps(config_to_dict(resolved))))
    validate(again)
    pp = again.parallel.pp
    assert (again.parallel.dp, pp.degree, pp.microbatches) == (choice.dp, choice.plan.num_ranks,
                                                             choice.microbatches_per_replica)
    assert pp.degree == 3 and pp.splits  # the cost-balanced LLM cut is not the even split by count
    plan = plan_pipeline(units, pp.layout, **pipeline_plan_kwargs(pp, ["vision"]))
    assert [s.units for s in plan.stages] == [s.units for s in choice.plan.stages]
    with pytest.raises(ValueError, match="only 'auto'"):
        resolve_auto_plan(resolved, 3, units, costs)


@pytest.mark.parametrize("pp, message", [
    ({"degree": 3, "splits": {"llm": ["a", "a"]}}, "list of distinct unit names"),
    ({"degree": 3, "splits": {"llm": "layers.1"}}, "list of distinct unit names"),
    ({"degree": 3, "stages": {"llm": 3}, "splits": {"llm": ["x"]}}, "parallel.pp.splits.llm gives 2 stages"),
    ({"degree": 3, "splits": {"text": ["x"]}}, "unknown module"),
    ({"degree": 5, "splits": {"llm": ["x"]}}, "parallel.pp.degree is 5"),
])
def test_pipeline_splits_are_validated(tmp_path, pp, message):
    job = tiny_config_dict(str(tmp_path / "t.jsonl"))
    job["parallel"] = {"pp": pp}
    with pytest.raises(ValueError, match=message):
        validate(config_from_dict(job))
