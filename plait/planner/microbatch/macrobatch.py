"""Macro-batch statistics: how much work each module gets per global batch, and how much that varies.

Entrain (arXiv 2605.27918) observes that although single
samples differ wildly (a 4-megapixel image against a text-only chat), the *total* work a module receives
over a whole global batch of ``B`` samples concentrates: its coefficient of variation (CV = std / mean)
across batches shrinks as ``1 / sqrt(B)``. A static model-parallel configuration can therefore be planned
for the **expected** per-module totals of a global batch, as long as one reports how much the totals swing
from batch to batch. ``macrobatch_stats`` computes both from the loader's sample metadata, for
``plait plan`` to print (``MacrobatchStats.format_table``).

Work model: per sample and module, ``plait.planner.microbatch.sample_costs_from_metadata`` (encoder
``a*n + b*n^2`` per item, LLM ``c*L + d*L^2``, times the frozen-aware pass factor), in whatever unit the
coefficients are in (seconds, FLOPs). ``expected_shapes`` turns the metadata into the expected microbatch
shapes the layout search plans for.

Batches are drawn without replacement within a batch, in one of two ways (``SAMPLINGS``):

* ``"loader"``: exactly the batches the training loader yields, epoch after epoch (consecutive slices of a
  permutation per epoch), except that an epoch's smaller last batch is left out (its total is not
  comparable). The caller passes the loader's order as ``epoch_order`` (epoch -> permutation of the sample
  indices, e.g. ``plait.data.loader.GlobalBatchLoader(N, B, seed).epoch_order``): the planner replays it
  without importing the loader.
* ``"independent"``: every batch is an independent draw of ``B`` distinct samples from a
  ``numpy.random.default_rng(seed)`` generator.

Under either, a batch total of a module has mean ``B * mu`` and, for a population of ``N`` samples with
per-sample mean ``mu`` and population CV ``c``, CV ``c / sqrt(B) * sqrt((N - B) / (N - 1))`` (sampling
without replacement; e.g. Cochran, "Sampling Techniques", 3rd ed., 1977, theorem 2.2). The stats report
that prediction beside the measured CV.

All statistics use the population standard deviation (``ddof = 0``). A module with zero mean has CV 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from plait.planner.cost.arch import EncoderArch
from plait.planner.cost.types import MicrobatchShape
from plait.planner.microbatch import ModuleCostCoeffs, module_order, sample_costs_from_metadata
from plait.planner.microbatch.types import CvScaling, MacrobatchStats

__all__ = [
    "SAMPLINGS",
    "EpochOrder",
    "cv_by_batch_size",
    "draw_batches",
    "expected_shapes",
    "macrobatch_stats",
    "predicted_batch_cv",
    "sample_work_matrix",
]

SAMPLINGS = ("loader", "independent")
EpochOrder = Callable[[int], Sequence[int]]
"""The loader's order: epoch -> a permutation of the sample indices ``0..N-1`` (any integer sequence or array)."""

# Batches whose (batch x sample x module) gather is done at once (bounds memory for large batches).
_CHUNK = 64


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_batch_size(global_batch_size: Any, num_samples: int) -> int:
    """``global_batch_size`` as an int in ``1..num_samples`` (a full batch must exist).

    Raises:
        ValueError: naming the batch size and the dataset size.
    """
    b = _check_int("global_batch_size", global_batch_size, 1)
    if b > num_samples:
        raise ValueError(f"global_batch_size {b} exceeds the {num_samples} samples of the dataset: no full batch "
                         "exists")
    return b


# ------------------------------------------------------------ inputs


