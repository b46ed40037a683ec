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
of ``sizes`` (the order of :class:`MixtureDataset`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from plait.data.loader import GlobalBatchLoader

__all__ = ["mixture_counts", "mixture_order", "source_counts", "MixtureDataset", "MixtureBatchLoader",
           "batch_sources"]


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


class MixtureDataset:
    """Several datasets (one per source) as one, numbered globally (module docstring).

    Args:
        datasets: per source, a dataset (``len`` and ``[i]``; ``skipped`` and ``meta`` are concatenated when
            every dataset has them).
        names: per source, its name (per-source metrics and validation).

    Raises:
        ValueError: for mismatched lengths or duplicate names.
    """

    def __init__(self, datasets: Sequence[Any], names: Sequence[str]) -> None:
        if len(datasets) != len(names) or len(set(names)) != len(names):
            raise ValueError(f"one unique name per source needed, got {list(names)} for {len(datasets)} datasets")
        self.datasets, self.names = list(datasets), tuple(names)
        self.sizes = tuple(len(d) for d in self.datasets)
        self._bounds = np.cumsum(self.sizes)

    def __len__(self) -> int:
        return int(sum(self.sizes))

    def __getitem__(self, index: int) -> Any:
        s = self.source_of(index)
        return self.datasets[s][index - (int(self._bounds[s - 1]) if s else 0)]

    def source_of(self, index: int) -> int:
        """The source (its position in :attr:`names`) of global sample ``index``.

        Raises:
            IndexError: outside ``[0, len)``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a mixture of {len(self)}")
        return int(np.searchsorted(self._bounds, index, side="right"))

    @property
    def samples(self) -> list[Any]:
        return [s for d in self.datasets for s in d.samples]

    @property
    def skipped(self) -> list[Any]:
        return [s for d in self.datasets for s in d.skipped]

    @property
    def meta(self) -> list[Any]:
        return [m for d in self.datasets for m in d.meta]


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


def batch_sources(loader: GlobalBatchLoader, indices: Sequence[int]) -> dict[str, dict[str, int]]:
    """Per-step metrics of a global batch's sources: ``{"sources": {name: samples}}`` for a
    :class:`MixtureBatchLoader`, ``{}`` for a single source."""
    return {"sources": loader.source_counts(indices)} if isinstance(loader, MixtureBatchLoader) else {}
