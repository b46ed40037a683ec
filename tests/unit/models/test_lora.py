"""LoRA through peft (plait.models.lora): config validation, injection on the meta model, deterministic init, units,
exports in peft's format, merge, and from_pretrained of a composite with adapters."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import LlamaForCausalLM

from plait.config.loader import config_from_dict, validate
from plait.models.init import materialize, rank_prefixes
from plait.models.lora import DEFAULT_TARGETS, adapter_key, base_state_dict, save_adapter
from plait.models.multimodal import MultimodalModel
from plait.models.registry import build_model, load_tokenizer
from plait.models.units import model_units
from tests.helpers.jobs import tiny_config_dict

SEED = 3


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_config_dict("unused.jsonl")["data"]["tokenizer"])


def lora_cfg(llm_r: int = 4, vision_r: int = 2, **llm_lora):
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"]["llm"]["lora"] = {"r": llm_r, "alpha": 8.0, **llm_lora}
    cfg["model"]["encoders"]["vision"].update(feature_layer=-2, lora={"r": vision_r, "alpha": 4.0})
    return config_from_dict(cfg).model


def test_config_errors_name_the_field():
    for table, message in [({"r": -1}, "model.llm.lora.r"), ({"r": 2, "alpha": 0}, "model.llm.lora.alpha"),
                           ({"r": 2, "dropout": 1.0}, "model.llm.lora.dropout"),
                           ({"r": 2, "target_modules": ["q_proj", "q_proj"]}, "model.llm.lora.target_modules")]:
        cfg = tiny_config_dict("unused.jsonl")
        cfg["model"]["llm"]["lora"] = table
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            validate(config_from_dict(cfg))


def test_unknown_target_names_the_table(tok):
    with pytest.raises(ValueError, match=r"model\.llm\.lora\.target_modules"):
        build_model(lora_cfg(target_modules=["nope"]), tok, seed=SEED)


def test_injection_freezes_base_and_trains_adapters(tok):
    model = build_model(lora_cfg(), tok, seed=SEED)
    trainable = [n for n, _ in model.trainable_parameters()]
    llm_adapters = [n for n in trainable if n.startswith("language_model.")]
    # 2 layers x 7 default Llama projections x (A, B)
    assert len(llm_adapters) == 2 * len(DEFAULT_TARGETS["llama"]) * 2
    # the audio branch has no LoRA table and keeps its own flags (trainable in the tiny job)
    assert all(".lora_" in n for n in trainable if ".projector." not in n and not n.startswith("encoders.audio."))
    assert any(".projector." in n for n in trainable)  # projectors as configured (trainable by default)
    # the vision branch selects layer -2: its last layer is unreachable and gets no adapter
    vision = [n for n in trainable if n.startswith("encoders.vision.encoder.")]
    assert vision and all(".layers.0." in n for n in vision)
    # B starts at zero, A does not: the adapted model equals the base model
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            assert torch.count_nonzero(p) == 0
        if ".lora_A." in n:
            assert torch.count_nonzero(p) == p.numel()


def test_base_weights_equal_the_plain_model_and_adapters_are_deterministic(tok):
    plain_cfg = tiny_config_dict("unused.jsonl")
    plain_cfg["model"]["encoders"]["vision"]["feature_layer"] = -2
    plain = build_model(config_from_dict(plain_cfg).model, tok, seed=SEED)
    a = build_model(lora_cfg(), tok, seed=SEED)
    b = build_model(lora_cfg(), tok, seed=SEED)
    plain_state = plain.state_dict()
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
        if ".lora_" not in name:
            assert torch.equal(tensor, plain_state[name.replace(".base_layer", "")]), name


def test_units_keep_names_and_lora_units_train(tok):
    model = build_model(lora_cfg(), tok, device="meta", seed=SEED)
    units = {u.name: u for u in model_units(model)}
    layer = units["language_model.model.layers.0"]
    assert layer.trainable and layer.trainable_fraction < 0.5
    assert not units["language_model.model.embed_tokens"].trainable
    assert units["language_model.model.norm"].needs_input_grad


def test_rank_materialises_only_its_adapters(tok):
    full = build_model(lora_cfg(), tok, seed=SEED)
    meta = build_model(lora_cfg(), tok, device="meta", seed=SEED)
    names = materialize(meta, "cpu", SEED, keep=rank_prefixes(meta, ["language_model.model.layers.1"]))
    adapters = [n for n in names if ".lora_" in n]
    assert adapters and all(n.startswith("language_model.model.layers.1.") for n in adapters)
    full_state, rank_state = full.state_dict(keep_vars=True), meta.state_dict(keep_vars=True)
    for n in names:
        if n in full_state:
            assert torch.equal(rank_state[n], full_state[n]), n


def _train_adapters(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(0.05 * torch.randn_like(p))


def test_adapter_loads_with_plain_peft_and_merge_equals_unmerged(tok, tmp_path):
    torch.manual_seed(0)
    model = build_model(lora_cfg(), tok, seed=SEED)
    _train_adapters(model)
    llm = model.language_model
    save_adapter(llm, tmp_path / "adapter")
    llm.save_pretrained(tmp_path / "base", state_dict=base_state_dict(llm, merge=False))
    ids = torch.randint(0, 50, (2, 9))
    ours = llm(input_ids=ids).logits
    plain = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(plain(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    merged.load_state_dict(base_state_dict(llm, merge=True))
    torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    assert not torch.allclose(LlamaForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits, ours,
                              atol=1e-3)


def test_composite_round_trip_restores_adapters(tok, tmp_path):
    torch.manual_seed(1)
    model = build_model(lora_cfg(), tok, seed=SEED)
    _train_adapters(model)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "llm" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "m" / "encoders" / "vision" / "encoder" / "adapter" / "adapter_config.json").is_file()
    back = MultimodalModel.from_pretrained(tmp_path / "m")
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert [n for n, _ in back.trainable_parameters()] == [n for n, _ in model.trainable_parameters()]
    # building a job from it (model.pretrained, meta + materialise) restores the same values
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"] = {"pretrained": str(tmp_path / "m"), "encoders": {"vision": {"modality": "image"},
                                                                     "audio": {"modality": "audio"}}}
    job = build_model(config_from_dict(cfg).model, tok, seed=SEED + 1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(job.state_dict()[name], tensor), name
    assert [n for n, _ in job.trainable_parameters()] == [n for n, _ in model.trainable_parameters()]
    cfg["model"]["llm"] = {"lora": {"r": 2}}  # a second adapter on a part that has one is refused
    with pytest.raises(ValueError, match=r"model\.llm\.lora: the part already holds LoRA adapters"):
        build_model(config_from_dict(cfg).model, tok, seed=SEED)
    merged_dir = tmp_path / "merged"
    model.save_pretrained(merged_dir, merge_lora=True)
    assert not (merged_dir / "llm" / "adapter").exists()
    plain = MultimodalModel.from_pretrained(merged_dir)
    ids = torch.randint(0, 50, (1, 7))
    torch.testing.assert_close(plain.language_model(input_ids=ids).logits,
                               model.language_model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_adapter_key_matches_peft():
    assert adapter_key("model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter_key("model.layers.0.self_attn.q_proj.base_layer.weight") is None


@pytest.mark.parametrize("vision, llm", [("siglip_vision_model", "llama"), ("clip_vision_model", "qwen2"),
                                         ("vit", "llama")])
def test_family_defaults_adapt_every_reachable_layer(tok, vision, llm):
    """The default targets of each family adapt attention and MLP projections in every reachable layer (vision at
    layer -2: its last layer has none), the audio (Whisper) encoder's too; every layer unit is a LoRA unit."""
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"]["llm"]["config"]["model_type"] = llm
    cfg["model"]["llm"]["lora"] = {"r": 2}
    vis = cfg["model"]["encoders"]["vision"]
    vis.update(feature_layer=-2, lora={"r": 2})
    vis["config"]["model_type"] = vision
    if vision != "siglip_vision_model":
        vis["select"] = "drop_cls"
    cfg["model"]["encoders"]["audio"]["lora"] = {"r": 2}
    model = build_model(config_from_dict(cfg).model, tok, device="meta", seed=SEED)
    units = model_units(model)
    layers = [u for u in units if u.kind == "layer"]
    assert layers and all(u.adapter for u in layers)
    assert all(not u.trainable for u in units if u.kind in ("embed", "norm", "head"))
    per_layer = {"llama": 7, "qwen2": 7, "siglip_vision_model": 6, "clip_vision_model": 6, "vit": 6}
    lora_a = [n for n, _ in model.named_parameters() if ".lora_A." in n]
    n_llm = sum(n.startswith("language_model.") for n in lora_a)
    n_vision = sum(n.startswith("encoders.vision.") for n in lora_a)
    assert n_llm == 2 * per_layer[llm] and n_vision == 1 * per_layer[vision]
    assert sum(n.startswith("encoders.audio.") for n in lora_a) == 2 * 6


