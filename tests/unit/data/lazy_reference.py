"""The eager data path, kept as the reference the lazy one is checked against: every record read, decoded and
processed up front (what plait did before the metadata pass), and a trainer run on it step by step."""

from __future__ import annotations

from typing import Any

import torch

from plait.data.loader import MultimodalDataset
from plait.data.sources import SampleError, sample_at
from plait.train.trainer import Trainer


class EagerDataset:
    """Every usable record of ``lazy.source`` processed up front; the dataset interface the trainer reads,
    computed from the processed samples (not from the metadata pass)."""

    def __init__(self, lazy: MultimodalDataset) -> None:
        self.source, self.skipped = lazy.source, lazy.skipped
        self.samples, self.rows = [], []
        ph = {s.encoder: s.placeholder_id for s in lazy.processor.specs.values()}
        for row in range(len(lazy.source)):
            try:
                self.samples.append(lazy.processor(sample_at(lazy.source, row)))
                self.rows.append(row)
            except SampleError:
                pass
        self.placeholders = ph

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]

    load = __getitem__

    def sample_meta(self, i: int) -> Any:
        return self.samples[i].meta

    def where(self, i: int) -> str:
        return self.source[self.rows[i]][1]

    def item_counts(self, i: int) -> dict[str, int]:
        return {b: len(v) for b, v in self.samples[i].inputs.items()}

    def feature_rows(self, i: int) -> dict[str, int]:
        ids = self.samples[i].input_ids
        return {b: int((ids == pid).sum()) for b, pid in self.placeholders.items()}


def record_batches(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """Make ``trainer`` keep every collated LLM batch's tensors (token ids, labels, positions, media inputs)."""
    seen: list[dict[str, torch.Tensor]] = []
    collate = trainer._collate

    def keep(samples):
        batch = collate(samples)
        tensors = {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}
        for branch, inputs in batch.modality_inputs.items():
            for name, value in inputs.items():
                for k, item in enumerate(value if isinstance(value, list) else [value]):
                    tensors[f"{branch}.{name}.{k}"] = item
        seen.append({k: v.clone() for k, v in tensors.items()})
        return batch

    trainer._collate = keep
    return seen


def eager_run(trainer: Trainer, steps: int) -> list[float]:
    """``steps`` optimizer steps on the eager dataset, each global batch from the loader (no feed)."""
    trainer.train_set = EagerDataset(trainer.train_set)
    return [trainer.train_step(trainer.loader.next_batch()).loss for _ in range(steps)]


def assert_same_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    """Bit-identical batch lists."""
    assert len(a) == len(b) and len(a) > 0
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), k
        for name in x:
            assert torch.equal(x[name], y[name]), (k, name)