def sample_work_matrix(
    metas: Sequence[Any], coeffs: Mapping[str, ModuleCostCoeffs], llm: str = "llm"
) -> tuple[tuple[str, ...], np.ndarray]:
    """Per-sample, per-module work of a dataset.

    Args:
        metas: one ``SampleMeta`` (or mapping/object with ``text_tokens`` and ``items``) per sample, as
            ``sample_costs_from_metadata`` takes them.
        coeffs: cost coefficients per module, one per encoder and one named ``llm``.
        llm: the LLM's name in ``coeffs``.

    Returns:
        ``(modules, work)``: module names (encoders in ``coeffs`` order, LLM last) and a float64 array of
        shape ``(len(metas), len(modules))`` in the coefficients' unit.

    Raises:
        ValueError: on an empty ``metas`` and whatever ``sample_costs_from_metadata`` raises.
    """
    if len(metas) == 0:
        raise ValueError("metas is empty: macro-batch statistics need at least one sample")
    modules = module_order(coeffs, llm)
    costs = sample_costs_from_metadata(metas, coeffs, llm)
    return modules, np.array([c.work for c in costs], dtype=np.float64).reshape(len(costs), len(modules))


def draw_batches(
    num_samples: int, global_batch_size: int, num_batches: int, seed: int = 0, sampling: str = "loader",
    epoch_order: EpochOrder | None = None,
) -> np.ndarray:
    """Sample indices of ``num_batches`` full global batches (module docstring for the two samplings).

    Args:
        num_samples: dataset size ``N``.
        global_batch_size: ``B``, at most ``N``.
        num_batches: how many full batches to draw.
        seed: the loader's seed (``"loader"``: recorded only, the order is ``epoch_order``'s) or the generator's
            seed (``"independent"``).
        sampling: ``"loader"`` or ``"independent"``.
        epoch_order: the loader's permutation per epoch; required by ``"loader"``, unused otherwise.

    Returns:
        int64 array of shape ``(num_batches, B)``; each row holds ``B`` distinct indices in ``[0, N)``.

    Raises:
        ValueError: on a non-positive size or count, ``B > N``, a negative seed, an unknown sampling, or
            ``"loader"`` without an ``epoch_order`` or with one that is not a permutation of ``0..N-1``.
    """
    n = _check_int("num_samples", num_samples, 1)
    b = _check_batch_size(global_batch_size, n)
    count = _check_int("num_batches", num_batches, 1)
    seed = _check_int("seed", seed, 0)
    if sampling == "independent":
        rng = np.random.default_rng(seed)
        return np.stack([rng.choice(n, size=b, replace=False) for _ in range(count)]).astype(np.int64)
    if sampling != "loader":
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if epoch_order is None:
        raise ValueError("sampling='loader' needs epoch_order: the loader's permutation of the sample indices per "
                         "epoch (e.g. plait.data.loader.GlobalBatchLoader(N, B, seed).epoch_order)")
    full = n // b  # full batches per epoch; a smaller last batch is left out
    rows: list[np.ndarray] = []
    epoch = 0
    while len(rows) < count:
        order = np.asarray(epoch_order(epoch), dtype=np.int64)
        if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
            raise ValueError(f"epoch_order({epoch}) is not a permutation of the {n} sample indices")
        rows.extend(order[k * b : (k + 1) * b] for k in range(min(full, count - len(rows))))
        epoch += 1
    return np.stack(rows).astype(np.int64)


def predicted_batch_cv(sample_cv: float, batch_size: int, num_samples: int) -> float:
    """CV of a batch total under sampling without replacement: ``c / sqrt(B) * sqrt((N - B) / (N - 1))``.

    Source: the variance of a sample total drawn without replacement from a finite population (Cochran,
    "Sampling Techniques", 1977, theorem 2.2); ``N = 1`` gives 0.

    Raises:
        ValueError: on a negative ``sample_cv`` or ``not 1 <= batch_size <= num_samples``.
    """
    n = _check_int("num_samples", num_samples, 1)
    b = _check_int("batch_size", batch_size, 1)
    if b > n or not sample_cv >= 0:
        raise ValueError(f"need sample_cv >= 0 and 1 <= batch_size <= num_samples, got {sample_cv}, {b}, {n}")
    if n == 1:
        return 0.0
    return float(sample_cv / math.sqrt(b) * math.sqrt((n - b) / (n - 1)))


# ------------------------------------------------------------ statistics


