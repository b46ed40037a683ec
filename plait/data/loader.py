"""Datasets read lazily, the prefetching sample feed and the stateful global-batch loader (deterministic per
(seed, epoch, step); resumable).

A :class:`MultimodalDataset` holds the metadata of every usable record (the metadata pass,
:mod:`plait.data.metadata`: what the planners need, so every rank knows every sample's cost and the exact set of
bad records without communication) and reads, decodes and processes a sample only when it is asked for. A
:class:`SampleFeed` asks for the samples of the coming steps in DataLoader worker processes, ahead of the step
that trains them.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.data.formats import open_source
from plait.data.metadata import MetadataTable, SkippedSample, metadata_pass
from plait.data.processing import MultimodalProcessor, ProcessedSample, SampleMeta
from plait.data.sources import RecordSource, SampleError, sample_at

__all__ = ["MultimodalDataset", "LoadedSamples", "SampleFeed", "GlobalBatchLoader", "rank_share"]

log = logging.getLogger(__name__)


class MultimodalDataset:
    """The usable samples of a record source: metadata up front, each sample read and processed on access.

    Args:
        source: a :class:`~plait.data.sources.RecordSource`, or a data file opened with
            :func:`plait.data.formats.open_source` (media paths relative to its folder).
        processor: the :class:`MultimodalProcessor`.
        on_error: ``"raise"`` stops at the first bad record the metadata pass finds; ``"skip"`` counts, logs and
            skips it.
        prompt_only: process prompts without the answer (validation by generation).
        max_samples: keep only the first this many records.
        progress: show a progress bar on the metadata pass (only when stderr is a terminal).
        workers: worker processes of the metadata pass (0: in this process).
        cache_dir: folder of the metadata cache (None: no cache).

    Raises:
        SampleError: with ``on_error="raise"``, naming the record and its file and line.
        ValueError: for an unknown ``on_error``, for a file without any record, or when no usable sample is left.
    """

    def __init__(
        self,
        source: RecordSource | str | Path,
        processor: MultimodalProcessor,
        on_error: str = "raise",
        prompt_only: bool = False,
        max_samples: int | None = None,
        progress: bool = False,
        workers: int = 0,
        cache_dir: str | Path | None = None,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.source = open_source(source) if isinstance(source, (str, Path)) else source
        self.path = Path(self.source.path)
        if not len(self.source):  # before the metadata pass, which has nothing to concatenate
            raise ValueError(f"{self.path} holds no record")
        self.processor, self.prompt_only = processor, prompt_only
        self.table: MetadataTable = metadata_pass(self.source, processor, prompt_only=prompt_only,
                                                  max_rows=max_samples, workers=workers, cache_dir=cache_dir,
                                                  progress=progress)
        self.skipped: list[SkippedSample] = list(self.table.skipped)
        if self.skipped and on_error == "raise":
            raise SampleError(self.skipped[0].reason)
        for s in self.skipped:
            log.warning("skipping sample: %s", s.reason)
        if not len(self.table):
            raise ValueError(f"{self.path}: no usable sample ({len(self.skipped)} skipped)")

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> ProcessedSample:
        return self.load(index)

    def load(self, index: int) -> ProcessedSample:
        """Read, decode and process sample ``index``.

        Raises:
            SampleError: naming the record and its file and line, when it fails to decode or process (e.g. an
                image whose header reads but whose pixels do not), or when the processed sample's counts differ
                from its metadata (a media file changed after the metadata pass).
        """
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        raw = sample_at(self.source, int(self.table.rows[index]))
        sample = self.processor(raw, prompt_only=self.prompt_only)
        if sample.meta != self.table.meta(index):
            raise SampleError(f"record {raw.id!r} ({raw.source}): the decoded sample has {sample.meta} but the "
                              f"metadata pass found {self.table.meta(index)} (a media file changed?)")
        return sample

    def sample_meta(self, index: int) -> SampleMeta:
        """Sample ``index``'s :class:`SampleMeta` (from the metadata pass; nothing is read)."""
        return self.table.meta(index)

    def where(self, index: int) -> str:
        """``file:line`` (the source's label) of sample ``index``."""
        return self.source[int(self.table.rows[index])][1]

    def item_counts(self, index: int) -> dict[str, int]:
        """Media items of sample ``index`` per encoder branch (every branch, 0 included)."""
        out = dict.fromkeys(self.table.branches, 0)
        for branch, _ in self.table.items(index):
            out[branch] += 1
        return out

    def feature_rows(self, index: int) -> dict[str, int]:
        """Placeholder tokens (projected feature rows) of sample ``index`` per encoder branch (0 included)."""
        out = dict.fromkeys(self.table.branches, 0)
        for branch, n in self.table.items(index):
            out[branch] += n
        return out

    @property
    def samples(self) -> MultimodalDataset:
        """The processed samples in order (the dataset itself: each is read and processed when accessed)."""
        return self

    @property
    def meta(self) -> list[SampleMeta]:
        """Every sample's :class:`SampleMeta`, in order."""
        return [self.table.meta(i) for i in range(len(self))]


@dataclass
class LoadedSamples:
    """The samples of one step a :class:`SampleFeed` loaded.

    Attributes:
        indices: the dataset indices asked for.
        samples: per loaded index its processed sample.
        failed: per index that failed to load, the error message (record id, file and line).
        wait_s: seconds the caller waited for them (filled by :meth:`SampleFeed.next`).
    """

    indices: tuple[int, ...]
    samples: dict[int, ProcessedSample]
    failed: dict[int, str] = field(default_factory=dict)
    wait_s: float = 0.0


