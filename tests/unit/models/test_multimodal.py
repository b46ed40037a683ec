"""Model composition: placeholder injection, count checks, feature-layer selection, save/load."""

from __future__ import annotations

import pytest
import torch

from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from tests.helpers.jobs import TINY_AUDIO, TINY_LLM, TINY_VISION

VOCAB = 50
IMG, AUD = 48, 49


def make_model(feature_layer: int = -1, audio_layer: int = -1) -> MultimodalModel:
    torch.manual_seed(0)
    llm = build_causal_lm(config=TINY_LLM, vocab_size=VOCAB, attn_implementation="eager")
    vis = ModalityEncoder(build_encoder("image", config=TINY_VISION), build_projector("mlp", 32, 32), "image",
                          feature_layer)
    aud = ModalityEncoder(build_encoder("audio", config=TINY_AUDIO), build_projector("linear", 32, 32), "audio",
                          audio_layer, downsample=4)
    return MultimodalModel(llm, {"vision": vis, "audio": aud}, {"vision": IMG, "audio": AUD})


def batch(model: MultimodalModel):
    """Row 0: an image of 16x16 then text; row 1: a 24x32 image and a 0.5 s clip."""
    vis, aud = model.encoders["vision"], model.encoders["audio"]
    n0, n1, na = vis.feature_count((16, 16)), vis.feature_count((24, 32)), aud.feature_count(8000)
    width = max(n0 + 6, n1 + na + 3)
    ids = torch.randint(1, 40, (2, width))
    ids[0, 1 : 1 + n0] = IMG
    ids[1, 0:n1] = IMG
    ids[1, n1 + 1 : n1 + 1 + na] = AUD
    inputs = {
        "vision": {"pixel_values": [torch.randn(3, 16, 16), torch.randn(3, 24, 32)]},
        "audio": {"input_features": torch.randn(1, 80, 300), "num_samples": torch.tensor([8000])},
    }
    return ids, inputs


def test_feature_counts_follow_the_shared_formula():
    model = make_model()
    vis, aud = model.encoders["vision"], model.encoders["audio"]
    assert vis.feature_count((16, 16)) == 4  # (16 // 8) ** 2, SigLIP has no CLS token
    assert vis.feature_count((24, 32)) == 12
    # 8000 samples -> 50 mel frames -> 25 positions after the stride-2 conv -> 7 after pooling by 4
    assert aud.feature_count(8000) == 7
    with pytest.raises(ValueError, match="longer than the encoder window"):
        aud.feature_count(48001)
    feats = aud.encoder_forward({"input_features": torch.randn(2, 80, 300), "num_samples": torch.tensor([8000, 160])})
    assert feats.shape == (7 + 1, 32)


def test_placeholders_receive_projected_features_and_text_keeps_embeddings():
    model = make_model()
    ids, inputs = batch(model)
    embeds = model.embed(ids, inputs)
    table = model.language_model.get_input_embeddings().weight
    text = (ids != IMG) & (ids != AUD)
    torch.testing.assert_close(embeds[text], table[ids[text]])
    vis_feats = model.encoders["vision"](inputs["vision"])
    torch.testing.assert_close(embeds[ids == IMG], vis_feats)
    torch.testing.assert_close(embeds[ids == AUD], model.encoders["audio"](inputs["audio"]))


def test_placeholder_count_mismatch_is_a_clear_error():
    model = make_model()
    ids, inputs = batch(model)
    ids[0, 1] = 5  # one image placeholder fewer
    with pytest.raises(ValueError, match="'vision' produced 16 features but the batch has 15 placeholder"):
        model.embed(ids, inputs)
    with pytest.raises(ValueError, match="placeholder tokens but no 'audio' inputs"):
        model.embed(*batch(model)[:1], {"vision": inputs["vision"]})


def test_second_to_last_layer_freezes_unreachable_parameters_and_every_trainable_one_gets_a_gradient():
    model = make_model(feature_layer=-2, audio_layer=-2)
    vis = model.encoders["vision"]
    assert any(n.startswith("encoder.layers.1.") for n in vis.unreachable) or any(
        ".layers.1." in n for n in vis.unreachable)
    assert not any(".layers.0." in n for n in vis.unreachable)
    ids, inputs = batch(model)
    model(ids, inputs).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    # unfreezing an encoder keeps the unreachable parameters frozen
    model.set_frozen("encoder", False, "vision")
    frozen = {n for n, p in vis.encoder.named_parameters() if not p.requires_grad}
    assert frozen == set(vis.unreachable)


def test_frozen_encoder_runs_without_graph():
    model = make_model()
    model.set_frozen("encoder", True)
    ids, inputs = batch(model)
    feats = model.encode("vision", inputs["vision"])
    assert feats.requires_grad  # projector still trains
    assert feats.grad_fn is not None and all(
        not p.requires_grad for p in model.encoders["vision"].encoder.parameters())
    model.set_frozen("projector", True)
    assert not model.encode("vision", inputs["vision"]).requires_grad


def test_save_and_load_round_trip_gives_equal_logits(tmp_path):
    model = make_model(feature_layer=-2)
    ids, inputs = batch(model)
    model.eval()
    expected = model(ids, inputs)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "llm" / "config.json").is_file()
    assert (tmp_path / "m" / "encoders" / "audio" / "encoder" / "config.json").is_file()
    loaded = MultimodalModel.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert loaded.encoders["vision"].feature_layer == -2
    torch.testing.assert_close(loaded(ids, inputs), expected, rtol=1e-6, atol=1e-6)


def test_parts_load_from_local_hugging_face_directories(tmp_path):
    torch.manual_seed(1)
    from transformers import WhisperConfig, WhisperModel

    whisper = WhisperModel(WhisperConfig(**{k: v for k, v in TINY_AUDIO.items() if k != "model_type"}))
    whisper.save_pretrained(tmp_path / "whisper")  # a full encoder-decoder checkpoint
    enc = build_encoder("audio", path=str(tmp_path / "whisper"))
    assert type(enc).__name__ == "WhisperEncoder"
    torch.testing.assert_close(enc.conv1.weight, whisper.encoder.conv1.weight)
    with pytest.raises(FileNotFoundError):
        build_encoder("image", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unsupported vision encoder"):
        build_encoder("image", config={"model_type": "llama"})


def test_llm_loads_from_a_local_directory_and_checks_the_vocabulary(tmp_path):
    llm = build_causal_lm(config=TINY_LLM, vocab_size=VOCAB, attn_implementation="eager")
    llm.save_pretrained(tmp_path / "llm")
    loaded = build_causal_lm(path=str(tmp_path / "llm"), vocab_size=VOCAB, attn_implementation="eager")
    torch.testing.assert_close(loaded.lm_head.weight, llm.lm_head.weight)
    with pytest.raises(ValueError, match=f"has {VOCAB} embedding rows but the tokenizer has {VOCAB + 10} tokens"):
        build_causal_lm(path=str(tmp_path / "llm"), vocab_size=VOCAB + 10)