def _cv(values: np.ndarray) -> np.ndarray:
    """Per column, population std / mean; 0 where the mean is 0. ``values``: (rows, modules)."""
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    return np.divide(std, mean, out=np.zeros_like(mean), where=mean > 0)


def _batch_totals(work: np.ndarray, batches: np.ndarray) -> np.ndarray:
    """(num_batches, modules) totals of ``work`` (samples, modules) over each row of ``batches``."""
    out = np.empty((len(batches), work.shape[1]))
    for start in range(0, len(batches), _CHUNK):
        out[start : start + _CHUNK] = work[batches[start : start + _CHUNK]].sum(axis=1)
    return out


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _stats_from_work(
    modules: tuple[str, ...], work: np.ndarray, global_batch_size: int, num_batches: int, seed: int, sampling: str,
    epoch_order: EpochOrder | None,
) -> MacrobatchStats:
    """``MacrobatchStats`` of a (samples, modules) work matrix."""
    n = len(work)
    batches = draw_batches(n, global_batch_size, num_batches, seed, sampling, epoch_order)
    totals = _batch_totals(work, batches)
    sample_cv = _cv(work)
    return MacrobatchStats(
        modules=tuple(modules),
        num_samples=n,
        global_batch_size=int(global_batch_size),
        num_batches=len(batches),
        sampling=sampling,
        seed=int(seed),
        usage=_floats((work > 0).mean(axis=0)),
        sample_mean=_floats(work.mean(axis=0)),
        sample_cv=_floats(sample_cv),
        sample_min=_floats(work.min(axis=0)),
        sample_max=_floats(work.max(axis=0)),
        expected=_floats(global_batch_size * work.mean(axis=0)),
        batch_mean=_floats(totals.mean(axis=0)),
        batch_cv=_floats(_cv(totals)),
        batch_min=_floats(totals.min(axis=0)),
        batch_max=_floats(totals.max(axis=0)),
        predicted_cv=tuple(predicted_batch_cv(c, global_batch_size, n) for c in sample_cv),
    )


def macrobatch_stats(
    metas: Sequence[Any],
    global_batch_size: int,
    num_batches: int,
    coeffs: Mapping[str, ModuleCostCoeffs],
    seed: int = 0,
    *,
    sampling: str = "loader",
    epoch_order: EpochOrder | None = None,
    llm: str = "llm",
) -> MacrobatchStats:
    """Expected per-module work of a global batch and how much it varies between batches.

    Args:
        metas: the dataset's sample metadata (``SampleMeta`` or equivalent, see ``sample_work_matrix``).
        global_batch_size: samples per global batch ``B`` (at most ``len(metas)``).
        num_batches: full global batches to draw (``"loader"``: across as many epochs as needed).
        coeffs: cost coefficients per module, one named ``llm``.
        seed: the loader's seed (or the generator's, for ``"independent"``).
        sampling: ``"loader"`` or ``"independent"`` (module docstring).
        epoch_order: the loader's permutation per epoch (``"loader"`` only; ``draw_batches``).
        llm: the LLM's name in ``coeffs``.

    Returns:
        A ``MacrobatchStats``.

    Raises:
        ValueError: on empty or bad metadata, missing coefficients, ``B > len(metas)``, a non-positive
            count, a negative seed, an unknown sampling or ``"loader"`` without a valid ``epoch_order``.
    """
    modules, work = sample_work_matrix(metas, coeffs, llm)
    return _stats_from_work(modules, work, global_batch_size, num_batches, seed, sampling, epoch_order)


# ------------------------------------------------------------ CV against batch size


