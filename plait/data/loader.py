"""Datasets and the stateful global-batch loader (deterministic per (seed, epoch, step); resumable)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from plait.data.processing import MultimodalProcessor, ProcessedSample, SampleMeta
from plait.data.formats import open_source
from plait.data.sources import SampleError, parse_record, record_id

__all__ = ["SkippedSample", "MultimodalDataset", "GlobalBatchLoader", "rank_share"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedSample:
    """A record left out with ``data.on_error = "skip"``: its id, ``file:line`` and the reason."""

    id: str
    source: str
    reason: str


class MultimodalDataset:
    """All usable samples of a JSONL file, processed once up front.

    Processing everything before training means every rank knows every sample's token counts (the
    planners' input) and the exact set of skipped records, so batches are identical on all ranks without
    communication.

    Args:
        path: JSONL file (media paths relative to its folder).
        processor: the :class:`MultimodalProcessor`.
        on_error: ``"raise"`` stops at the first bad record; ``"skip"`` counts, logs and skips it.
        prompt_only: process prompts without the answer (validation by generation).
        max_samples: keep only the first this many records.
        progress: show a progress bar (only when stderr is a terminal: no carriage-return updates in logs).

    Raises:
        SampleError: with ``on_error="raise"``, naming the record and its file and line.
        ValueError: when no usable sample is left.
    """

    def __init__(
        self,
        path: str | Path,
        processor: MultimodalProcessor,
        on_error: str = "raise",
        prompt_only: bool = False,
        max_samples: int | None = None,
        progress: bool = False,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.path = Path(path)
        source = open_source(self.path)
        rows = [source[i] for i in range(len(source))][:max_samples]
        self.samples: list[ProcessedSample] = []
        self.skipped: list[SkippedSample] = []
        first_seen: dict[str, str] = {}  # record id -> file:line of its first use
        quiet = not (progress and sys.stderr.isatty())
        for obj, where, error in tqdm(rows, desc=f"processing {self.path.name}", disable=quiet, leave=False):
            try:
                if error is not None:
                    raise SampleError(f"{where}: {error}")
                raw = parse_record(obj, where, source.base_dir)
                if raw.id in first_seen:  # ids name samples in errors, skips and validation: they must be unique
                    raise SampleError(f"record {raw.id!r} ({where}): the id is already used at {first_seen[raw.id]}")
                first_seen[raw.id] = where
                self.samples.append(processor(raw, prompt_only=prompt_only))
            except SampleError as exc:
                if on_error == "raise":
                    raise
                rid = _id_or_place(obj, where)
                self.skipped.append(SkippedSample(rid, where, str(exc)))
                log.warning("skipping sample: %s", exc)
        if not self.samples:
            raise ValueError(f"{self.path}: no usable sample ({len(self.skipped)} skipped)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> ProcessedSample:
        return self.samples[index]

    @property
    def meta(self) -> list[SampleMeta]:
        return [s.meta for s in self.samples]


class GlobalBatchLoader:
    """Yields the sample indices of each global batch; the order depends only on (seed, epoch, step).

    Each epoch is a fresh permutation drawn from ``seed`` and the epoch number; the last batch of an epoch
    may be smaller (no sample is dropped). ``state_dict`` holds the position, so a resumed run continues
    mid-epoch with exactly the batches it would have seen.

    Raises:
        ValueError: for an empty dataset or a non-positive batch size.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0 or global_batch_size <= 0:
            raise ValueError(f"need samples and a positive batch size, got {num_samples}, {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch_size)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Permutation ``[num_samples]`` of sample indices for ``epoch``."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def next_batch(self) -> list[int]:
        """Indices of the next global batch; advances the position."""
        start = self.batch_in_epoch * self.global_batch_size
        batch = self.epoch_order(self.epoch)[start : start + self.global_batch_size].tolist()
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: when the dataset size, batch size or seed differ from the saved run's.
        """
        for key in ("seed", "num_samples", "global_batch_size"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"cannot resume: {key} was {state[key]} in the checkpoint, now {getattr(self, key)}")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


def _id_or_place(obj: dict[str, Any] | None, where: str) -> str:
    """A skipped record's id, or ``where`` (``file:line``) when it has no valid one."""
    try:
        return record_id(obj, where) if obj is not None else where
    except SampleError:
        return where


def rank_share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """The part of a global batch that DP rank ``rank`` of ``world`` processes (strided split)."""
    return list(indices[rank::world])
