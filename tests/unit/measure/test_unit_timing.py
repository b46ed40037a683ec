"""Profiler and the automatic plan: bytes checked against the parameters and tensor shapes, freezing against the
frozen-aware rules, stage costs by hand, and the automatic plan against brute force over every runnable plan (the
profile store's tests are in tests/unit/measure/test_job_profile.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from plait.config.loader import config_from_dict, config_to_dict, pipeline_plan_kwargs, validate
from plait.models.units import model_units, unit_specs
from plait.planner.search.auto_layout import plan_auto_layout
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.cost.measured_profile import Profile, stage_action_costs
from plait.planner.search.layout import evaluate_plan
from plait.planner.types import UnitCost
from plait.train.apply_plan import resolve_auto_plan
from plait.measure.unit_timing import measure_profile, microbatch_shapes, profile_key
from plait.planner.search.types import Machine
from plait.planner.search.auto_layout import AUTO_MACHINE
from tests.helpers.jobs import tiny_config_dict
from tests.distributed.pipeline_worker import apply_mode, make_batch, tiny_model
from tests.unit.profile_cases import make_profile as _profile
from tests.unit.profile_cases import measurement as _measurement


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


def test_split_schedules_pay_the_measured_split_backward_where_the_profile_has_it():
    units = synthetic_units({"vision": [True, False, True]}, [True])
    first, frozen, second = units[0], units[1], units[2]
    assert not first.needs_input_grad and frozen.needs_input_grad and not frozen.trainable
    assert second.needs_input_grad and second.trainable
    old = _measurement("x", f=2.0, dx=0.5, dw=0.75, fused=1.0)
    new = _measurement("x", f=2.0, dx=0.5, dw=0.75, fused=1.0, split=(0.625, 0.875))
    assert not old.has_split and new.has_split
    fused = UnitCost(2.0, 0.5, 0.5, 400, 100, 50)
    assert old.to_cost(second) == fused and new.to_cost(second) == dataclasses.replace(
        fused, split_input_grad_s=0.625, split_weight_grad_s=0.875)
    # fused schedules never see the split fields: backward_s is the fused backward either way
    assert new.to_cost(second).backward_s(second) == old.to_cost(second).backward_s(second) == 1.0
    # split: measured B and W when present, the fused rule (dX, fused - dX) when absent
    assert new.to_cost(second).split_backward_s(second) == (0.625, 0.875)
    assert old.to_cost(second).split_backward_s(second) == (0.5, 0.5)
    # frozen: the runtime keeps no gradient for its weights, so B is plain dX and W nothing; no input gradient:
    # B nothing, W dW alone
    assert new.to_cost(frozen).split_backward_s(frozen) == (0.5, 0.0)
    assert new.to_cost(first).split_backward_s(first) == (0.0, 0.75)
    lora = dataclasses.replace(second, trainable_fraction=0.25)  # the adapters' share of W, as of dW
    assert new.to_cost(lora).split_backward_s(lora) == (0.625, 0.875 * 0.25)
    with pytest.raises(ValueError, match="together"):
        UnitCost(1.0, 1.0, 1.0, split_input_grad_s=1.0)


def test_split_fields_round_trip_and_old_profiles_still_load():
    profile = _profile()
    with_split = dataclasses.replace(profile, measurements=tuple(
        dataclasses.replace(m, split_input_grad_s=0.625, split_weight_grad_s=0.875) for m in profile.measurements))
    data = json.loads(json.dumps(with_split.to_dict()))
    assert data["measurements"][0]["split_weight_grad_s"] == 0.875
    assert Profile.from_dict(data) == with_split
    cost = with_split.costs[-1]
    assert UnitCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost and cost.split_input_grad_s == 0.625
    for m in data["measurements"]:  # a profile written before the split fields existed
        del m["split_input_grad_s"], m["split_weight_grad_s"]
    old = Profile.from_dict(data)
    assert old == profile and not any(m.has_split for m in old.measurements)
    assert all(c.split_input_grad_s is None for c in old.costs)  # split schedules: the fused rule


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
    # measured split backward (B 0.625, W 0.875 per unit): split schedules pay it, 1F1B keeps the fused 1.0
    measured = dataclasses.replace(profile, measurements=tuple(
        dataclasses.replace(m, split_input_grad_s=0.625, split_weight_grad_s=0.875) for m in profile.measurements))
    assert stage_action_costs(plan, measured) == got
    split = stage_action_costs(plan, measured, split_backward=True)
    assert split[(1, "B")] == pytest.approx(1.25) and split[(1, "W")] == pytest.approx(1.75)
    # vision's input needs no gradient: W is the trainable layer's dW alone plus the chunk overhead, as before
    assert split[(0, "B")] == 0.0 and split[(0, "W")] == pytest.approx(0.95)
    # the LLM chunk's glue measured in the split backward goes to B and W; without it the fused glue goes to B
    glue = dataclasses.replace(measured, chunk_overhead_s={"llm": {"F": 0.0, "B": 0.3, "B_split": 0.1, "W_split": 0.2}})
    split = stage_action_costs(plan, glue, split_backward=True)
    assert split[(1, "B")] == pytest.approx(1.35) and split[(1, "W")] == pytest.approx(1.95)
    assert stage_action_costs(plan, glue)[(1, "B")] == pytest.approx(2.3)
    # the LLM in two chunks of one unit each: each pays its share (half) of the split glue, not all of it
    halves = plan_pipeline(profile.units, "encoder_parallel", stages_per_module={"llm": 2})
    split2 = stage_action_costs(halves, glue, split_backward=True)
    assert [split2[(s, k)] for s in (1, 2) for k in "BW"] == pytest.approx([0.675, 0.975] * 2)
    assert stage_action_costs(halves, glue)[(1, "B")] == pytest.approx(1.3)  # fused: the glue once per chunk
    old_glue = dataclasses.replace(glue, chunk_overhead_s={"llm": {"F": 0.0, "B": 0.3}})
    split = stage_action_costs(plan, old_glue, split_backward=True)
    assert split[(1, "B")] == pytest.approx(1.55) and split[(1, "W")] == pytest.approx(1.75)


def test_a_stage_without_input_gradient_runs_its_split_backward_unsplit():
    # vision: trainable embed (no input gradient) then a trainable layer that needs one; the stage's input (pixels)
    # needs none, so the runtime's W is one unsplit backward: fused costs, whatever the split fields say
    units = synthetic_units({"vision": [True, True]}, [True])
    profile = Profile(_profile().key, units, tuple(_measurement(u.name, split=(0.625, 0.875)) for u in units),
                      {"vision": {"F": 0.0, "B": 0.2}})
    plan = plan_pipeline(units, "encoder_parallel")
    split = stage_action_costs(plan, profile, split_backward=True)
    assert split[(0, "B")] == 0.0 and split[(0, "W")] == pytest.approx(0.75 + 1.0 + 0.2)  # dW + fused + glue
    assert split[(1, "B")] == pytest.approx(0.625) and split[(1, "W")] == pytest.approx(0.875)


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
        assert m.has_split, unit.name  # the runtime's split backward, measured for every unit
        if unit.kind == "embed":
            assert m.input_grad_s == 0  # raw pixels, features or token ids
            if unit.module != "audio":  # one module: B has nothing to do, W is the backward to the weights (dW)
                assert m.split_input_grad_s == 0 and m.split_weight_grad_s == m.weight_grad_s
        elif unit.kind == "layer":
            assert m.input_grad_s > 0 and m.weight_grad_s > 0 and m.fused_backward_s > 0
            assert m.split_input_grad_s > 0 and m.split_weight_grad_s > 0  # every parameter trainable meanwhile
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
    # the split backward's glue: only a chunk whose input needs a gradient (the LLM's: a projector trains) splits
    assert set(profile.chunk_overhead_s["llm"]) == {"F", "B", "B_split", "W_split"}
    assert set(profile.chunk_overhead_s["vision"]) == set(profile.chunk_overhead_s["audio"]) == {"F", "B"}


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
            t = evaluate_plan(plan, units, costs, dp=1, microbatches=mb, machine=Machine(dtype="float32")).iteration_s
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("world, microbatches", [(1, 4), (2, 4), (3, 6), (4, 2)])
def test_auto_plan_is_the_best_runnable_plan(world, microbatches):
    units, costs = _skewed()
    choice = plan_auto_layout(units, costs, world, microbatches)
    assert choice.devices_used == choice.dp * choice.plan.num_ranks * choice.tp == world  # every process used
    # no slower than the best plain plan (the complete search also weighs TP and FSDP2: e.g. 4 processes, 2
    # microbatches: DP 2 x TP 2)
    assert choice.iteration_s <= _brute_force(units, costs, world, microbatches) * 1.01


def test_auto_plan_writes_a_config_that_rebuilds_the_plan(tmp_path):
    units, costs = _skewed()
    job = tiny_config_dict(str(tmp_path / "t.jsonl"), train={"global_batch_size": 8, "microbatch_size": 1})
    job["parallel"] = {"plan": "auto"}
    del job["model"]["encoders"]["audio"]  # the model of the synthetic units: one vision branch and the LLM
    cfg = config_from_dict(job)
    resolved, choice = resolve_auto_plan(cfg, 3, units, costs,  # no single device fits
                                         machine=dataclasses.replace(AUTO_MACHINE, memory_cap=16000))
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


def test_profiler_gives_an_mrope_llm_the_positions_it_trains_with(tmp_path):
    """A Qwen2.5-VL job (its M-RoPE text model as the LLM): every forward of the profile (capture, saved bytes, the
    module chunks and the runtime step) hands the text model the batch's ``rope_position_ids [3, B, N]``, which
    differ from the 1-D positions (a record with two images), as training does."""
    from plait.measure.job_profile import build_profile_inputs
    from plait.config.loader import config_from_dict
    from tests.helpers.qwen2_5_vl_parallel import qwen_vl_job

    torch.set_num_threads(1)
    inputs = build_profile_inputs(config_from_dict(qwen_vl_job(tmp_path, "profile")), microbatch_size=4, device="cpu")
    (batch,) = inputs.microbatches
    rope = batch.rope_position_ids
    assert rope is not None and rope.shape == (3, *batch.input_ids.shape)
    assert not torch.equal(rope, batch.position_ids.expand(3, -1, -1))  # the two images sit at grid positions
    text_model = inputs.model.language_model.model
    assert type(text_model).__name__ == "Qwen2_5_VLTextModel"
    seen = []
    text_model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)
    profile = measure_profile(inputs.model, [batch], inputs.key, repeats=1, warmup=0,
                              llm_kwargs=inputs.llm_kwargs, autocast=inputs.autocast)
    assert len(seen) == 5  # capture, saved bytes, the LLM chunk's fused and split passes, the runtime step (hooks
    # copied with the model)
    assert all(torch.equal(p, rope) for p in seen)
    layer = next(m for m in profile.measurements if m.name == "language_model.model.layers.0")
    assert layer.forward_s > 0 and layer.fused_backward_s > 0
