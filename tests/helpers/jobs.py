"""Helpers of several test modules, taken from tests/conftest.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo"


TINY_LLM = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
TINY_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, image_size=32, patch_size=8, num_channels=3)
TINY_AUDIO = dict(model_type="whisper", d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                  num_mel_bins=80, max_source_positions=150, decoder_layers=1, decoder_attention_heads=2,
                  decoder_ffn_dim=32, vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  decoder_start_token_id=1)


def tiny_config_dict(train_path: str, val_path: str | None = None, run_dir: str = "runs/test", **sections) -> dict:
    """A job dict for a tiny model on ``train_path``/``val_path`` JSONL files; ``sections`` update sections."""
    cfg = {
        "model": {
            "llm": {"config": dict(TINY_LLM), "attn_implementation": "eager"},
            "encoders": {
                "vision": {"modality": "image", "config": dict(TINY_VISION),
                           "processor": {"do_resize": False, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}},
                "audio": {"modality": "audio", "config": dict(TINY_AUDIO), "downsample": 4, "projector": "linear"},
            },
        },
        "data": {"train": train_path, "val": val_path, "tokenizer": str(DEMO / "tokenizer"), "max_length": 256},
        "train": {"global_batch_size": 4, "microbatch_size": 2, "steps": 3, "lr": 1e-3, "threads": 1},
        "metrics": {"run_dir": run_dir, "progress": False, "tensorboard": False},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """Write ``records`` as JSONL to ``path`` (media paths should be absolute or relative to it)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def demo_records(split: str = "train", tasks: tuple[str, ...] | None = None, limit: int | None = None) -> list[dict]:
    """Records of the demo set with absolute media paths, optionally filtered by task."""
    out = []
    for line in (DEMO / f"{split}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if tasks and rec["task"] not in tasks:
            continue
        rec["images"] = [str(DEMO / p) for p in rec["images"]]
        rec["audios"] = [str(DEMO / p) for p in rec["audios"]]
        out.append(rec)
        if limit and len(out) == limit:
            break
    return out
