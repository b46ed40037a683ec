"""The Qwen2-Audio encoder branch: feature count shared with transformers' processor, features equal to the stock
``Qwen2AudioForConditionalGeneration`` audio path (fp32, 1e-5), a tiny job trains, the analytic cost model equals
the real module, and bad input is refused naming record and file."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch
import transformers as T
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

from plait.data.sources import JsonlSource, SampleError, sample_at
from plait.models.encoder import ModalityEncoder
from plait.models.families.qwen2_audio import Qwen2AudioFeatureCount
from plait.models.hf import build_encoder, encoder_layout, run_encoder_layer
from plait.models.projector import build_projector
from plait.models.plan_inputs import encoder_arch
from plait.planner.cost.arch import model_param_count, units_from_configs
from plait.planner.cost.analytic import unit_estimates
from plait.planner.cost.types import MicrobatchShape
from tests.helpers.jobs import TINY_LLM, demo_records
from tests.helpers.qwen2_audio import TINY_QWEN2_AUDIO


def _extractor(seconds: int = 3) -> T.WhisperFeatureExtractor:
    return T.WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=seconds)


def test_feature_count_equals_transformers_processor_formula():
    count = Qwen2AudioFeatureCount(hop_length=160, downsample=1, max_positions=150, sampling_rate=16000)
    fe = _extractor()
    for n in [321, 480, 481, 1000, 7777, 16000, 47999, 48000]:
        out = fe(np.zeros(n, np.float32), sampling_rate=16000, return_attention_mask=True, padding="max_length")
        frames = int(np.asarray(out["attention_mask"]).sum())
        # transformers' Qwen2AudioProcessor: num_audio_tokens = (((l - 1) // 2 + 1) - 2) // 2 + 1
        assert count(n) == (((frames - 1) // 2 + 1) - 2) // 2 + 1, n
    assert count(48000) == 75 and count.max_samples == 48000
    assert Qwen2AudioFeatureCount(160, 4, 150, 16000)(48000) == 19  # ceil(75 / 4)
    with pytest.raises(ValueError, match="longer than the encoder window of 3.00 s"):
        count(48001)
    with pytest.raises(ValueError, match="too short"):
        count(320)
    with pytest.raises(ValueError, match="empty"):
        count(0)


def _peer(seed: int = 0) -> T.Qwen2AudioForConditionalGeneration:
    torch.manual_seed(seed)
    audio = {k: v for k, v in TINY_QWEN2_AUDIO.items() if k != "model_type"}
    text = {k: v for k, v in TINY_LLM.items() if k != "model_type"} | {"vocab_size": 64}
    cfg = T.Qwen2AudioConfig(audio_config=audio, text_config=dict(model_type="qwen2", **text), audio_token_id=63)
    cfg.audio_config._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return T.Qwen2AudioForConditionalGeneration(cfg).eval()


def test_features_equal_stock_qwen2_audio_model():
    """plait's branch on the HF model's own audio tower gives exactly the features HF's composite feeds its
    projector (captured by a hook), clip by clip, for clips of different lengths in one batch."""
    peer = _peer()
    fe = _extractor()
    clips = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i, n in enumerate([48000, 9000, 1201])]
    out = fe(clips, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    branch = ModalityEncoder(peer.model.audio_tower, build_projector("linear", 32, 32), "audio")
    counts = [branch.feature_count(len(c)) for c in clips]
    captured = []
    peer.model.multi_modal_projector.register_forward_hook(lambda m, args, res: captured.append(args[0]))
    ids = torch.tensor([[63] * sum(counts) + [5, 6]])
    with torch.no_grad():
        peer(input_ids=ids, input_features=out["input_features"], attention_mask=torch.ones_like(ids),
             feature_attention_mask=out["attention_mask"])
        mine = branch.encoder_forward({"input_features": out["input_features"],
                                       "num_samples": torch.tensor([len(c) for c in clips])})
    reference = torch.cat([captured[0][i, :c] for i, c in enumerate(counts)])
    assert mine.shape == (sum(counts), 32) and counts == [75, 14, 2]
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    # the padding mask matters: without it the short clip's features differ
    plain = peer.model.audio_tower(out["input_features"]).last_hidden_state
    assert not torch.allclose(plain[2, :2], reference[-2:], atol=1e-3)


def test_branch_checks_and_pipeline_refusal():
    encoder = build_encoder("audio", config=dict(TINY_QWEN2_AUDIO))
    assert isinstance(encoder, Qwen2AudioEncoder)
    assert encoder_layout(encoder).post_norm == "layer_norm"
    with pytest.raises(ValueError, match="use feature_layer = -1"):
        ModalityEncoder(encoder, build_projector("linear", 32, 32), "audio", feature_layer=-2)
    branch = ModalityEncoder(encoder, build_projector("linear", 32, 32), "audio")
    assert not branch.unreachable  # every parameter reaches the pooled, normed output (conv, layers, layer_norm)
    assert branch.read_uncalled == {"embed_positions.weight"}  # added by the forward, never called: FSDP2
    # keeps it replicated (plait.parallel.fsdp)
    branch.check_item({"input_features": torch.zeros(80, 300)})
    with pytest.raises(ValueError, match="gives 128 mel bins x 300 frames, the encoder expects 80 x 300"):
        branch.check_item({"input_features": torch.zeros(128, 300)})
    with pytest.raises(ValueError, match="cannot start a pipeline stage"):
        run_encoder_layer(encoder.layers[0], torch.zeros(1, 150, 32))


def test_full_checkpoint_gives_its_audio_tower(tmp_path):
    peer = _peer()
    peer.save_pretrained(tmp_path / "qwen2_audio")
    tower = build_encoder("audio", path=str(tmp_path / "qwen2_audio"))
    assert isinstance(tower, Qwen2AudioEncoder)
    torch.testing.assert_close(tower.conv1.weight, peer.model.audio_tower.conv1.weight)


def test_cost_model_params_and_flops_equal_the_real_encoder():
    cfg = T.Qwen2AudioEncoderConfig(**{k: v for k, v in TINY_QWEN2_AUDIO.items() if k != "model_type"},
                                    attn_implementation="eager")
    encoder = Qwen2AudioEncoder(cfg)
    arch = encoder_arch(cfg)  # the family's facts, as the planner receives them
    assert model_param_count(arch) == sum(p.numel() for p in encoder.parameters())
    with FlopCounterMode(display=False) as counter:
        encoder(torch.randn(2, 80, 300))
    units = [u for u in units_from_configs({"a": arch, "llm": T.LlamaConfig(**{k: v for k, v in TINY_LLM.items()
                                                                           if k != "model_type"}, vocab_size=64)})
             if u.module == "a" and u.kind != "projector"]
    est = unit_estimates(units, {"a": arch}, MicrobatchShape(tokens=2 * 150))
    assert counter.get_total_flops() == sum(e.weight_flops + e.attention_flops for e in est)


@pytest.fixture
def audio_job():
    from plait.config.loader import config_from_dict
    from tests.helpers.jobs import tiny_config_dict, write_jsonl

    def make(tmp_path, records, processor=None, steps=2):
        data = write_jsonl(tmp_path / "train.jsonl", records)
        cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"),
                               train={"steps": steps, "global_batch_size": 2, "microbatch_size": 1, "threads": 1})
        cfg["model"]["encoders"] = {"audio": {"modality": "audio", "config": dict(TINY_QWEN2_AUDIO),
                                              "projector": "linear", "processor": processor or {}}}
        return config_from_dict(cfg)

    return make


def test_tiny_qwen2_audio_job_trains(tmp_path, audio_job):
    from plait.train.trainer import Trainer

    records = demo_records("train", ("audio_transcribe",), limit=2)
    trainer = Trainer.build(audio_job(tmp_path, records, steps=3))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("encoders.audio.encoder.layers.1.") for n in moved)
    assert any(n.startswith("encoders.audio.encoder.layer_norm") for n in moved)


def test_bad_audio_is_refused_naming_record_and_file(tmp_path, audio_job):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    records = demo_records("train", ("audio_transcribe",), limit=1)
    cfg = audio_job(tmp_path, records, processor={"feature_size": 64})
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    processor = build_processor(cfg.model, model, tokenizer, 256)
    sample = sample_at(JsonlSource(cfg.data.train), 0)
    with pytest.raises(SampleError, match=rf"record '{records[0]['id']}'.*{records[0]['audios'][0]}.*64 mel bins"):
        processor(sample)


def test_too_long_clip_is_refused_naming_record_and_file(tmp_path, audio_job):
    from plait.models.registry import build_model, build_processor, load_tokenizer

    clip = tmp_path / "long.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.zeros(16000 * 4, "<i2").tobytes())
    record = {"id": "long-1", "task": "t", "audios": [str(clip)],
              "messages": [{"role": "user", "content": "<audio>\nDigits?"}, {"role": "assistant", "content": "one"}]}
    cfg = audio_job(tmp_path, [record])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    processor = build_processor(cfg.model, model, tokenizer, 256)
    with pytest.raises(SampleError, match=r"record 'long-1'.*long.wav.*4.00 s is longer than the encoder window of 3.00 s"):
        processor(sample_at(JsonlSource(cfg.data.train), 0))


def test_processor_pickles_without_the_encoder(tmp_path, audio_job):
    """DataLoader workers (spawn) receive the processor pickled: its per-item encoder check must be the small
    ``EncoderInputCheck``, never a bound method of the encoder module (transformers' hooks do not pickle, and the
    weights would be copied to every worker)."""
    import pickle

    from plait.models.families.base import EncoderInputCheck
    from plait.models.registry import build_model, build_processor, load_tokenizer

    cfg = audio_job(tmp_path, demo_records("train", ("audio_transcribe",), limit=1))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tokenizer)
    processor = build_processor(cfg.model, model, tokenizer, 256)
    checks = [spec.check_item for spec in processor.specs.values()]
    assert checks and all(isinstance(c, EncoderInputCheck) for c in checks)
    again = pickle.loads(pickle.dumps(processor))
    assert [spec.check_item for spec in again.specs.values()] == checks
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(pickle.dumps(processor)) < weights  # no encoder weights travel with it
