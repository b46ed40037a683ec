"""configs/demo_match.toml on a demo-shaped ``final/`` folder: its encoder tables only add flags (LoRA, freeze),
and the processors and placeholders come from the checkpoint, so samples are as long as under configs/demo.toml
(the vision processor keeps the demo's 32x32 images, no resize to 224)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from PIL import Image

from plait.config.loader import load_config
from plait.data.chat_template import tokenizer_dir
from plait.data.sources import parse_record
from plait.models.registry import build_model, build_processor, load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "data" / "demo"


def _lengths(proc, record: dict) -> dict[str, int]:
    """Sequence length and placeholder tokens per modality of ``record`` (a match_train.jsonl line)."""
    ids = proc(parse_record(record, "match_train.jsonl:1", DEMO)).input_ids
    return {"tokens": int(ids.numel()), **{m: int((ids == s.placeholder_id).sum()) for m, s in proc.specs.items()}}


@pytest.fixture(scope="module")
def demo_final(tmp_path_factory):
    """configs/demo.toml's model (random init) saved as ``plait train`` saves ``final/``, and its processor."""
    root = tmp_path_factory.mktemp("demo_final") / "final"
    cfg = load_config(ROOT / "configs" / "demo.toml", [f"--data.tokenizer={DEMO / 'tokenizer'}"])
    tok = load_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, tok)
    proc = build_processor(cfg.model, model, tok, cfg.data.max_length)
    model.save_pretrained(root)
    tok.save_pretrained(root / "tokenizer")
    for spec in proc.specs.values():
        spec.hf_processor.save_pretrained(root / "processors" / spec.encoder)
    records = [json.loads(line) for line in (DEMO / "match_train.jsonl").read_text().splitlines()]
    record = next(r for r in records if Image.open(DEMO / r["images"][0]).size == (32, 32))  # the largest demo size
    return root, proc, record


def test_demo_match_builds_the_demo_processors_from_the_checkpoint(demo_final, monkeypatch):
    final, demo_proc, record = demo_final
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "demo_match.toml", [f"--model.pretrained={final}"])
    assert set(cfg.model.encoders) == {"vision", "audio"}  # tables of flags only: no modality, no processor
    assert cfg.model.encoders["vision"].processor == {} and cfg.model.encoders["audio"].freeze
    tok = load_tokenizer(tokenizer_dir(cfg.data, cfg.model))
    model = build_model(cfg.model, tok, device="meta")
    proc = build_processor(cfg.model, model, tok, cfg.data.max_length)
    image, audio = proc.specs["image"], proc.specs["audio"]
    assert (image.encoder, image.placeholder, audio.encoder, audio.placeholder) == (
        "vision", "<image>", "audio", "<audio>")
    assert image.hf_processor.do_resize is False and list(image.hf_processor.image_std) == [0.5, 0.5, 0.5]
    assert isinstance(audio.hf_processor, transformers.WhisperFeatureExtractor)
    want = _lengths(demo_proc, record)
    assert _lengths(proc, record) == want and want["image"] == 64  # 32x32 image, 4x4 patches
    assert want["tokens"] < 256
