"""Weighted mixtures of data sources: the epoch's sample order across sources, deterministic per (seed, epoch).

A mixture of sources ``s`` with usable-sample counts ``sizes[s]`` and weights ``w[s]`` has epochs of ``N``
samples (``data.epoch_samples``, default ``sum(sizes)``). Source ``s`` contributes ``n[s]`` of them, the
largest-remainder rounding of ``N * w[s] / sum(w)`` (:func:`mixture_counts`), so its realised fraction is within
``1 / N`` of its weight. Its samples are drawn without replacement from a fresh permutation of its records, a
second permutation following when ``n[s] > sizes[s]`` (an upsampled source repeats each record once before any
record a third time), and the sources are interleaved evenly: draw ``j`` of source ``s`` sits at position
``(j + phase[s]) / n[s]`` of the epoch (random phase), so every stretch of the epoch, every global batch included,
holds each source within about one sample of its share (stride scheduling, Waldspurger & Weihl 1995).
:func:`mixture_order` is a pure function of ``(sizes, weights, seed, epoch, N)``: ranks agree without
communication and a run resumed at a position continues exactly.

Samples are numbered globally: source ``s``'s sample ``i`` is ``offsets[s] + i`` with ``offsets`` the running sum
of ``sizes``: the order of the usable samples of a dataset read from a :class:`MixtureSource` (the sources' rows
one after the other); :func:`build_batch_loader` counts each source's usable samples from the dataset's rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from plait.config.schema import DataConfig, JobConfig
from plait.data.formats import open_source
from plait.data.loader import GlobalBatchLoader
from plait.data.sources import RecordSource, Row

__all__ = ["mixture_counts", "mixture_order", "source_counts", "MixtureSource", "mixture_sources",
           "MixtureBatchLoader", "build_batch_loader", "batch_sources"]


def _check_mixture(sizes: Sequence[int], weights: Sequence[float]) -> None:
    """Raises ValueError unless sizes and weights are equally many, sizes >= 1 and weights positive and finite."""
    if len(sizes) != len(weights) or not sizes:
        raise ValueError(f"a mixture needs one weight per source, got {len(sizes)} sizes and {len(weights)} weights")
    for s, (n, w) in enumerate(zip(sizes, weights)):
        if int(n) != n or n < 1:
            raise ValueError(f"source {s} has {n} usable samples; a mixture source needs at least one")
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"source {s} has weight {w}; weights must be positive and finite")


def mixture_counts(weights: Sequence[float], total: int) -> tuple[int, ...]:
    """Samples per source in an epoch of ``total``: ``total * w / sum(w)`` rounded by largest remainder (the
    counts sum to ``total``; each is within 1 of its exact share; ties go to the earlier source).

    Raises:
        ValueError: for a negative ``total`` or a weight that is not positive and finite.
    """
    if total < 0:
        raise ValueError(f"an epoch has a non-negative number of samples, got {total}")
    _check_mixture([1] * len(weights), weights)
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    for s in by_remainder[: total - sum(counts)]:
        counts[s] += 1
    return tuple(counts)


def mixture_order(sizes: Sequence[int], weights: Sequence[float], seed: int, epoch: int, epoch_samples: int = 0,
                  shuffle: bool = True) -> np.ndarray:
    """The global sample indices of one epoch of a mixture, in order (module docstring: the algorithm).

    Args:
        sizes: usable samples per source.
        weights: per source, positive (normalised here).
        seed, epoch: the order is a pure function of these (and the rest).
        epoch_samples: samples per epoch ``N``; 0: ``sum(sizes)``.
        shuffle: False: each source in file order (and phases 0.5), for tests.

    Returns:
        ``[N]`` int64 global indices (source ``s``'s sample ``i`` is ``sum(sizes[:s]) + i``).

    Raises:
        ValueError: for mismatched or empty inputs, a source without samples, a weight that is not positive and
            finite, or a negative ``epoch_samples``.
    """
    _check_mixture(sizes, weights)
    if epoch_samples < 0:
        raise ValueError(f"epoch_samples must be >= 0 (0: the sum of the sources' samples), got {epoch_samples}")
    counts = mixture_counts(weights, epoch_samples or int(sum(sizes)))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    draws, keys = [], []
    for s, (size, n) in enumerate(zip(sizes, counts)):
        rng = np.random.default_rng([seed % 2**63, epoch, s])
        reps = -(-n // size)
        local = [rng.permutation(size) if shuffle else np.arange(size) for _ in range(reps)]
        draws.append(offsets[s] + np.concatenate(local or [np.zeros(0, np.int64)])[:n].astype(np.int64))
        phase = rng.random() if shuffle else 0.5
        keys.append((np.arange(n) + phase) / max(n, 1))
    order = np.argsort(np.concatenate(keys), kind="stable")  # ties: the earlier source first
    return np.concatenate(draws)[order]


def source_counts(indices: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """How many of the global sample ``indices`` belong to each source (``len(sizes)`` counts)."""
    bounds = np.cumsum(sizes)
    which = np.searchsorted(bounds, np.asarray(indices, dtype=np.int64), side="right")
    return np.bincount(which, minlength=len(sizes)).astype(int).tolist()


class MixtureSource:
    """Several record sources as one :class:`plait.data.sources.RecordSource`, rows numbered globally (source
    ``s``'s row ``i`` is row ``sum(len of the sources before s) + i``), so one dataset (one metadata pass, one
    lazy loader) serves a whole mixture and the usable samples of each source stay contiguous and in order.

    A row's record comes back with its relative media paths resolved against its own source's folder (the
    sources may live in different folders), and its ``id`` and ``task`` prefixed with the source's name
    (``"coco/000123"``, ``"coco/default"``): ids stay unique across sources, and validation accuracy, reported per
    task, is reported per source. ``where`` is the source's own label (file and line/record/row).

    Args:
        sources: the sources, in mixture order.

    Raises:
        ValueError: for no source or two sources of one name.
    """

    format = "mixture"

    def __init__(self, sources: Sequence[RecordSource]) -> None:
        names = [s.name for s in sources]
        if not sources or len(set(names)) != len(names):
            raise ValueError(f"a mixture needs sources of distinct names, got {names}")
        self.sources, self.names = list(sources), tuple(names)
        self.sizes = tuple(len(s) for s in self.sources)
        self._bounds = np.cumsum(self.sizes)
        self.name = "+".join(names)
        self.path = Path(self.sources[0].path)
        self.base_dir = Path(self.sources[0].base_dir)  # unused: rows carry resolved media paths

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def __getitem__(self, index: int) -> Row:
        s = self.source_of(index)
        source = self.sources[s]
        obj, where, error = source[index - (int(self._bounds[s - 1]) if s else 0)]
        return (None if obj is None else _tagged(obj, source)), where, error

    def source_of(self, index: int) -> int:
        """The source (its position in :attr:`sources`) of global row ``index``.

        Raises:
            IndexError: outside ``[0, len)``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of a mixture of {len(self)} rows")
        return int(np.searchsorted(self._bounds, index, side="right"))

    def identity(self) -> dict[str, Any]:
        """Each source's name and identity, in order (a changed file, weight-independent)."""
        return {"format": self.format, "sources": [{"name": s.name, **s.identity()} for s in self.sources]}


def _tagged(obj: dict[str, Any], source: RecordSource) -> dict[str, Any]:
    """``obj`` with its media paths resolved against ``source.base_dir`` and its id and task prefixed with the
    source's name (a malformed field is left for :func:`plait.data.sources.parse_record` to refuse)."""
    out = dict(obj)
    for key in ("images", "audios"):
        if isinstance(out.get(key), list):
            out[key] = [str(Path(source.base_dir).absolute() / p) if isinstance(p, str) else p for p in out[key]]
    rid = out.get("id")
    if (isinstance(rid, str) and rid.strip()) or (isinstance(rid, int) and not isinstance(rid, bool)):
        out["id"] = f"{source.name}/{rid}"
    out["task"] = f"{source.name}/{out.get('task', 'default')}"
    return out


def mixture_sources(data: DataConfig) -> tuple[MixtureSource, MixtureSource | None]:
    """The training and validation sources of ``data.sources`` (``[[data.sources]]``): each file opened by its
    ``format`` (or extension) under its ``name`` (or file stem); validation of the sources that give a ``val``
    (None when none does).

    Raises:
        FileNotFoundError: when a file does not exist.
        ValueError: when a file cannot be read as its format, or ``data.sources`` is empty.
    """
    if not data.sources:
        raise ValueError("data.sources is empty: no mixture")
    train, val = [], []
    for src in data.sources:
        name = src.name or Path(src.path).stem
        train.append(open_source(src.path, src.format or None, name=name))
        if src.val:
            val.append(open_source(src.val, src.format or None, name=name))
    return MixtureSource(train), (MixtureSource(val) if val else None)


class MixtureBatchLoader(GlobalBatchLoader):
    """:class:`GlobalBatchLoader` over a mixture: each epoch is :func:`mixture_order` (``epoch_samples`` global
    indices, repeats possible), batched and resumed like any epoch; the checkpointed state also holds the
    sources' sizes and weights, and a resume with other ones is refused.

    Args:
        sizes, weights: per source (:func:`mixture_order`).
        global_batch_size, seed, shuffle: as :class:`GlobalBatchLoader`.
        epoch_samples: samples per epoch; 0: ``sum(sizes)``.
        names: per source, for :meth:`source_counts` (default ``"0"``, ``"1"``, ...).
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, epoch_samples: int = 0, names: Sequence[str] | None = None) -> None:
        _check_mixture(sizes, weights)
        self.sizes, self.weights = tuple(int(n) for n in sizes), tuple(float(w) for w in weights)
        self.names = tuple(names) if names is not None else tuple(str(s) for s in range(len(sizes)))
        self.epoch_samples = epoch_samples
        super().__init__(epoch_samples or sum(self.sizes), global_batch_size, seed, shuffle)
        self._order: tuple[int, torch.Tensor] | None = None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """``[epoch_samples]`` global sample indices of ``epoch`` (computed once per epoch)."""
        if self._order is None or self._order[0] != epoch:
            order = mixture_order(self.sizes, self.weights, self.seed, epoch, self.epoch_samples, self.shuffle)
            self._order = (epoch, torch.from_numpy(order))
        return self._order[1]

    def source_counts(self, indices: Sequence[int]) -> dict[str, int]:
        """Samples per source name among ``indices`` (a global batch)."""
        return dict(zip(self.names, source_counts(indices, self.sizes)))

    def state_dict(self) -> dict[str, Any]:
        """:meth:`GlobalBatchLoader.state_dict` plus ``"mixture"``: the sources' sizes, weights and epoch length."""
        return {**super().state_dict(), "mixture": {"sizes": list(self.sizes), "weights": list(self.weights),
                                                    "epoch_samples": self.epoch_samples}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: when the sources' sizes, weights or epoch length differ from the saved run's, or the
                checkpoint was written without a mixture (and as :meth:`GlobalBatchLoader.load_state_dict`).
        """
        saved = state.get("mixture")
        if saved is None:
            raise ValueError("cannot resume: the checkpoint was written without a data mixture ([[data.sources]])")
        for key, now in (("sizes", list(self.sizes)), ("weights", list(self.weights)),
                         ("epoch_samples", self.epoch_samples)):
            if saved[key] != now:
                raise ValueError(f"cannot resume: the mixture's {key} were {saved[key]} in the checkpoint, now {now}")
        super().load_state_dict(state)


def build_batch_loader(cfg: JobConfig, dataset: Any) -> GlobalBatchLoader:
    """The trainer's global-batch loader: a :class:`MixtureBatchLoader` over a dataset of a
    :class:`MixtureSource` (``data.sources``: per-source usable samples from the dataset's metadata rows), else a
    :class:`GlobalBatchLoader` over ``len(dataset)``; ``train.global_batch_size``, ``train.seed``,
    ``data.shuffle``, ``data.epoch_samples``.

    Raises:
        ValueError: when a mixture source has no usable sample (naming it).
    """
    t, d = cfg.train, cfg.data
    source = getattr(dataset, "source", None)
    if not isinstance(source, MixtureSource):
        return GlobalBatchLoader(len(dataset), t.global_batch_size, t.seed, d.shuffle)
    sizes = source_counts(dataset.table.rows, source.sizes)
    empty = [f"data.sources[{s}] ({source.names[s]})" for s, n in enumerate(sizes) if n == 0]
    if empty:
        raise ValueError(f"{empty[0]} has no usable sample (of {source.sizes[sizes.index(0)]} records)")
    return MixtureBatchLoader(sizes, [src.weight for src in d.sources], t.global_batch_size, t.seed, d.shuffle,
                              d.epoch_samples, source.names)


def batch_sources(loader: GlobalBatchLoader, indices: Sequence[int]) -> dict[str, dict[str, int]]:
    """Per-step metrics of a global batch's sources: ``{"sources": {name: samples}}`` for a
    :class:`MixtureBatchLoader`, ``{}`` for a single source."""
    return {"sources": loader.source_counts(indices)} if isinstance(loader, MixtureBatchLoader) else {}
