"""Meta-device build + per-rank materialisation (plait.models.init) against eagerly built models.

(a) meta build + materialise everything == HF constructors on the CPU + the same per-module init, bit for bit,
    with the same frozen flags; (b) each rank of a 4-stage encoder-parallel plan materialises exactly its units
    and they equal the full model's tensors, after ``build_rank_stages`` pruned the rest; (c) the same when
    loading a plait composite checkpoint or local Hugging Face directories, against ``from_pretrained``;
    (d) no tensor outside a rank's share is ever allocated.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import WhisperConfig, WhisperModel

from plait.config.loader import config_from_dict
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.init import init_weights, materialize, meta_tensor_names, module_seed
from plait.models.multimodal import MultimodalModel
from plait.models.registry import apply_freezing, build_model, compose_model
from plait.models.units import model_units, unit_specs
from tests.helpers.jobs import TINY_AUDIO, TINY_LLM, TINY_VISION, tiny_config_dict
from tests.helpers.meta_init import SEED, assert_same, check_ranks, eager_reference, tensors, tok


def model_cfg(tie: bool = False, vision: str = "siglip_vision_model", **paths):
    """The tiny demo-like model (vision at its second-to-last layer, so a layer, the post-norm and the pooling
    head are unreachable), frozen vision encoder of family ``vision``; ``paths`` sets ``pretrained``/
    ``llm_path``/``vision_path``/``audio_path``."""
    cfg = tiny_config_dict("unused.jsonl")
    model = cfg["model"]
    model["llm"]["config"]["tie_word_embeddings"] = tie
    model["encoders"]["vision"].update(feature_layer=-2, freeze=True)
    model["encoders"]["vision"]["config"]["model_type"] = vision
    if vision != "siglip_vision_model":  # CLIP and ViT outputs start with a CLS token
        model["encoders"]["vision"]["select"] = "drop_cls"
    if "pretrained" in paths:
        model["pretrained"] = paths["pretrained"]
    if "llm_path" in paths:
        model["llm"] = {"path": paths["llm_path"], "attn_implementation": "eager"}
    for name in ("vision", "audio"):
        if f"{name}_path" in paths:
            model["encoders"][name].pop("config")
            model["encoders"][name]["path"] = paths[f"{name}_path"]
    return config_from_dict(cfg).model


# ------------------------------------------------------------------------------------------------------ (a)
@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_then_materialise_everything_equals_the_eager_build(tok, tie):
    cfg = model_cfg(tie)
    meta = build_model(cfg, tok, device="meta")
    assert meta_tensor_names(meta) == list(dict(meta.named_parameters()) | dict(meta.named_buffers()))
    ref = eager_reference(cfg, tok)
    got = build_model(cfg, tok, seed=SEED)
    assert set(tensors(got)) == set(tensors(ref))
    assert_same(tensors(got), tensors(ref))
    for name in ("vision", "audio"):  # the meta probe found the same unreachable parameters as the real one
        assert meta.encoders[name].unreachable == ref.encoders[name].unreachable == got.encoders[name].unreachable
    assert len(ref.encoders["vision"].unreachable) > 0 and not got.encoders["audio"].unreachable
    assert [u for u in model_units(meta)] == [u for u in model_units(ref)]
    llm = got.language_model
    assert (llm.lm_head.weight is llm.model.embed_tokens.weight) == tie
    # buffers are recomputed, not left as allocated: rotary frequencies 1 / 10000^(2i/d), d = 32 / 4 heads
    head_dim = TINY_LLM["hidden_size"] // TINY_LLM["num_attention_heads"]
    expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(llm.model.rotary_emb.inv_freq, expected)
    pos = got.encoders["vision"].encoder.embeddings.position_ids
    assert torch.equal(pos, torch.arange(pos.shape[-1]).unsqueeze(0))


def test_init_follows_the_models_own_scheme_and_is_keyed_by_seed_and_name(tok):
    cfg = model_cfg()
    model = build_model(cfg, tok, seed=SEED)
    llm = model.language_model
    q = llm.model.layers[0].self_attn.q_proj.weight
    assert abs(float(q.detach().std()) - 0.02) < 0.004  # Llama: normal(0, initializer_range = 0.02)
    assert torch.equal(llm.model.norm.weight, torch.ones_like(llm.model.norm.weight))
    proj = model.encoders["audio"].projector.linear_1  # nn.Linear's own init: U(-1/sqrt(in), 1/sqrt(in))
    assert float(proj.weight.detach().abs().max()) <= 1 / math.sqrt(proj.in_features) + 1e-7
    # Whisper's positions are the sinusoids of its own init: sin on the first half of the channels
    emb = model.encoders["audio"].encoder.embed_positions.weight
    half = TINY_AUDIO["d_model"] // 2
    rate = torch.exp(-math.log(10000) / (half - 1) * torch.arange(half, dtype=torch.float32))
    torch.testing.assert_close(emb[:, :half], torch.sin(torch.arange(emb.shape[0])[:, None] * rate[None]))
    other = build_model(cfg, tok, seed=SEED + 1)
    assert not torch.equal(other.language_model.model.layers[0].self_attn.q_proj.weight, q)
    assert module_seed(SEED, "a.b") == module_seed(SEED, "a.b") != module_seed(SEED, "a.c")
    # PipelineTrainer.full_model builds with torch.manual_seed(seed) and no explicit seed: the same model
    torch.manual_seed(SEED)
    assert_same(tensors(build_model(cfg, tok)), tensors(model))


# ------------------------------------------------------------------------------------------------ (b), (d)


@pytest.mark.parametrize("tie", [False, True])
def test_each_rank_of_a_four_stage_plan_materialises_only_its_units_with_the_full_models_values(
        tok, tie):
    cfg = model_cfg(tie)
    full = build_model(cfg, tok, seed=SEED)
    plan, counts = check_ranks(cfg, tok, full)
    specs = unit_specs(full)
    for rank, count in enumerate(counts):  # (d) a rank's parameters are its units' parameters, nothing more
        mine = {u for s in plan.stages_on_rank(rank) for u in plan.stages[s].units}
        expected = {id(p): p.numel() for s in specs if s.unit.name in mine for m in s.modules
                    for p in full.get_submodule(m).parameters()}
        assert count == sum(expected.values())
    unreachable = sum(p.numel() for n, p in full.encoders["vision"].encoder.named_parameters()
                      if n in full.encoders["vision"].unreachable)
    tied = full.language_model.lm_head.weight.numel() if tie else 0  # a copy on the embed and the head rank
    assert sum(counts) == sum(p.numel() for p in full.parameters()) - unreachable + tied


@pytest.mark.parametrize("vision", ["siglip_vision_model", "clip_vision_model", "vit"])
def test_every_vision_family_splits_into_stages_with_the_full_models_values(tok, vision):
    cfg = model_cfg(vision=vision)
    full = build_model(cfg, tok, seed=SEED)
    assert_same(tensors(full), tensors(eager_reference(cfg, tok)))
    check_ranks(cfg, tok, full, {"vision": 2, "audio": 1, "llm": 1})


# ------------------------------------------------------------------------------------------------------ (c)
def test_ranks_load_their_share_of_a_composite_checkpoint(tok, tmp_path):
    trained = build_model(model_cfg(tie=True), tok, seed=SEED + 3)  # other values than a SEED init
    trained.save_pretrained(tmp_path / "composite")
    cfg = model_cfg(tie=True, pretrained=str(tmp_path / "composite"))
    ref = MultimodalModel.from_pretrained(tmp_path / "composite", "eager")  # HF loading of every part
    apply_freezing(ref, cfg)
    assert_same(tensors(ref), tensors(trained))
    whole = build_model(cfg, tok, seed=SEED)
    assert set(tensors(whole)) == set(tensors(ref))
    assert_same(tensors(whole), tensors(ref))
    check_ranks(cfg, tok, ref)


def test_ranks_load_local_hugging_face_directories(tok, tmp_path):
    torch.manual_seed(1)
    llm = build_causal_lm(config=dict(TINY_LLM), vocab_size=len(tok), attn_implementation="eager")
    llm.to(torch.bfloat16).save_pretrained(tmp_path / "llm")  # from_pretrained keeps the stored dtype
    build_encoder("image", config=dict(TINY_VISION)).save_pretrained(tmp_path / "vision")
    whisper = WhisperModel(WhisperConfig(**{k: v for k, v in TINY_AUDIO.items() if k != "model_type"}))
    whisper.save_pretrained(tmp_path / "whisper")  # a full encoder-decoder: the encoder is under "encoder."
    cfg = model_cfg(llm_path=str(tmp_path / "llm"), vision_path=str(tmp_path / "vision"),
                    audio_path=str(tmp_path / "whisper"))
    ref = compose_model(cfg, tok)  # from_pretrained for the three parts
    apply_freezing(ref, cfg)
    init_weights(ref, SEED, [p for b in ref.encoders.values() for p in b.projector.parameters()])
    assert ref.language_model.dtype == torch.bfloat16
    torch.testing.assert_close(ref.encoders["audio"].encoder.conv1.weight, whisper.encoder.conv1.weight)
    whole = build_model(cfg, tok, seed=SEED)
    assert set(tensors(whole)) == set(tensors(ref))
    assert_same(tensors(whole), tensors(ref))
    check_ranks(cfg, tok, ref)


def test_a_tensor_no_init_covers_is_refused_not_left_as_garbage():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 3)  # has reset_parameters
            self.scale = torch.nn.Parameter(torch.empty(3))  # nothing initialises it

    with torch.device("meta"):
        bare = Bare()
    with pytest.raises(ValueError, match="scale"):
        materialize(bare, seed=0)
    with torch.device("meta"):
        bare = Bare()
    assert materialize(bare, seed=0, keep=["proj"]) == ["proj.weight", "proj.bias"]
    assert bare.scale.is_meta and float(bare.proj.weight.detach().abs().max()) <= 1 / math.sqrt(2)
    with pytest.raises(ValueError, match="meta device"):
        init_weights(bare, 0, [bare.scale])
