"""A tiny model trained a few steps and saved as ``plait train`` saves ``<run_dir>/final``, shared by the generation
tests (tests/unit/models/test_generation.py, tests/e2e/test_cli_generate.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.config.loader import config_from_dict
from plait.data.collate import collate
from plait.models.generation import save_final as write_final
from plait.models.generation import stop_token_ids
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl

__all__ = ["ANSWERS", "task_records", "save_final", "train_final", "trainer_predictions"]

ANSWERS = {"image_digit": "a picture", "audio_transcribe": "a sound", "image_audio": "both", "text": "words"}
"""A short answer per task, so that a few steps of training get some tasks right and others wrong."""


def task_records(split: str, per_task: int) -> list[dict]:
    """``per_task`` demo records of each task (absolute media paths) answered with :data:`ANSWERS`."""
    out = []
    for task, answer in ANSWERS.items():
        for r in demo_records(split, (task,), limit=per_task):
            out.append(dict(r, messages=[r["messages"][0], {"role": "assistant", "content": answer}]))
    return out


def save_final(trainer: Trainer, final: Path) -> None:
    """What ``plait train`` writes to ``<run_dir>/final`` (plait.commands.train._save_and_report)."""
    write_final(trainer.full_model(), trainer.processor, final)


def train_final(root: Path) -> tuple[Trainer, Path, dict[str, float], Path]:
    """Train a tiny model 30 steps on 16 records with validation (greedy, 6 new tokens) at the end on 16 others
    (8 seen in training, 8 not), save ``root/final``. Returns ``(trainer, final, validation exact match per task,
    val.jsonl)``."""
    train = write_jsonl(root / "train.jsonl", task_records("train", 4))
    val = write_jsonl(root / "val.jsonl", task_records("train", 2) + task_records("val", 2))
    cfg = config_from_dict(tiny_config_dict(str(train), str(val), str(root / "run"), train={
        "steps": 30, "lr": 3e-3, "global_batch_size": 8, "microbatch_size": 4, "max_new_tokens": 6}))
    trainer = Trainer.build(cfg)
    result: dict[str, Any] = trainer.fit()
    save_final(trainer, root / "final")
    return trainer, root / "final", result["eval"], val


def trainer_predictions(trainer: Trainer) -> list[str]:
    """``Trainer.generate`` on every validation sample, batched as its validation batches them."""
    samples = [trainer.val_set[j] for j in range(len(trainer.val_set))]
    stop = stop_token_ids(trainer.tokenizer, trainer.model.language_model.generation_config)
    size = max(trainer.cfg.train.microbatch_size, 16)
    out = []
    for i in range(0, len(samples), size):
        out += trainer.generate(collate(samples[i : i + size], trainer.processor.pad_id, padding_side="left"), stop)
    return out
