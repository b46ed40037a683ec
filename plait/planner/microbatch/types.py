"""The microbatch planner's data: per-module cost coefficients, per-sample costs, the policy, the plan.

Every class is a frozen dataclass with a JSON round trip (``serialize.JsonDataclass``); ``check_int`` and
``check_real`` are the validation helpers the package shares.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.planner.serialize import JsonDataclass

__all__ = [
    "METHODS",
    "CvScaling",
    "MacrobatchStats",
    "MicrobatchPlan",
    "MicrobatchPolicy",
    "ModuleCostCoeffs",
    "SampleCost",
    "WorkloadStats",
    "check_costs",
    "check_int",
    "check_real",
]


METHODS = ("arrival", "random", "lpt", "hierarchical")


def check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def check_real(owner: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``value`` is a finite real number >= 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ModuleCostCoeffs(JsonDataclass):
    """Cost model of one module per sample.

    An encoder costs ``pass_factor * (fixed + linear * n + quadratic * n**2)`` per item (image, clip) of
    ``n`` encoder tokens (patches, frames), summed over the sample's items for that encoder. The LLM costs
    the same expression once per sample with ``n = L``, the sequence length after projection (text plus
    placeholder tokens). The unit is whatever the coefficients are in (seconds, FLOPs); only ratios matter
    to the planner.

    Attributes:
        linear: cost per token (``a`` for an encoder, ``c`` for the LLM).
        quadratic: cost per squared token (``b``/``d``: self-attention).
        fixed: cost per item (encoder) or per sample (LLM), e.g. launch overhead.
        trainable: the module's parameters train, so its backward computes weight gradients (dW).
        needs_input_grad: something at or upstream of the module trains, so the backward computes input
            gradients (dX). ``None`` means "same as ``trainable``" (an encoder has nothing upstream).
        encoder_tokens_per_feature: encoder tokens per LLM placeholder token (encoders only), e.g. 4.0
            when a 2x2 patch merge sits between encoder and LLM: loader metadata counts an item's
            placeholders ``p``, the encoder cost is taken at ``n = round(p * encoder_tokens_per_feature)``.

    ``pass_factor`` = forward + dX + dW = 1, 2 or 3 (3 if trainable, 1 if frozen with nothing upstream
    training, 2 for a frozen LLM after a trainable projector), as in the Cornstarch frozen-aware cost model.

    Raises:
        ValueError: on a negative or non-finite coefficient.
    """

    linear: float = 1.0
    quadratic: float = 0.0
    fixed: float = 0.0
    trainable: bool = False
    needs_input_grad: bool | None = None
    encoder_tokens_per_feature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "fixed", "encoder_tokens_per_feature"):
            check_real("ModuleCostCoeffs", name, getattr(self, name))

    @property
    def pass_factor(self) -> int:
        """Forward plus backward passes, in forward-pass units: 1 + [dX] + [dW]."""
        dx = self.trainable if self.needs_input_grad is None else self.needs_input_grad
        return 1 + int(bool(dx)) + int(bool(self.trainable))

    def cost(self, tokens: int) -> float:
        """Cost of one item (encoder) or one sample (LLM) of ``tokens`` tokens, in the coefficients' unit."""
        return self.pass_factor * (self.fixed + self.linear * tokens + self.quadratic * tokens * tokens)

    def encoder_tokens(self, placeholders: int) -> int:
        """Encoder tokens of an item that fills ``placeholders`` LLM placeholder tokens."""
        return int(round(placeholders * self.encoder_tokens_per_feature))