def cv_by_batch_size(
    metas: Sequence[Any],
    coeffs: Mapping[str, ModuleCostCoeffs],
    batch_sizes: Sequence[int] = (1, 8, 64, 256),
    num_batches: int = 256,
    seed: int = 0,
    *,
    sampling: str = "loader",
    epoch_order: EpochOrder | None = None,
    llm: str = "llm",
) -> CvScaling:
    """Measured and predicted batch-to-batch CV of each module's total, per batch size.

    Args:
        metas, coeffs, seed, sampling, epoch_order, llm: as ``macrobatch_stats`` (the loader's order does not
            depend on the batch size).
        batch_sizes: global batch sizes to try; each at most ``len(metas)``; sorted and deduplicated.
        num_batches: batches drawn per batch size.

    Returns:
        A ``CvScaling``.

    Raises:
        ValueError: on an empty ``batch_sizes``, a size above ``len(metas)`` or below 1, and as
            ``macrobatch_stats``.
    """
    sizes = tuple(sorted({_check_int("batch_sizes entry", b, 1) for b in batch_sizes}))
    if not sizes:
        raise ValueError("batch_sizes is empty")
    modules, work = sample_work_matrix(metas, coeffs, llm)
    for b in sizes:  # every size before drawing any batch
        _check_batch_size(b, len(work))
    runs = [_stats_from_work(modules, work, b, num_batches, seed, sampling, epoch_order) for b in sizes]
    return CvScaling(
        modules=modules,
        num_samples=len(work),
        num_batches=int(num_batches),
        sampling=sampling,
        seed=int(seed),
        batch_sizes=sizes,
        cv=tuple(r.batch_cv for r in runs),
        predicted_cv=tuple(r.predicted_cv for r in runs),
    )


# ------------------------------------------------------------ expected microbatch shapes


def _item_tokens(arch: Any, placeholders: int, dropped: int) -> int:
    """Tokens an encoder's layers see for one item of ``placeholders`` LLM features: a Whisper-style audio
    encoder always fills its window (``item_len``); vision sees the features plus dropped prefix tokens."""
    if isinstance(arch, EncoderArch) and arch.modality == "audio":
        return int(arch.item_len)
    return int(placeholders) + int(dropped)


def expected_shapes(metas: Sequence[Any], configs: Mapping[str, Any], dropped: Mapping[str, int],
                    microbatch_size: int) -> dict[str, MicrobatchShape]:
    """Per-module shape of a microbatch of ``microbatch_size`` samples of the expected global batch.

    For module ``m``: tokens = ``microbatch_size`` x mean over samples of the sample's tokens in ``m``, and
    attended pairs = ``microbatch_size`` x the mean of the sample's per-layer attention pairs (encoder items
    ``n^2``, full attention; LLM ``L (L + 1) / 2``, causal), so linear and quadratic costs are the exact
    expectations; ``seq_len`` is the mean item (encoder) or sequence (LLM) length. An encoder no sample uses
    is left out (its upper-bound shape stays).

    Args:
        metas: ``SampleMeta`` per sample (``length`` and ``items``: ``(encoder, placeholders)``).
        configs: module configs (encoder ``EncoderArch`` by name, ``"llm"``, ``"<encoder>.projector"``).
        dropped: prefix tokens dropped per item, per encoder (``select="drop_cls"``).
        microbatch_size: samples per microbatch.

    Raises:
        ValueError: on an empty ``metas``, a ``microbatch_size`` below 1 or an item of an unknown encoder.
    """
    if not metas or microbatch_size < 1:
        raise ValueError(f"need samples and microbatch_size >= 1, got {len(metas)} samples, {microbatch_size}")
    sums: dict[str, list[float]] = {}  # module -> [tokens, pairs, items]
    for k, meta in enumerate(metas):
        for name, placeholders in meta.items:
            if name not in configs or name == "llm":
                raise ValueError(f"sample {k}: item of unknown encoder {name!r}")
            n = _item_tokens(configs[name], placeholders, dropped.get(name, 0))
            acc = sums.setdefault(name, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + n * n, acc[2] + 1
        acc = sums.setdefault("llm", [0.0, 0.0, 0.0])
        acc[0], acc[1], acc[2] = acc[0] + meta.length, acc[1] + meta.length * (meta.length + 1) / 2, acc[2] + 1
    scale = microbatch_size / len(metas)
    return {name: MicrobatchShape(tokens=max(1, round(tokens * scale)), seq_len=max(1, round(tokens / items)),
                                  attended_pairs=pairs * scale)
            for name, (tokens, pairs, items) in sums.items()}
