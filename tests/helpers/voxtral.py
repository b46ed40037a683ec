"""A tiny ``VoxtralForConditionalGeneration`` (2-layer Whisper-style tower of 32 wide over a window of 80 mel frames, 4
positions stacked per feature: 10 features a clip; 2-layer Llama text model) and token rows holding audio clips, as
transformers' inputs and as plait's. Shared by tests/unit/models/test_voxtral*.py, test_hf_io_voxtral.py and
tests/distributed/test_voxtral_parallel.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import transformers as T

__all__ = ["AUDIO", "MEL", "POSITIONS", "FEATURES", "WINDOW_SAMPLES", "voxtral_config", "tiny_voxtral", "rows",
           "save_voxtral", "voxtral_job"]

AUDIO, BEGIN_AUDIO = 24, 25
"""``[AUDIO]`` (the placeholder, as the Voxtral tokenizer writes it) and ``[BEGIN_AUDIO]`` ids of the tiny config."""
MEL, POSITIONS, HOP = 16, 40, 160
"""Mel bins, encoder positions of the window (80 frames) and hop (samples) of the tiny tower."""
FEATURES = POSITIONS // 4
"""Features (``[AUDIO]`` tokens) of one clip: 40 positions, 4 stacked per feature."""
WINDOW_SAMPLES = 2 * POSITIONS * HOP
"""The longest clip in samples (the window: 12800, 0.8 s)."""
TOWER = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_mel_bins=MEL,
             max_source_positions=POSITIONS)
TEXT = dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, vocab_size=128, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def voxtral_config(tied: bool = False) -> T.VoxtralConfig:
    """The tiny ``VoxtralConfig`` (``tied``: the text config's ``tie_word_embeddings``, which
    ``VoxtralForConditionalGeneration`` does not act on: its ``lm_head`` stays its own tensor)."""
    return T.VoxtralConfig(audio_config=dict(TOWER), text_config=dict(TEXT, tie_word_embeddings=tied),
                           audio_token_id=AUDIO, projector_hidden_act="gelu")


def tiny_voxtral(seed: int = 0, tied: bool = False) -> T.VoxtralForConditionalGeneration:
    """The tiny model in eval mode, every parameter random (norms and projector not left at their init); ``tied``: as
    :func:`voxtral_config`."""
    torch.manual_seed(seed)
    model = T.VoxtralForConditionalGeneration(voxtral_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def rows(clips_per_row: list[list[int]], seed: int = 0) -> SimpleNamespace:
    """Left-padded token rows, each ``<s> text [BEGIN_AUDIO] [AUDIO]*10 ... text`` with one window of random mel
    features per clip (``clips_per_row[r]``: the clips' lengths in samples, at most :data:`WINDOW_SAMPLES`).

    Returns:
        ``input_ids``/``attention_mask`` ``[B, N]``; ``hf``: transformers' kwargs (``input_features [n, mel, 80]``);
        ``modality_inputs``: plait's (``{"audio": {"input_features", "num_samples"}}``).
    """
    g = torch.Generator().manual_seed(seed)
    seqs, lengths = [], []
    for row in clips_per_row:
        ids = [1] + torch.randint(30, 120, (3,), generator=g).tolist()
        for n in row:
            ids += [BEGIN_AUDIO] + [AUDIO] * FEATURES + torch.randint(30, 120, (2,), generator=g).tolist()
            lengths.append(n)
        seqs.append(ids)
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    feats = torch.randn(len(lengths), MEL, 2 * POSITIONS, generator=g)
    for i, n in enumerate(lengths):  # the extractor's zero padding after the clip's frames
        feats[i, :, -(-n // HOP):] = 0.0
    audio = {"input_features": feats, "num_samples": torch.tensor(lengths)}
    return SimpleNamespace(input_ids=input_ids, attention_mask=attention_mask, modality_inputs={"audio": audio},
                           hf=dict(input_ids=input_ids, attention_mask=attention_mask, input_features=feats))


def save_voxtral(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Voxtral checkpoint folder: the tower over a 3-s window (150 positions, 2 stacked per feature: 75 features
    a clip, the demo's clips fit) in ``dtype``
    with the demo tokenizer (``[BEGIN_AUDIO]``, ``[AUDIO]`` added as special tokens, the placeholder ``[AUDIO]``), its
    ChatML template and a Whisper feature extractor of :data:`MEL` bins (the files ``plait import`` reads; the
    published model's tokenizer needs mistral-common)."""
    from tests.helpers.jobs import DEMO

    torch.manual_seed(seed)
    tok = T.AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": ["[BEGIN_AUDIO]", "[AUDIO]"]})
    tower = dict(TOWER, intermediate_size=64, max_source_positions=150)
    cfg = T.VoxtralConfig(audio_config=tower, text_config=dict(TEXT, vocab_size=512),
                          audio_token_id=tok.convert_tokens_to_ids("[AUDIO]"), projector_hidden_act="gelu")
    model = T.VoxtralForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.to(dtype).save_pretrained(folder)
    tok.save_pretrained(folder)
    T.WhisperFeatureExtractor(feature_size=MEL, sampling_rate=16000, hop_length=HOP, chunk_length=3).save_pretrained(
        folder)
    return Path(folder)


def voxtral_job(tmp_path: Path, run: str, seed: int = 0) -> dict:
    """A 2-step job (run folder ``<tmp_path>/<run>``) fine-tuning a tiny imported Voxtral (``<tmp_path>/model``,
    written once: tower of 80 mel bins over the demo's 3-s window, 2 positions stacked per feature, 75 features a
    clip; the tiny Llama; placeholder the demo's ``<audio>``) on two audio records and a text one, the tower and
    LLM trained, plait's identity projector frozen."""
    from plait.models.hf_io_voxtral import composite_from_voxtral
    from tests.helpers.jobs import TINY_LLM, demo_records, tiny_config_dict, write_jsonl

    model = Path(tmp_path) / "model"
    if not model.is_dir():
        torch.manual_seed(seed)
        tower = dict(TOWER, intermediate_size=64, num_mel_bins=80, max_source_positions=150)
        text = {k: v for k, v in TINY_LLM.items()}
        composite_from_voxtral(T.VoxtralForConditionalGeneration(
            T.VoxtralConfig(audio_config=tower, text_config=text, audio_token_id=6))).save_pretrained(model)
    records = demo_records("train", ("audio_transcribe",), limit=2) + demo_records("train", ("text",), limit=1)
    data = write_jsonl(Path(tmp_path) / "train.jsonl", records)
    job = tiny_config_dict(str(data), None, str(Path(tmp_path) / run), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"block_size": 16}, parallel={"timeout_s": 60})
    job["model"] = {"pretrained": str(model), "llm": {"attn_implementation": "eager"},
                    "encoders": {"audio": {"freeze": False, "freeze_projector": True}}}
    return job
