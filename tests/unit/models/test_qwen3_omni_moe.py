"""The Qwen3-Omni-MoE thinker as a plait composite (``plait.models.families.qwen3_omni_moe``,
``plait.data.omni_positions`` with ``thinker = "qwen3_omni_moe"``, ``plait.models.hf_io_omni``): the composite built
from a tiny ``Qwen3OmniMoeThinkerForConditionalGeneration`` (DeepStack vision tower, its own audio tower, a MoE text
model) gives the HF model's logits (fp32, 1e-5) with plait's own positions, which are transformers'
``get_rope_index``'s, on an image, an audio clip, and a video with its audio track (its tokens in time order) beside
an image and an audio clip; greedy decoding gives ``generate``'s tokens; import then export is bit-identical and the
export generates the same tokens (a full Omni folder gives its thinker); the MoE layers are what expert parallelism, the planner and LoRA see."""

from __future__ import annotations

import pytest
import torch

from plait.data.collate import Batch
from plait.data.omni_positions import clip_in_time_order, qwen3_audio_frames_for
from plait.models.families import family_of
from plait.models.families.qwen3_omni_moe import Qwen3OmniMoeTextForCausalLM, audio_token_count
from plait.models.generation import greedy_token_ids
from plait.models.hf_io_omni import composite_from_thinker, load_thinker, thinker_from_composite
from tests.helpers.qwen2_5_omni import HOP
from tests.helpers.qwen3_omni_moe import q3_rows, tiny_thinker

LAYOUTS = {
    "image": [[("image", (1, 4, 6))]],
    "audio": [[("audio", 16000)]],
    "clip": [[("image", (1, 4, 4)), ("audio", 8000), ("clip", ((4, 4, 4), 48000))]],
    "images": [[("image", (1, 4, 4)), ("image", (1, 6, 4)), ("audio", 7000), ("image", (1, 4, 6))]],
    "video": [[("video", (4, 4, 4)), ("image", (1, 4, 4))], [("image", (1, 4, 6)), ("audio", 5000)]],
}


@pytest.fixture(scope="module")
def models():
    return tiny_thinker(), composite_from_thinker(tiny_thinker()).eval()


def _hf_positions(hf, r) -> torch.Tensor:
    feats = r.hf.get("feature_attention_mask")
    return hf.model.get_rope_index(r.input_ids, r.hf.get("image_grid_thw"), r.hf.get("video_grid_thw"),
                                   r.attention_mask, r.hf["use_audio_in_video"],
                                   None if feats is None else feats.sum(-1), r.hf.get("video_second_per_grid"))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_hf_with_plaits_positions(models, layout):
    hf, model = models
    assert isinstance(model.language_model, Qwen3OmniMoeTextForCausalLM) and model.deepstack_layers == 2
    r = q3_rows(LAYOUTS[layout])
    real = r.attention_mask.bool()
    if layout != "audio":
        assert torch.equal(r.rope[:, real], _hf_positions(hf, r)[:, real].long())
    with torch.no_grad():
        want = hf(**r.hf).logits
        mine = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        flat = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions)
    torch.testing.assert_close(mine[real], want[real], rtol=1e-5, atol=1e-5)
    if layout == "clip":  # 1-D positions answer otherwise: the thinker's positions matter
        assert (flat - want)[real].abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["clip", "video"])
def test_fractional_time_steps_are_positioned_as_transformers_does(models, layout):
    """Videos of 0.5 s per temporal patch (``second_per_grid_t x position_id_per_seconds`` = 12.5, not whole): plait's
    positions are transformers' float positions exactly (they were rounded down), the logits equal the thinker's and
    greedy decoding continues from the fractional positions as ``generate`` does."""
    hf, model = models
    r = q3_rows(LAYOUTS[layout], seed=5, left=True, second_per_grid=0.5)
    real = r.attention_mask.bool()
    want = _hf_positions(hf, r)
    assert r.rope.dtype == torch.float32 and torch.equal(r.rope[:, real], want[:, real])
    assert not torch.equal(want[:, real], want[:, real].round())  # fractional indeed
    with torch.no_grad():
        logits = hf(**r.hf).logits
        mine = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
    torch.testing.assert_close(mine[real], logits[real], rtol=1e-5, atol=1e-5)
    empty = {f: None for f in Batch.__dataclass_fields__}
    batch = Batch(**(empty | dict(input_ids=r.plait_ids, attention_mask=r.attention_mask, position_ids=r.positions,
                                  rope_position_ids=r.rope, item_ids=r.item_ids,
                                  modality_inputs=r.modality_inputs)))
    with torch.no_grad():
        tokens = hf.generate(**r.hf, max_new_tokens=6, do_sample=False, eos_token_id=[2],
                             pad_token_id=0)[:, r.input_ids.shape[1]:]
    assert greedy_token_ids(model, batch, [2], 6, 0).tolist() == tokens.tolist()


def test_a_clip_is_laid_out_in_time_order():
    """Temporal patch ``k`` (at ``25 k``) goes before audio tokens ``a >= 25 k``: 39 tokens of 3 s of audio."""
    assert clip_in_time_order((4, 4, 4), 2, 1.0, 39, 25.0) == [("video", 4), ("audio", 25), ("video", 4),
                                                                ("audio", 14), ("video", 8)]
    assert clip_in_time_order((2, 4, 4), 2, 1.0, 60, 25.0) == [("video", 4), ("audio", 25), ("video", 4),
                                                                ("audio", 35)]