@dataclass(frozen=True)
class SampleCost(JsonDataclass):
    """Per-module work of one sample of the global batch.

    Attributes:
        index: the sample's index in the global batch (unique, >= 0); plans list these indices.
        work: work per module, encoders first and the LLM last (see the package docstring), in any
            consistent unit (seconds, FLOPs); all samples of one batch have the same number of modules.
        tokens: LLM sequence length of the sample (tokens, after projection): what
            ``max_tokens_per_microbatch`` limits.
        has: which modules the sample uses; defaults to ``work > 0`` per module. A sample whose encoder
            work is all zero (text-only) is free to go to any microbatch at level 2.

    Raises:
        ValueError: on a negative index or token count, an empty, negative or non-finite ``work``, a ``has``
            of the wrong length, or positive work for a module the sample does not use.
    """

    index: int
    work: tuple[float, ...]
    tokens: int = 0
    has: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        check_int("SampleCost", "index", self.index, 0)
        check_int(f"SampleCost {self.index}", "tokens", self.tokens, 0)
        work = tuple(self.work)
        if not work:
            raise ValueError(f"SampleCost {self.index}: work needs at least one module (the LLM)")
        for k, w in enumerate(work):
            check_real(f"SampleCost {self.index}", f"work[{k}]", w)
        has = tuple(bool(h) for h in self.has) if self.has else tuple(w > 0 for w in work)
        if len(has) != len(work):
            raise ValueError(f"SampleCost {self.index}: has has {len(has)} entries, work has {len(work)}")
        for k, (w, h) in enumerate(zip(work, has)):
            if w > 0 and not h:
                raise ValueError(f"SampleCost {self.index}: work[{k}]={w} > 0 but has[{k}] is False")
        object.__setattr__(self, "index", int(self.index))
        object.__setattr__(self, "tokens", int(self.tokens))
        object.__setattr__(self, "work", tuple(float(w) for w in work))
        object.__setattr__(self, "has", has)

    @property
    def total(self) -> float:
        """Work summed over all modules."""
        return math.fsum(self.work)

    @property
    def encoder_work(self) -> float:
        """Work summed over the encoder modules (all but the last); 0 for a text-only sample."""
        return math.fsum(self.work[:-1])

    @property
    def llm_work(self) -> float:
        """Work of the LLM (the last module)."""
        return self.work[-1]


@dataclass(frozen=True)
class MicrobatchPolicy(JsonDataclass):
    """How to assign the samples of a global batch to DP ranks and microbatches.

    Attributes:
        method: ``"arrival"``, ``"random"``, ``"lpt"`` or ``"hierarchical"`` (``microbatch.plan``, ``microbatch.hierarchical``).
        dp: number of data-parallel replicas.
        num_microbatches: microbatches per replica and iteration (``M``).
        seed: seeds the shuffle (``"random"``) and the tie-breaking of all methods, with the step.
        equal_counts_per_rank: give every rank ``floor(N/dp)`` or ``ceil(N/dp)`` samples (DDP-style setups
            that need it). ``"arrival"`` and ``"random"`` always do; ``"lpt"`` and ``"hierarchical"`` honour
            the flag, otherwise counts may differ (the loss normalisation makes that correct).
        max_tokens_per_microbatch: LLM tokens (``SampleCost.tokens``) allowed in one microbatch (memory), or
            ``None``. Honoured by ``"lpt"`` and ``"hierarchical"``; the two baselines ignore it.
        allow_deferral: let ``"hierarchical"`` run a sample's LLM work in a later microbatch than its
            encoder work (level 2).
        max_deferred: at most this many samples' encoder outputs are buffered across any microbatch
            boundary of a rank (the buffered-memory bound of level 2).
        refine_rounds: passes of the pairwise move/swap local searches of ``"hierarchical"`` at levels 0,
            1 and 2 (0: greedy placement only, hence no deferral).

    Raises:
        ValueError: on an unknown method or an out-of-range field.
    """

    method: str = "hierarchical"
    dp: int = 1
    num_microbatches: int = 1
    seed: int = 0
    equal_counts_per_rank: bool = False
    max_tokens_per_microbatch: int | None = None
    allow_deferral: bool = True
    max_deferred: int = 4
    refine_rounds: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"MicrobatchPolicy.method must be one of {METHODS}, got {self.method!r}")
        check_int("MicrobatchPolicy", "dp", self.dp, 1)
        check_int("MicrobatchPolicy", "num_microbatches", self.num_microbatches, 1)
        check_int("MicrobatchPolicy", "seed", self.seed, 0)
        check_int("MicrobatchPolicy", "max_deferred", self.max_deferred, 0)
        check_int("MicrobatchPolicy", "refine_rounds", self.refine_rounds, 0)
        if self.max_tokens_per_microbatch is not None:
            check_int("MicrobatchPolicy", "max_tokens_per_microbatch", self.max_tokens_per_microbatch, 1)


