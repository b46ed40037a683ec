"""The encoder family registry: one module per family, every family listed once, and the planner's architecture
facts of each family (``EncoderFamily.arch_fields``) equal to what the planner reads from the same config."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from plait.models.families import FAMILIES, encoder_family, family_of, supported_types, tower_config
from plait.models.families.base import AudioFamily, VisionFamily
from plait.models.hf import build_encoder
from plait.planner.cost.arch import EncoderArch, model_param_count

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=8,
              image_size=32, num_channels=3)
CONFIGS = {
    "siglip_vision_model": VISION,
    "clip_vision_model": VISION,
    "vit": {**VISION, "qkv_bias": False},
    "siglip2_vision_model": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 patch_size=4, num_patches=16, num_channels=3),
    "pixtral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                    patch_size=4, image_size=32, num_channels=3),
    "internvl_vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            patch_size=4, image_size=32, num_channels=3, use_qk_norm=True),
    "qwen2_5_vl_vision": dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                              window_size=56, out_hidden_size=48, fullatt_block_indexes=[1, 3], temporal_patch_size=2,
                              spatial_merge_size=2),
    "qwen3_vl_vision": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16,
                            deepstack_visual_indexes=[0, 1]),
    "whisper": dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                    max_source_positions=150),
    "qwen2_audio_encoder": dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                                num_mel_bins=80, max_source_positions=150),
    "qwen2_5_omni_vision_encoder": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                        window_size=16, out_hidden_size=48, fullatt_block_indexes=[1],
                                        temporal_patch_size=2, spatial_merge_size=2),
    "qwen3_omni_moe_vision_encoder": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                          spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
                                          num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
}


def test_each_family_listed_once_with_distinct_model_types():
    assert len(FAMILIES) == 16
    assert len({type(f) for f in FAMILIES}) == len(FAMILIES)
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    assert set(CONFIGS) <= set(types)
    for family in FAMILIES:
        assert isinstance(family, VisionFamily if family.modality == "image" else AudioFamily), family.name
        assert family.encoder_class and family.layout is not None, family.name
        assert all(family_of(t) is family for t in family.model_types)


def test_unknown_types_fall_back_to_the_plain_defaults_and_are_refused_by_the_builder():
    assert family_of("no_such_tower") is None
    assert type(encoder_family("no_such_tower", "image")) is VisionFamily
    assert type(encoder_family("no_such_tower", "audio")) is AudioFamily
    assert family_of("whisper", "image") is None  # an audio family is no image family
    assert "whisper" in supported_types("audio") and "whisper" not in supported_types("image")
    with pytest.raises(ValueError, match="unsupported vision encoder"):
        build_encoder("image", config={"model_type": "whisper"})


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_familys_planner_facts_count_its_towers_parameters(model_type):
    cfg = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    family = family_of(model_type)
    arch = EncoderArch(**family.arch_fields(cfg))
    as_dict = {"model_type": model_type, **CONFIGS[model_type]}  # plain config tables read alike
    assert EncoderArch(**family.arch_fields(as_dict)) == arch
    with torch.device("meta"):
        encoder = build_encoder(family.modality, config=as_dict)
    modules = dict(encoder.named_modules())
    heads = sum(p.numel() for h in family.layout_of(encoder.config).heads if h in modules
                for p in modules[h].parameters())
    assert model_param_count(arch) == sum(p.numel() for p in encoder.parameters()) - heads  # pooling heads: no unit


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_familys_tower_builds_and_probes_with_its_own_facts(model_type):
    family = family_of(model_type)
    with torch.device("meta"):
        encoder = build_encoder(family.modality, config={"model_type": model_type, **CONFIGS[model_type]})
    assert type(encoder).__name__ == family.encoder_class.rpartition(".")[2]
    inputs = family.dummy_input(encoder.config, torch.float32, "meta")
    assert inputs and family.input_check(encoder.config).modality == family.modality


def test_the_tower_config_of_a_full_checkpoint_and_the_pixel_shuffle_fact():
    vision = {"model_type": "internvl_vision", **CONFIGS["internvl_vision"]}
    full = AutoConfig.for_model("internvl", vision_config=vision)
    assert tower_config(full) is full.vision_config
    assert tower_config({"model_type": "qwen2_audio", "audio_config": {"d_model": 8}}) == {"d_model": 8}
    whisper = AutoConfig.for_model("whisper", **CONFIGS["whisper"])
    assert tower_config(whisper) is whisper  # the encoder-decoder's own config holds the encoder's fields
    assert [f.name for f in FAMILIES if f.pixel_shuffle] == ["InternVL"]
    assert family_of("internvl").feature_size(full.vision_config, 32, 2) == 128