def test_initialised_summary_counts_adapters_and_names_a_few():
    from plait.models.lora import initialised_summary

    adapters = [f"l.{i}.q_proj.lora_{ab}.default.weight" for i in range(3) for ab in "AB"]
    assert initialised_summary(adapters + ["rotary.inv_freq"]) == (
        "6 LoRA adapter tensors (l.0.q_proj.lora_A.default.weight, l.0.q_proj.lora_B.default.weight, "
        "l.1.q_proj.lora_A.default.weight and 3 more); 1 other tensor (rotary.inv_freq)")
    assert initialised_summary(["a", "b"]) == "2 other tensors (a, b)"


def test_lora_added_to_a_pretrained_model_is_logged_as_a_count(tok, tmp_path, caplog):
    """A job adding LoRA to a checkpoint without adapters initialises them: one INFO line with their count and a
    few names, not every adapter tensor (thousands for a 7B LLM)."""
    cfg = tiny_config_dict("unused.jsonl")
    build_model(config_from_dict(cfg).model, tok, seed=SEED).save_pretrained(tmp_path / "m")
    cfg["model"] = {"pretrained": str(tmp_path / "m"), "llm": {"lora": {"r": 2}},
                    "encoders": {"vision": {"modality": "image"}, "audio": {"modality": "audio"}}}
    with caplog.at_level("INFO", logger="plait.models.init"):
        job = build_model(config_from_dict(cfg).model, tok, seed=SEED)
    adapters = [n for n, _ in job.named_parameters() if ".lora_" in n]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not in the checkpoint")]
    assert len(lines) == 1 and len(adapters) > 3
    assert lines[0].startswith(f"not in the checkpoint (initialised): {len(adapters)} LoRA adapter tensors (")
    assert lines[0].count(".lora_") == 3 and f"and {len(adapters) - 3} more)" in lines[0]