def _as_nested_tuple(value: Any, depth: int) -> Any:
    if depth == 0:
        return value
    return tuple(_as_nested_tuple(v, depth - 1) for v in value)


@dataclass(frozen=True)
class MicrobatchPlan(JsonDataclass):
    """Which rank and microbatch runs each sample of one global batch (one iteration).

    Attributes:
        method: the policy method that made the plan.
        dp: number of DP ranks.
        num_microbatches: microbatches per rank (``M``).
        step: the training step the plan is for.
        microbatches: ``microbatches[rank][i]`` = sample indices (ascending) whose encoder work runs in
            microbatch ``i`` of ``rank``: the samples the loader hands to that microbatch. May be empty
            (package docstring: the runtime treats it as a no-op; it contributes zero loss).
        llm_microbatch: same shape as ``microbatches``; ``llm_microbatch[rank][i][k]`` is the microbatch
            ``j >= i`` in which the LLM work of sample ``microbatches[rank][i][k]`` runs. ``j > i`` means the
            sample is *deferred*: its encoder output is buffered from microbatch ``i`` to ``j``. Each
            sample's ``(encoder_microbatch, llm_microbatch)`` pair is therefore ``(i, j)``, equal when not
            deferred. Empty (the default) means no sample is deferred.

    Raises:
        ValueError: on a wrong shape, a sample listed twice, or a pair that is not ``0 <= i <= j < M``.
    """

    method: str
    dp: int
    num_microbatches: int
    step: int
    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    llm_microbatch: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def __post_init__(self) -> None:
        check_int("MicrobatchPlan", "dp", self.dp, 1)
        check_int("MicrobatchPlan", "num_microbatches", self.num_microbatches, 1)
        check_int("MicrobatchPlan", "step", self.step, 0)
        mbs = _as_nested_tuple(self.microbatches, 3)
        llm = (
            _as_nested_tuple(self.llm_microbatch, 3)
            if self.llm_microbatch
            else tuple(tuple(tuple(i for _ in mb) for i, mb in enumerate(rank)) for rank in mbs)
        )
        object.__setattr__(self, "microbatches", mbs)
        object.__setattr__(self, "llm_microbatch", llm)
        self._validate()

    def _validate(self) -> None:
        m = self.num_microbatches
        if len(self.microbatches) != self.dp or len(self.llm_microbatch) != self.dp:
            raise ValueError(f"MicrobatchPlan: need {self.dp} ranks in microbatches and llm_microbatch")
        seen: set[int] = set()
        for r, (rank, llm_rank) in enumerate(zip(self.microbatches, self.llm_microbatch)):
            if len(rank) != m or len(llm_rank) != m:
                raise ValueError(f"MicrobatchPlan: rank {r} needs {m} microbatches")
            for i, (mb, llm) in enumerate(zip(rank, llm_rank)):
                if len(mb) != len(llm):
                    raise ValueError(
                        f"MicrobatchPlan: rank {r} microbatch {i}: llm_microbatch length differs"
                    )
                for index, j in zip(mb, llm):
                    check_int("MicrobatchPlan", f"sample index in rank {r} microbatch {i}", index, 0)
                    if index in seen:
                        raise ValueError(f"MicrobatchPlan: sample {index} is assigned twice")
                    seen.add(index)
                    if isinstance(j, bool) or not isinstance(j, int) or not i <= j < m:
                        raise ValueError(
                            f"MicrobatchPlan: sample {index} has encoder microbatch {i} "
                            f"but LLM microbatch {j!r}; need {i} <= j < {m}"
                        )

    @functools.cached_property
    def placements(self) -> dict[int, tuple[int, int, int]]:
        """``{sample index: (rank, encoder_microbatch, llm_microbatch)}`` for every planned sample."""
        out = {}
        for r, (rank, llm_rank) in enumerate(zip(self.microbatches, self.llm_microbatch)):
            for i, (mb, llm) in enumerate(zip(rank, llm_rank)):
                out.update({index: (r, i, j) for index, j in zip(mb, llm)})
        return out

    @property
    def num_samples(self) -> int:
        """Samples in the plan, over all ranks and microbatches."""
        return len(self.placements)

    def llm_microbatches(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """The LLM view of ``rank``: per microbatch ``j``, the sample indices (ascending) whose LLM work runs
        in ``j`` (deferred samples included, from their buffered encoder outputs)."""
        views: list[list[int]] = [[] for _ in range(self.num_microbatches)]
        for mb, llm in zip(self.microbatches[rank], self.llm_microbatch[rank]):
            for index, j in zip(mb, llm):
                views[j].append(index)
        return tuple(tuple(sorted(v)) for v in views)

    def deferred(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(index, rank, encoder_microbatch, llm_microbatch)`` of every deferred sample, by index."""
        return tuple((x, r, i, j) for x, (r, i, j) in sorted(self.placements.items()) if j > i)

    def buffered(self, rank: int) -> tuple[int, ...]:
        """Per boundary ``k`` (between microbatch ``k`` and ``k + 1``, ``M - 1`` entries) of ``rank``: the
        number of samples whose encoder output is buffered across it (``i <= k < j``)."""
        counts = [0] * max(self.num_microbatches - 1, 0)
        for _, r, i, j in self.deferred():
            if r == rank:
                for k in range(i, j):
                    counts[k] += 1
        return tuple(counts)


def check_costs(costs: Sequence[SampleCost]) -> tuple[SampleCost, ...]:
    """``costs`` as a tuple, checked: all ``SampleCost``, unique indices, one module count.

    Raises:
        ValueError: naming the first offending entry.
    """
    costs = tuple(costs)
    seen: set[int] = set()
    for position, cost in enumerate(costs):
        if not isinstance(cost, SampleCost):
            raise ValueError(f"costs[{position}] must be a SampleCost, got {type(cost).__name__}")
        if cost.index in seen:
            raise ValueError(f"costs[{position}]: sample index {cost.index} appears twice")
        if len(cost.work) != len(costs[0].work):
            raise ValueError(
                f"sample {cost.index}: {len(cost.work)} modules, sample {costs[0].index} has "
                f"{len(costs[0].work)}"
            )
        seen.add(cost.index)
    return costs


@dataclass(frozen=True)
class WorkloadStats(JsonDataclass):
    """Work balance of a plan (Entrain's metric).

    Per-microbatch work of a module: the sum over the samples whose work of that module runs in the
    microbatch (encoders at the encoder microbatch, the LLM at the LLM microbatch), over all ``dp * M``
    microbatches, empty ones included. A module with no work at all has ``cv = 0`` and ``max/mean = 1``.

    Attributes:
        modules: module names (``work`` order, LLM last).
        cv: per module, population std / mean of the per-microbatch work.
        max_over_mean: per module, max / mean of the per-microbatch work (stragglers set pipeline pace).
        total_cv, total_max_over_mean: the same for the work summed over modules.
        rank_max_over_mean: per module, max / mean of the per-rank totals (DP stragglers).
        num_microbatches: ``dp * M``.
        num_deferred: deferred samples.
        max_buffered: most samples buffered across one microbatch boundary of one rank.
    """

    modules: tuple[str, ...]
    cv: tuple[float, ...]
    max_over_mean: tuple[float, ...]
    total_cv: float
    total_max_over_mean: float
    rank_max_over_mean: tuple[float, ...]
    num_microbatches: int
    num_deferred: int
    max_buffered: int


@dataclass(frozen=True)
class MacrobatchStats(JsonDataclass):
    """Per-module work of single samples and of whole global batches (module docstring).

    All work figures are in the unit of the cost coefficients (seconds, FLOPs); tuples follow ``modules``
    (encoders first, LLM last).

    Attributes:
        modules: module names.
        num_samples: dataset size ``N``.
        global_batch_size: ``B``.
        num_batches: full batches drawn.
        sampling: ``"loader"`` or ``"independent"``.
        seed: the sampling seed.
        usage: fraction of the dataset's samples that use each module (work > 0).
        sample_mean, sample_cv, sample_min, sample_max: per-sample work over the whole dataset (samples that
            do not use a module count as 0).
        expected: exact expected total per batch, ``B * sample_mean``: what a static plan is sized for.
        batch_mean, batch_cv, batch_min, batch_max: the totals per batch over the drawn batches.
        predicted_cv: ``predicted_batch_cv(sample_cv, B, N)``, the ``1 / sqrt(B)`` law.
    """

    modules: tuple[str, ...]
    num_samples: int
    global_batch_size: int
    num_batches: int
    sampling: str
    seed: int
    usage: tuple[float, ...]
    sample_mean: tuple[float, ...]
    sample_cv: tuple[float, ...]
    sample_min: tuple[float, ...]
    sample_max: tuple[float, ...]
    expected: tuple[float, ...]
    batch_mean: tuple[float, ...]
    batch_cv: tuple[float, ...]
    batch_min: tuple[float, ...]
    batch_max: tuple[float, ...]
    predicted_cv: tuple[float, ...]

    def format_table(self, unit: str = "") -> str:
        """A fixed-width text table, one row per module (``unit`` labels the work columns)."""
        where = f" ({unit})" if unit else ""
        lines = [
            f"macro-batch work per module{where}: N={self.num_samples} samples, global batch "
            f"{self.global_batch_size}, {self.num_batches} batches ({self.sampling} order, seed {self.seed})",
            f"{'module':<10} {'used':>6} | {'sample mean':>11} {'cv':>6} {'min':>9} {'max':>9} | "
            f"{'batch expected':>14} {'mean':>9} {'cv':>7} {'cv 1/sqrtB':>10} {'min':>9} {'max':>9}",
        ]
        for k, name in enumerate(self.modules):
            lines.append(
                f"{name:<10} {self.usage[k]:>6.1%} | {self.sample_mean[k]:>11.4g} {self.sample_cv[k]:>6.2f} "
                f"{self.sample_min[k]:>9.3g} {self.sample_max[k]:>9.3g} | {self.expected[k]:>14.4g} "
                f"{self.batch_mean[k]:>9.4g} {self.batch_cv[k]:>7.2%} {self.predicted_cv[k]:>10.2%} "
                f"{self.batch_min[k]:>9.4g} {self.batch_max[k]:>9.4g}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class CvScaling(JsonDataclass):
    """Batch-to-batch CV of each module's total for several batch sizes (the ``1 / sqrt(B)`` law).

    Attributes:
        modules: module names (encoders first, LLM last).
        num_samples: dataset size ``N``.
        num_batches: batches drawn per batch size.
        sampling, seed: as ``MacrobatchStats``.
        batch_sizes: the batch sizes, ascending.
        cv: ``cv[s][k]``, measured CV of module ``k``'s batch total at ``batch_sizes[s]``.
        predicted_cv: the same from ``predicted_batch_cv``.
    """

    modules: tuple[str, ...]
    num_samples: int
    num_batches: int
    sampling: str
    seed: int
    batch_sizes: tuple[int, ...]
    cv: tuple[tuple[float, ...], ...]
    predicted_cv: tuple[tuple[float, ...], ...]

    def format_table(self) -> str:
        """A fixed-width text table: one row per batch size, measured (predicted) CV per module."""
        lines = [
            f"CV of per-module work per global batch (N={self.num_samples}, {self.num_batches} batches each, "
            f"{self.sampling} order, seed {self.seed}): measured (1/sqrt(B) prediction)",
            f"{'batch':>6} " + " ".join(f"{name:>19}" for name in self.modules),
        ]
        for b, row, pred in zip(self.batch_sizes, self.cv, self.predicted_cv):
            cells = " ".join(f"{c:>9.2%} ({p:>7.2%})" for c, p in zip(row, pred))
            lines.append(f"{b:>6} {cells}")
        return "\n".join(lines)
