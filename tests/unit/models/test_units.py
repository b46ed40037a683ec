"""Pipeline units of a composite: names and order from the model, frozen-aware flags, unreachable parts."""

from __future__ import annotations

import pytest
import torch

from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from plait.models.units import model_units, unit_specs
from plait.planner.pipeline.plan import plan_pipeline
from tests.helpers.jobs import TINY_LLM
from tests.distributed.pipeline_worker import apply_mode, tiny_model

VISION = ["encoders.vision.encoder.embeddings", "encoders.vision.encoder.encoder.layers.0",
          "encoders.vision.encoder.encoder.layers.1", "encoders.vision.projector"]
AUDIO = ["encoders.audio.encoder.conv1", "encoders.audio.encoder.layers.0", "encoders.audio.encoder.layers.1",
         "encoders.audio.encoder.layer_norm", "encoders.audio.projector"]
LLM = ["language_model.model.embed_tokens", "language_model.model.layers.0", "language_model.model.layers.1",
       "language_model.model.norm", "language_model.lm_head"]


def test_units_follow_the_model_and_skip_the_unreachable_siglip_post_norm():
    model = tiny_model()
    units = model_units(model)
    assert [u.name for u in units] == VISION + AUDIO + LLM
    assert [u.kind for u in units] == (["embed", "layer", "layer", "projector"]
                                       + ["embed", "layer", "layer", "norm", "projector"]
                                       + ["embed", "layer", "layer", "norm", "head"])
    # SigLIP's selected hidden state is taken before its post-norm (and pooling head): both are unreachable
    vision = model.encoders["vision"]
    assert {"post_layernorm.weight", "post_layernorm.bias"} <= vision.unreachable
    assert any(n.startswith("head.") for n in vision.unreachable)
    # Whisper's last hidden state is normed, so its layer_norm is a unit
    assert not any(n.startswith("layer_norm") for n in model.encoders["audio"].unreachable)
    specs = {s.unit.name: s for s in unit_specs(model)}
    assert specs["encoders.audio.encoder.conv1"].modules == (
        "encoders.audio.encoder.conv1", "encoders.audio.encoder.conv2", "encoders.audio.encoder.embed_positions")
    assert specs["language_model.model.layers.1"].layer == 1 and specs["language_model.lm_head"].layer == -1


@pytest.mark.parametrize(
    "mode, expected",
    [
        # (trainable, needs_input_grad) per unit: encoder units, projector, first LLM unit, later LLM units
        ("all", {"enc0": (True, False), "enc": (True, True), "proj": (True, True), "llm0": (True, True),
                 "llm": (True, True)}),
        ("projectors", {"enc0": (False, False), "enc": (False, False), "proj": (True, False),
                        "llm0": (False, True), "llm": (False, True)}),
        ("llm", {"enc0": (False, False), "enc": (False, False), "proj": (False, False), "llm0": (True, False),
                 "llm": (True, True)}),
    ],
)
def test_flags_follow_the_frozen_status_of_the_graph(mode, expected):
    units = model_units(apply_mode(tiny_model(), mode))
    for u in units:
        first = u.kind == "embed"
        key = ("llm0" if first else "llm") if u.module == "llm" else (
            "proj" if u.kind == "projector" else "enc0" if first else "enc")
        assert (u.trainable, u.needs_input_grad) == expected[key], u.name
    # the planner's gradient-flow validation accepts the units in every mode
    plan = plan_pipeline(units, "encoder_parallel", stages_per_module={"vision": 2, "audio": 2, "llm": 2})
    assert plan.num_stages == 6


def test_frozen_unit_upstream_of_a_trainable_one_does_not_need_an_input_gradient_but_later_ones_do():
    model = apply_mode(tiny_model(), "llm")
    model.language_model.model.layers[0].requires_grad_(False)
    model.language_model.model.embed_tokens.requires_grad_(False)
    flags = {u.name: (u.trainable, u.needs_input_grad) for u in model_units(model)}
    assert flags[LLM[0]] == (False, False) and flags[LLM[1]] == (False, False)
    assert flags[LLM[2]] == (True, False) and flags[LLM[3]] == (True, True)


def test_second_to_last_feature_layer_drops_the_last_layer_and_the_post_norms():
    units = [u.name for u in model_units(tiny_model(feature_layer=-2))]
    assert units == VISION[:2] + VISION[3:] + AUDIO[:2] + AUDIO[4:] + LLM


def test_a_partly_trainable_unit_trains_and_unreachable_parameters_never_do():
    model = apply_mode(tiny_model(feature_layer=-2), "projectors")
    model.encoders["audio"].encoder.conv2.weight.requires_grad_(True)  # one module of a multi-module unit
    model.set_frozen("encoder", False, "vision")
    flags = {u.name: u.trainable for u in model_units(model)}
    assert flags[AUDIO[0]] is True and flags[AUDIO[1]] is False
    assert not model.encoders["vision"].encoder.encoder.layers[1].mlp.fc1.weight.requires_grad
    assert "encoders.vision.encoder.encoder.layers.1" not in flags


def test_clip_and_vit_units_come_from_their_layouts():
    for cfg, expected in [
        (dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=32, patch_size=8),
         ["embeddings", "encoder.layers.0", "encoder.layers.1"]),
        (dict(model_type="vit", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=8), ["embeddings", "layers.0", "layers.1"]),
    ]:
        torch.manual_seed(0)
        llm = build_causal_lm(config=TINY_LLM, vocab_size=50, attn_implementation="eager")
        vis = ModalityEncoder(build_encoder("image", config=cfg), build_projector("linear", 32, 32), "image")
        model = MultimodalModel(llm, {"vision": vis}, {"vision": 48})
        names = [u.name for u in model_units(model) if u.module == "vision"]
        assert names == [f"encoders.vision.encoder.{n}" for n in expected] + ["encoders.vision.projector"]
        specs = unit_specs(model)
        if cfg["model_type"] == "clip_vision_model":  # CLIP's pre-norm belongs to the embedding unit
            assert specs[0].modules[1] == "encoders.vision.encoder.pre_layrnorm"


def test_an_llm_without_a_known_layout_is_a_clear_error():
    torch.manual_seed(0)
    llm = build_causal_lm(config=dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=64),
                          vocab_size=50, attn_implementation="eager")
    model = MultimodalModel(llm, {}, {})
    with pytest.raises(ValueError, match="GPT2LMHeadModel: no pipeline layout"):
        model_units(model)