def test_computed_buffers_are_not_reported_and_missing_weights_warn(tok, tmp_path, caplog):
    """Loading a checkpoint reports neither the non-persistent buffers the model's init computes (rotary
    ``inv_freq``, position ids) nor them as "other tensors"; a parameter the checkpoint lacks is a WARNING naming
    it."""
    from safetensors.torch import load_file, save_file

    cfg = tiny_config_dict("unused.jsonl")
    build_model(config_from_dict(cfg).model, tok, seed=SEED).save_pretrained(tmp_path / "m")
    cfg["model"] = {"pretrained": str(tmp_path / "m"), "llm": {"lora": {"r": 2}},
                    "encoders": {"vision": {"modality": "image"}, "audio": {"modality": "audio"}}}
    with caplog.at_level("INFO", logger="plait.models.init"):
        build_model(config_from_dict(cfg).model, tok, seed=SEED)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "LoRA adapter tensors" in text
    assert "inv_freq" not in text and "position_ids" not in text and "other tensor" not in text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    weights = tmp_path / "m" / "llm" / "model.safetensors"
    stored = load_file(weights)
    del stored["model.norm.weight"]
    save_file(stored, weights, metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level("INFO", logger="plait.models.init"):
        build_model(config_from_dict(cfg).model, tok, seed=SEED)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "weights missing from the checkpoint" in warned[0]
    assert "1 tensor (language_model.model.norm.weight)" in warned[0] and "inv_freq" not in warned[0]


def test_a_moe_llms_defaults_adapt_its_attention():
    """Qwen3-MoE's fused experts are 3-D parameters, not Linear modules: the defaults find the attention projections
    of every layer and nothing in the experts or the router."""
    import transformers

    from plait.models.lora import lora_targets
    from tests.helpers.moe import TINY_MOE_LLM

    llm = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_MOE_LLM))
    found = lora_targets(llm, DEFAULT_TARGETS["qwen3_moe"])
    assert found == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
