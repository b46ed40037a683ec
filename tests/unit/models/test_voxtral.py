"""The Voxtral audio branch (``plait.models.families.voxtral``): one feature per 4 stacked positions of the full
window, whole-model logits equal to transformers' ``VoxtralForConditionalGeneration`` (fp32, 1e-5) on one and two
clips, greedy tokens equal to its ``generate``, plait's own save/load, a bare tower with plait's projector, and the
refusals (long clip, downsample, a pipeline split inside the tower)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as T

from plait.models.encoder import ModalityEncoder
from plait.models.families import family_of
from plait.models.families.voxtral import VoxtralProjectedEncoder, stacked_frames
from plait.models.generation import greedy_token_ids
from plait.models.hf import build_encoder, encoder_feature_size
from plait.models.hf_io_voxtral import composite_from_voxtral
from plait.models.multimodal import MultimodalModel
from plait.models.plan_inputs import encoder_arch
from plait.models.projector import build_projector
from plait.models.tower_call import tower_call
from plait.planner.cost.arch import model_param_count
from tests.helpers.voxtral import FEATURES, MEL, POSITIONS, TOWER, WINDOW_SAMPLES, rows, tiny_voxtral


def test_feature_count_is_the_window_over_the_stacked_positions():
    model = composite_from_voxtral(tiny_voxtral())
    branch = model.encoders["audio"]
    assert stacked_frames(branch.encoder.config) == 4 and FEATURES == 10
    assert [branch.feature_count(n) for n in (1, 5000, WINDOW_SAMPLES)] == [10, 10, 10]
    # the published tower: 1500 positions, 4 stacked -> 375 [AUDIO] tokens per 30-s clip (one per 80 ms)
    published = SimpleNamespace(config=T.VoxtralEncoderConfig())
    count = family_of("voxtral_encoder").feature_count(published, "full", 1)
    assert count(30 * 16000) == 375 and count.max_samples == 30 * 16000
    with pytest.raises(ValueError, match="longer than the encoder window of 0.80 s"):
        branch.feature_count(WINDOW_SAMPLES + 1)
    with pytest.raises(ValueError, match="empty"):
        branch.feature_count(0)
    with pytest.raises(ValueError, match="use downsample = 1"):
        ModalityEncoder(branch.encoder, branch.projector, "audio", downsample=2)


@pytest.mark.parametrize("clips", [[[WINDOW_SAMPLES]], [[3000, WINDOW_SAMPLES]], [[3000], [9000]]])
def test_logits_equal_transformers_voxtral(clips):
    """One clip, two clips in one row, and two rows of one clip each: logits equal the stock model's."""
    hf = tiny_voxtral()
    model = composite_from_voxtral(tiny_voxtral()).eval()
    r = rows(clips, seed=3)
    with torch.no_grad():
        want = hf(**r.hf).logits
        got = model(r.input_ids, r.modality_inputs, r.attention_mask)
    assert int((r.input_ids == 24).sum()) == FEATURES * sum(len(c) for c in clips)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_greedy_tokens_equal_transformers_generate():
    hf = tiny_voxtral(seed=1)
    model = composite_from_voxtral(tiny_voxtral(seed=1)).eval()
    r = rows([[4000, WINDOW_SAMPLES]], seed=4)
    batch = SimpleNamespace(input_ids=r.input_ids, attention_mask=r.attention_mask,
                            modality_inputs=r.modality_inputs, item_ids=torch.full_like(r.input_ids, -1),
                            position_ids=None, rope_position_ids=None)
    with torch.no_grad():
        mine = greedy_token_ids(model, batch, [2], 8, 0)[0].tolist()
        theirs = hf.generate(**r.hf, max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    assert theirs[0, r.input_ids.shape[1]:].tolist() == mine and len(mine) >= 1


def test_plaits_own_save_and_load_keep_the_projector(tmp_path):
    model = composite_from_voxtral(tiny_voxtral()).eval()
    model.save_pretrained(tmp_path / "plait")
    back = MultimodalModel.from_pretrained(tmp_path / "plait").eval()
    tower = back.encoders["audio"].encoder
    assert isinstance(tower, VoxtralProjectedEncoder) and tower.multi_modal_projector is not None
    r = rows([[5000]], seed=2)
    with torch.no_grad():
        assert torch.equal(model(r.input_ids, r.modality_inputs, r.attention_mask),
                           back(r.input_ids, r.modality_inputs, r.attention_mask))


def test_a_bare_tower_hands_its_stacked_frames_to_plaits_projector():
    encoder = build_encoder("audio", config=dict(TOWER, model_type="voxtral_encoder"))
    assert isinstance(encoder, VoxtralProjectedEncoder) and not hasattr(encoder, "multi_modal_projector")
    assert encoder_feature_size(encoder, 1) == 128  # intermediate_size: 4 positions of 32
    branch = ModalityEncoder(encoder, build_projector("mlp", 128, 48), "audio")
    assert not branch.unreachable and branch.read_uncalled == {"embed_positions.weight"}
    feats = torch.randn(2, MEL, 2 * POSITIONS)
    out = branch({"input_features": feats, "num_samples": torch.tensor([100, WINDOW_SAMPLES])})
    assert out.shape == (2 * FEATURES, 48)
    hidden = encoder(feats).last_hidden_state  # the 4 consecutive positions of feature j, concatenated
    torch.testing.assert_close(branch.encoder_forward({"input_features": feats, "num_samples": torch.tensor([1, 1])}),
                               hidden.reshape(2 * FEATURES, 4 * 32))
    assert model_param_count(encoder_arch(encoder.config)) == sum(p.numel() for p in encoder.parameters())


def test_the_tower_cannot_be_split_across_pipeline_stages():
    tower = composite_from_voxtral(tiny_voxtral()).encoders["audio"].encoder
    call = tower_call(tower, {"input_features": torch.zeros(1, MEL, 2 * POSITIONS)})
    with pytest.raises(ValueError, match="cannot start a pipeline stage"):
        call.layer(tower.layers[1], 1, torch.zeros(1, POSITIONS, 32))
    with pytest.raises(ValueError, match="cannot start a pipeline stage"):
        call.stock_output(None, False)


def test_a_clip_longer_than_the_window_is_refused_naming_record_and_file(tmp_path):
    import wave

    import numpy as np

    from plait.config.loader import config_from_dict
    from plait.data.sources import JsonlSource, SampleError, sample_at
    from plait.models.registry import build_model, build_processor, load_tokenizer
    from tests.helpers.jobs import write_jsonl
    from tests.helpers.voxtral import voxtral_job

    clip = tmp_path / "long.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.zeros(16000 * 4, "<i2").tobytes())
    record = {"id": "long-1", "task": "t", "audios": [str(clip)],
              "messages": [{"role": "user", "content": "<audio>\nDigits?"}, {"role": "assistant", "content": "one"}]}
    cfg = config_from_dict(voxtral_job(tmp_path, "run"))
    cfg.data.train = str(write_jsonl(tmp_path / "long.jsonl", [record]))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    processor = build_processor(cfg.model, model, tokenizer, 256)
    assert model.encoders["audio"].feature_count(16000 * 3) == 75
    with pytest.raises(SampleError, match=r"record 'long-1'.*long.wav.*4.00 s is longer than the encoder window of "
                                          r"3.00 s"):
        processor(sample_at(JsonlSource(cfg.data.train), 0))