def test_greedy_tokens_equal_hf_generate(models):
    hf, model = models
    r = q3_rows([[("clip", ((4, 4, 4), 64000))], [("image", (1, 4, 4)), ("audio", 9000)]], seed=3, left=True)
    empty = {f: None for f in Batch.__dataclass_fields__}
    batch = Batch(**(empty | dict(input_ids=r.plait_ids, attention_mask=r.attention_mask, position_ids=r.positions,
                                  rope_position_ids=r.rope, item_ids=r.item_ids,
                                  modality_inputs=r.modality_inputs)))
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**r.hf, **settings)[:, r.input_ids.shape[1]:]
    mine = greedy_token_ids(model, batch, [2], 8, 0)
    assert mine.tolist() == want.tolist() and mine.shape[1] >= 2


def test_audio_feature_count_is_the_towers(models):
    _, model = models
    branch = model.encoders["audio"]
    assert family_of("qwen3_omni_moe_audio_encoder").name == "Qwen3-Omni audio"
    samples = [1000, 16000, 23999, 48000]
    want = [audio_token_count(-(-n // HOP)) for n in samples]
    assert [branch.feature_count(n) for n in samples] == want == [1, 13, 20, 39]
    assert all(audio_token_count(qwen3_audio_frames_for(k)) == k for k in range(1, 60))
    feats = torch.randn(len(samples), 16, 3000)
    with torch.no_grad():
        out = branch.encoder_forward({"input_features": feats, "num_samples": torch.tensor(samples)})
    assert out.shape == (sum(want), 48)


def test_import_then_export_is_bit_identical_and_generates_the_same(tmp_path):
    original = tiny_thinker()
    want = {k: v.detach().clone() for k, v in original.state_dict().items()}
    exported = thinker_from_composite(composite_from_thinker(tiny_thinker()), fmt="qwen3_omni_moe")
    got = exported.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    exported.save_pretrained(tmp_path / "hf")
    loaded = load_thinker(tmp_path / "hf")
    assert type(loaded).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    r = q3_rows([[("image", (1, 4, 4)), ("clip", ((4, 4, 4), 64000))]], seed=5)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(loaded.generate(**r.hf, **settings), original.generate(**r.hf, **settings))
    # a full Qwen3OmniMoeForConditionalGeneration folder (here without its talker) is read as its thinker
    import transformers as T

    from tests.helpers.qwen3_omni_moe import thinker_config

    full = T.Qwen3OmniMoeForConditionalGeneration(T.Qwen3OmniMoeConfig(thinker_config=thinker_config().to_dict(),
                                                                        enable_audio_output=False))
    full.thinker.load_state_dict(original.state_dict())
    full.save_pretrained(tmp_path / "omni")
    thinker = load_thinker(tmp_path / "omni").state_dict()
    assert sorted(thinker) == sorted(want) and all(torch.equal(v, want[k]) for k, v in thinker.items())


def test_moe_layers_are_what_ep_the_planner_and_lora_see(models):
    """The experts modules expert parallelism splits, the routers the profiler counts, the planner's MoE facts of the
    text config (and every parameter counted), and the LoRA defaults (attention projections; the fused experts are
    not Linear modules)."""
    from plait.measure.router_load import router_modules
    from plait.models.lora import DEFAULT_TARGETS, lora_targets
    from plait.parallel.expert_parallel import experts_modules
    from plait.planner.cost.arch import arch_from_config, model_param_count

    _, model = models
    llm = model.language_model
    assert [n for n, _ in experts_modules(llm)] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert [n for n, _ in router_modules(llm)] == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    arch = arch_from_config(llm.config)
    assert (arch.num_experts, arch.experts_per_token, arch.expert_intermediate) == (4, 2, 32)
    assert model_param_count(llm.config) == sum(p.numel() for p in llm.parameters())
    targets = lora_targets(llm, DEFAULT_TARGETS["qwen3_omni_moe_text"])
    assert len(targets) == 2 * 4


def test_fused_experts_load_from_the_per_expert_tensors_save_pretrained_writes(tmp_path):
    """``save_pretrained`` writes each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``; plait's weight source
    fills the fused ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` from them (a job building the
    MoE LLM from a saved folder), bit for bit."""
    import transformers as T

    from plait.models.init import PartSource, WeightSource
    from tests.helpers.qwen3_omni_moe import TEXT

    torch.manual_seed(0)
    llm = Qwen3OmniMoeTextForCausalLM(T.Qwen3OmniMoeTextConfig(**TEXT))
    with torch.no_grad():
        for p in llm.parameters():
            p.copy_(torch.randn_like(p))
    llm.save_pretrained(tmp_path / "llm")
    source = WeightSource([PartSource("language_model.", (str(tmp_path / "llm" / "model.safetensors"),), "model.")])
    fresh = {k: torch.zeros_like(v) for k, v in llm.state_dict().items()}
    missing = source.load([(t, [f"language_model.{k}"]) for k, t in fresh.items()])
    assert missing == [] and any(".experts.gate_up_proj" in k for k in fresh)
    assert all(torch.equal(fresh[k], v) for k, v in llm.state_dict().items())
