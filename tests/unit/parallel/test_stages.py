"""Pipeline stages in one process: pruning, per-family stage chains, frozen-aware execution, tied embeddings,
and the runtime (every stage on pipeline rank 0) against the single-process model."""

from __future__ import annotations

import copy

import pytest
import torch

from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from plait.models.units import model_units, unit_specs
from plait.parallel.pipeline import clip_grad_norm_pipeline, run_pipeline_step
from plait.parallel.pipeline.wire import HEADER_SLOTS, decode_header, encode_header
from plait.parallel.stages import OwnedLayers, build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule, gpipe, one_f_one_b
from plait.train.loss import token_loss_sum
from plait.train.plots import read_chrome_trace, write_chrome_trace
from tests.helpers.jobs import TINY_LLM
from tests.distributed.pipeline_worker import apply_mode, make_batch, reference_step, tiny_model
from tests.helpers.stages import SPLIT, check_branch_chain, on_one_rank


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def grads_match(stages, ref) -> int:
    """Assert every trainable parameter's gradient equals the reference one; returns how many had one."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    compared = 0
    for name, p in stages.trainable_parameters():
        expected = ref_params[name].grad
        assert (p.grad is None) == (expected is None), name
        if expected is not None:
            scale = float(expected.abs().max())
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-5 * scale + 1e-9, msg=name)
            compared += 1
    return compared


@pytest.mark.parametrize("layout, schedule, options, mode, llm_stages", [
    ("encoder_parallel", "1f1b", {}, "all", SPLIT["llm"]),
    # a colocated stage where the vision chunk trains and the audio chunk is frozen: audio features carry no
    # gradient back, audio runs under no_grad inside a stage that runs backward
    ("encoders_colocated", "gpipe", {"split_backward": True}, "vision", SPLIT["llm"]),
    # zero-bubble: W from the gradients B kept; in the colocated stage only the vision chunk has weight gradients
    ("encoder_parallel", "zb_h1", {}, "all", SPLIT["llm"]),
    ("encoders_colocated", "zb_h2", {}, "vision", SPLIT["llm"]),
    # the 5 LLM units in 4 stages: [embed, layer 0], [layer 1], [norm] (the norm alone), [head]
    ("encoder_parallel", "zb_h1", {}, "all", 4),
])
def test_one_process_pipeline_equals_the_model(layout, schedule, options, mode, llm_stages, tmp_path):
    model = apply_mode(tiny_model(), mode)
    ref = copy.deepcopy(model)
    plan = on_one_rank(plan_pipeline(model_units(model), layout, stages_per_module={**SPLIT, "llm": llm_stages}))
    stages = build_rank_stages(model, plan, 0)
    batches = [make_batch(k, i) for i, k in enumerate(["iva", "t", "i"])]
    targets = sum(b.target_tokens for b in batches)
    res = run_pipeline_step(stages, build_schedule(plan, schedule, 3, **options), batches, targets,
                            loss_fn=token_loss_sum)
    expected = reference_step(ref, batches)
    assert res.loss == pytest.approx(expected, rel=1e-6)
    assert grads_match(stages, ref) == sum(1 for _, p in ref.trainable_parameters() if p.grad is not None) > 30
    norm = clip_grad_norm_pipeline(stages, 1e-3)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for _, p in ref.trainable_parameters()], 1e-3)
    assert norm == pytest.approx(float(ref_norm), rel=1e-5)
    grads_match(stages, ref)
    # one timed event per action of the schedule, in its order
    assert [(e.kind, e.stage, e.microbatch) for e in res.events] == [
        (a.kind, a.stage, a.microbatch) for a in build_schedule(plan, schedule, 3, **options).actions[0]]
    trace = read_chrome_trace(write_chrome_trace(res.events, tmp_path / "trace.json"))
    assert sum(len(v) for v in trace.values()) == len(res.events)


def _vision_model(cfg: dict, feature_layer: int) -> MultimodalModel:
    torch.manual_seed(0)
    llm = build_causal_lm(config=TINY_LLM, vocab_size=50, attn_implementation="eager")
    vis = ModalityEncoder(build_encoder("image", config=cfg), build_projector("mlp", 32, 32), "image", feature_layer,
                          select="drop_cls" if cfg["model_type"] != "siglip_vision_model" else "full")
    return MultimodalModel(llm, {"vision": vis}, {"vision": 48})


FAMILIES = {
    "siglip": dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=2, image_size=32, patch_size=8),
    "clip": dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 num_attention_heads=2, image_size=32, patch_size=8),
    "vit": dict(model_type="vit", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                image_size=32, patch_size=8),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_branch_stages_reproduce_the_encoder_features_with_stock_modules(family, feature_layer):
    model = _vision_model(FAMILIES[family], feature_layer)
    check_branch_chain(model, "vision", {"pixel_values": [torch.randn(3, 16, 16), torch.randn(3, 24, 32),
                                                           torch.randn(3, 16, 16)]})


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_whisper_branch_stages_reproduce_the_encoder_features(feature_layer):
    model = tiny_model(feature_layer=feature_layer)
    inputs = {"input_features": torch.randn(2, 80, 300), "num_samples": torch.tensor([8000, 3000])}
    check_branch_chain(model, "audio", inputs)


def test_a_rank_holds_exactly_the_parameters_of_its_units_under_their_original_names():
    full = tiny_model()
    specs = unit_specs(full)
    plan = plan_pipeline(model_units(full), "encoder_parallel", stages_per_module={"vision": 2, "llm": 2},
                         ranks=[0, 1, 1, 0, 1])
    owned_union: set[str] = set()
    for rank in (0, 1):
        mine = {u for s in plan.stages_on_rank(rank) for u in plan.stages[s].units}
        expected = {f"{m}.{n}" for s in specs if s.unit.name in mine for m in s.modules
                    for n, _ in full.get_submodule(m).named_parameters()}
        stages = build_rank_stages(tiny_model(), plan, rank)
        got = dict(stages.model.named_parameters(remove_duplicate=False))
        assert set(got) == expected
        reference = dict(full.named_parameters(remove_duplicate=False))
        assert all(torch.equal(p, reference[n]) for n, p in got.items())
        owned_union |= set(got)
    dropped = {f"encoders.vision.encoder.{n}" for n in full.encoders["vision"].unreachable}
    assert owned_union == set(dict(full.named_parameters(remove_duplicate=False))) - dropped


def test_owned_layers_keep_their_indices_and_iterate_in_order():
    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    owned = OwnedLayers([layers[0], layers[2]], [3, 5])
    assert [n for n, _ in owned.named_children()] == ["3", "5"]
    assert list(owned) == [layers[0], layers[2]] and len(owned) == 2
    assert list(owned[:5]) == [layers[0], layers[2]] and owned[1] is layers[2]


def _count_saved(fn) -> int:
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count[0]


def test_frozen_prefix_stages_keep_nothing_and_frozen_llm_stages_compute_input_gradients_only():
    model = apply_mode(tiny_model(), "projectors")
    ref = copy.deepcopy(model)
    plan = on_one_rank(plan_pipeline(model_units(model), stages_per_module={"vision": 2, "audio": 2, "llm": 2}))
    v0, v1 = plan.module_stages("vision")
    assert not plan.stages[v0].runs_backward and plan.stages[v1].trainable  # [embed, layer 0] | [layer 1, projector]
    stages = build_rank_stages(model, plan, 0)
    batches = [make_batch(k, i) for i, k in enumerate(["i", "t", "ia"])]
    targets = sum(b.target_tokens for b in batches)
    res = run_pipeline_step(stages, one_f_one_b(plan, 3), batches, targets, instrument=True, loss_fn=token_loss_sum)
    assert res.loss == pytest.approx(reference_step(ref, batches), rel=1e-6)
    for index in (v0, plan.module_stages("audio")[0]):
        assert res.saved_tensors[index] == 0 and res.backward_actions[index] == 0
    # the trainable stage saved exactly what its projector saves: the frozen layer before it saved nothing
    projector = copy.deepcopy(ref.encoders["vision"].projector)
    per_batch = _count_saved(lambda: projector(torch.randn(16, 32)))
    assert res.saved_tensors[v1] == 2 * per_batch > 0
    for index in plan.llm_stages:  # frozen LLM after trainable projectors: activations kept, no weight gradient
        assert res.saved_tensors[index] > 0 and res.backward_actions[index] == 2
        assert all(not p.requires_grad and p.grad is None for p in stages.stages[index].params)
    assert grads_match(stages, ref) == 6  # projector weights and biases: audio linear (2) + vision MLP (4)


def test_tied_embeddings_across_ranks_are_summed_and_on_one_rank_need_nothing():
    units = model_units(tiny_model(tied=True))
    split = plan_pipeline(units, "encoder_parallel", stages_per_module={"llm": 2}, ranks=[0, 0, 0, 1])
    embed, head = (build_rank_stages(tiny_model(tied=True), split, r) for r in (0, 1))
    assert embed.tied.peer == 1 and not embed.tied.mirror and embed.tied.param.shape == (50, 32)
    assert head.tied.peer == 0 and head.tied.mirror
    embeddings = [n for n, _ in head.trainable_parameters() if "lm_head" in n or "embed" in n]
    assert embeddings == ["language_model.lm_head.weight"]
    same = plan_pipeline(units, "encoder_parallel", stages_per_module={"llm": 2}, ranks=[1, 1, 0, 0])
    assert build_rank_stages(tiny_model(tied=True), same, 0).tied is None
    frozen = apply_mode(tiny_model(tied=True), "projectors")
    assert build_rank_stages(frozen, plan_pipeline(model_units(frozen), stages_per_module={"llm": 2},
                                                   ranks=[0, 0, 0, 1]), 1).tied is None


def test_bad_inputs_are_clear_errors():
    model = tiny_model()
    plan = plan_pipeline(model_units(model), stages_per_module={"llm": 2})
    with pytest.raises(ValueError, match="rank 7 holds no stage"):
        build_rank_stages(model, plan, 7)
    with pytest.raises(ValueError, match="plan does not cover the model"):
        build_rank_stages(tiny_model(feature_layer=-2), plan, 0)
    stages = build_rank_stages(model, on_one_rank(plan), 0)
    with pytest.raises(ValueError, match="runs 2 microbatches but 1 were given"):
        run_pipeline_step(stages, gpipe(on_one_rank(plan), 2), [make_batch("t", 0)], 10, loss_fn=token_loss_sum)
    with pytest.raises(ValueError, match="another pipeline plan"):
        run_pipeline_step(stages, gpipe(plan, 1), [make_batch("t", 0)], 10, loss_fn=token_loss_sum)


def test_an_llm_that_rescales_inputs_embeds_cannot_be_split():
    torch.manual_seed(0)
    cfg = dict(model_type="granite", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=2.0)
    model = MultimodalModel(build_causal_lm(config=cfg, vocab_size=50, attn_implementation="eager"), {}, {})
    units = model_units(model)
    with pytest.raises(ValueError, match="changes inputs_embeds before its first layer"):
        build_rank_stages(model, plan_pipeline(units, stages_per_module={"llm": 2}), 0)
    assert build_rank_stages(model, plan_pipeline(units), 0).stages  # one LLM stage is fine


def test_header_round_trip_with_missing_gradients_and_a_long_header():
    grad = torch.zeros(5, dtype=torch.bfloat16, requires_grad=True)
    payload = {"vision": [torch.zeros(2, 3, 4), None], "audio": [], "llm": [grad]}
    header = encode_header(["vision", "audio", "llm"], payload)
    decoded = decode_header(["vision", "audio", "llm"], header)
    assert decoded == {"vision": [(torch.float32, [2, 3, 4], False), None], "audio": [],
                       "llm": [(torch.bfloat16, [5], True)]}
    many = {"vision": [torch.zeros(1, i + 1, 2) for i in range(20)]}
    long = encode_header(["vision"], many)
    assert long[0] == len(long) > HEADER_SLOTS
    assert [s[1] for s in decode_header(["vision"], long)["vision"]] == [[1, i + 1, 2] for i in range(20)]