class _LoadTask(torch.utils.data.Dataset):
    """DataLoader dataset: item ``indices`` (a tuple of dataset indices) is their :class:`LoadedSamples`."""

    def __init__(self, dataset: MultimodalDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: tuple[int, ...]) -> LoadedSamples:
        out = LoadedSamples(tuple(indices), {})
        for i in indices:
            try:
                out.samples[i] = self.dataset.load(i)
            except SampleError as exc:
                out.failed[i] = str(exc)
        return out


def _ignore_interrupts(worker_id: int) -> None:
    """DataLoader workers ignore Ctrl-C and SIGTERM (a terminal sends Ctrl-C to the whole process group, torchrun
    sends SIGTERM to each worker's): the main process decides when to stop (a checkpoint after the current step)
    and closes them; a worker killed by the signal would fail the step that checkpoint waits for. A worker whose
    main process dies still ends (DataLoader's watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SampleFeed:
    """Loads the samples of the coming steps in ``workers`` DataLoader worker processes, each up to ``prefetch``
    steps ahead, so a step's samples are ready when it starts (``workers = 0``: loaded in this process when
    asked for). ``steps`` yields each step's dataset indices, in step order; it is read ahead, in this process.

    With workers, a thread of this process receives the loaded steps from the workers (rebuilding their
    tensors from shared memory: tens of ms a step on the demo) while the caller trains, and keeps up to
    ``ahead`` received steps ready; :meth:`next` then only waits when the workers are behind.

    Raises:
        ValueError: for a negative ``workers`` or a non-positive ``prefetch`` or ``ahead``.
    """

    def __init__(self, dataset: MultimodalDataset, steps: Iterable[Sequence[int]], workers: int = 0,
                 prefetch: int = 2, ahead: int = 1) -> None:
        if workers < 0 or prefetch < 1 or ahead < 1:
            raise ValueError(f"workers must be >= 0, prefetch and ahead >= 1, got {workers}, {prefetch}, {ahead}")
        self._loader = torch.utils.data.DataLoader(
            _LoadTask(dataset), batch_size=None, sampler=_Steps(steps), num_workers=workers,
            collate_fn=_identity, prefetch_factor=prefetch if workers else None, worker_init_fn=_ignore_interrupts,
            generator=torch.Generator().manual_seed(0))  # leaves the global RNG (checkpointed) alone
        self._it: Any = None
        self._ready: queue.Queue | None = queue.Queue(maxsize=ahead) if workers else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def next(self) -> LoadedSamples:
        """The next step's samples (waiting for them if they are not loaded yet; the wait in ``wait_s``).

        Raises:
            StopIteration: after the last step.
            Exception: what loading raised outside a sample (e.g. a worker that died), re-raised here.
        """
        start = time.perf_counter()
        if self._it is None:
            self._it = iter(self._loader)  # here, in the caller's thread: the workers start, ``steps`` is read
            if self._ready is not None:
                self._thread = threading.Thread(target=_receive, args=(self._it, self._ready, self._stop),
                                                name="plait-sample-feed", daemon=True)
                self._thread.start()
                weakref.finalize(self, self._stop.set)  # a feed dropped unclosed (an error in the step) stops it
        got = next(self._it) if self._ready is None else self._ready.get()
        if isinstance(got, BaseException):
            self._ready.put(got)  # every later call raises it too
            raise got
        got.wait_s = time.perf_counter() - start
        return got

    def close(self) -> None:
        """Stop the receiving thread and the worker processes: once the thread has ended, the feed held the
        DataLoader iterator's last reference, whose release shuts its workers down (they ignore SIGTERM, so a
        worker left running would block the interpreter's exit, which joins its child processes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._it = None


def _receive(steps: Iterator[LoadedSamples], ready: queue.Queue, stop: threading.Event) -> None:
    """A :class:`SampleFeed`'s receiving thread: the loaded steps in order into ``ready``, then StopIteration (or
    the error loading raised); it ends early when ``stop`` is set. It holds no reference to the feed, and the
    error it hands over holds none to the iterator: the frames of its traceback keep their lines, not their
    locals (a caller keeping the error would otherwise keep the worker processes alive)."""
    try:
        for got in steps:
            if not _put(ready, stop, got):
                return
        item: BaseException = StopIteration()
    except Exception as exc:  # noqa: BLE001  (handed to the caller by SampleFeed.next)
        traceback.clear_frames(exc.__traceback__)  # the loader's frames hold the iterator as ``self``
        item = exc
    del steps  # this frame is in the error's traceback too
    _put(ready, stop, item)


def _put(ready: queue.Queue, stop: threading.Event, item: Any) -> bool:
    """Put ``item`` into ``ready`` unless ``stop`` is set (False then)."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class _Steps:
    """A DataLoader sampler over a one-pass iterable of index tuples."""

    def __init__(self, steps: Iterable[Sequence[int]]) -> None:
        self.steps = steps

    def __iter__(self) -> Any:
        return (tuple(s) for s in self.steps)


def _identity(x: Any) -> Any:
    return x


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
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation), drawn once per epoch

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
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.epoch_order(self.epoch))
        batch = self._order[1][start : start + self.global_batch_size].tolist()
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


def rank_share(indices: Sequence[int], rank: int, world: int) -> list[int]:
    """The part of a global batch that DP rank ``rank`` of ``world`` processes (strided split)."""
    return list(indices[rank::world])
