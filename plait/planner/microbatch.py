"""Workload-balanced microbatch assignment: which DP rank and which microbatch runs each sample.

A multimodal sample costs differently in every module: a 4-megapixel image is heavy for the vision
encoder, a 30 s clip for the audio encoder, a long conversation for the LLM, and a text-only sample costs
nothing in any encoder. When the samples of a global batch are cut into microbatches in arrival order, the
per-microbatch work of every module swings widely, and since each pipeline stage runs one module's layers,
the slowest stage of every microbatch sets the pace (bubbles) and the slowest DP replica sets the step time
(stragglers). This planner assigns the samples of one global batch to DP replicas and, inside a replica,
to ``M`` microbatches so that every module sees steady work.

Source: Entrain, "variable heterogeneity in multimodal training" (arXiv 2605.27918), summarised in
../shared/REFERENCES.md section 3. The source text of the algorithm was not available: the
``"hierarchical"`` method below is a **reconstruction** (our design, following the paper's outline):

* **Level 0** (DP replicas) balances the *vector* of per-module totals: every module's work is normalised
  by its global-batch total, samples are placed largest first on the replica where they raise the squared
  load least (a vector form of LPT), then pairwise moves and swaps between replicas lower the sum of
  squared normalised loads until no exchange helps (or ``refine_rounds`` passes were made).
* **Level 1** (microbatches of one replica) does the same for the samples that have encoder work, over
  the vector of encoder totals plus, at a quarter weight, their LLM total (our addition: it keeps the LLM
  balanced when there are few text-only samples or deferral is off; figures at ``_LEVEL1_LLM_DIVISOR``).
  Its microbatches are then ordered by decreasing LLM work, which only relabels them (encoder balance is
  unchanged) but puts the LLM-heavy ones first, where forward-only deferral can relieve them.
* **Level 2** balances the LLM. The samples with no encoder work (text-only) go, largest first, to the
  microbatch with the least LLM work (LPT), filling the light ones. Then a pairwise local search on the
  sum of squared LLM loads moves and swaps LLM work between microbatches: a text-only sample may go
  anywhere, a sample with encoder work only to a later microbatch of the same iteration (*deferral*: its
  encoder work stays where level 1 put it and its encoder output is buffered until its LLM work runs) or
  back towards its encoder microbatch. At most ``max_deferred`` samples are buffered across any
  microbatch boundary. (A first version deferred in one forward sweep before the search; the search alone
  reached the same or lower CV on our synthetic mixtures, so the sweep was dropped.)

Baselines: ``"arrival"`` (consecutive equal-count groups in arrival order, what a plain loader does),
``"random"`` (a seeded shuffle, then the same) and ``"lpt"`` (Graham 1969, "Bounds on multiprocessing timing
anomalies", SIAM J. Appl. Math. 17(2): longest processing time first, onto the least-loaded microbatch,
over the scalar total cost of all modules).

Determinism: a plan depends only on ``(costs, policy, step)``. Ties are broken by a permutation drawn from
a generator seeded with a hash of ``(policy.seed, step)`` (so for ``"hierarchical"`` and ``"lpt"`` the step
only matters through ties); the hierarchical balancing is exact integer arithmetic on quantised work and
``"lpt"`` adds floats in a fixed order, so every rank computes the same plan without communication (same
Python version assumed, as for any seeded run).

Empty microbatches: with fewer samples than ``dp * num_microbatches`` (or when a balanced plan needs it),
some microbatches are empty tuples. The runtime must still run the iteration's schedule for them as
no-ops (every stage of the replica reads the same plan, so they skip the same slots) and the replica still
joins the gradient all-reduce. Because the loss of a global batch is the sum of token cross-entropies
divided by the number of target tokens of the *whole* global batch (../shared/DESIGN.md, "Loss
normalisation"), an empty microbatch contributes exactly zero loss and zero gradient, and neither the
grouping nor unequal sample counts per rank change the gradient. With deferral a microbatch can also be
empty for the encoders only (its LLM samples are text-only or come from buffers) or for the LLM only (all
its samples deferred): the runtime reads the encoder view (``microbatches``) and the LLM view
(``MicrobatchPlan.llm_microbatches``) separately.

Module order: ``SampleCost.work`` holds one entry per module; the encoders come first in a fixed order and
the LLM is always the **last** entry (``sample_costs_from_metadata`` builds them that way and
``module_order`` names them).
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.planner.serialize import JsonDataclass

__all__ = [
    "METHODS",
    "MicrobatchPlan",
    "MicrobatchPolicy",
    "ModuleCostCoeffs",
    "SampleCost",
    "WorkloadStats",
    "module_order",
    "plan_microbatches",
    "sample_costs_from_metadata",
    "workload_stats",
]

METHODS = ("arrival", "random", "lpt", "hierarchical")

# Balancing works on work quantised to integer "ticks": each module's total over the group being split is
# _SCALE ticks. Integer sums are exact and order independent, so every rank gets the same plan; the
# refinement's squared terms stay below 2**50 * modules, far inside int64.
_SCALE = 1 << 24
# Largest swap matrix (rows x cols x modules) evaluated at once in the refinement (memory bound).
_SWAP_BLOCK = 1 << 20
# A group within 1/_SETTLED of the mean load in every dimension is "settled": the refinement does not
# exchange items between two settled groups (this saves time, not balance: 0.4% is below the noise of any
# cost model).
_SETTLED = 256
# Level 1 also balances the LLM work of the samples with encoder work, at a quarter of an encoder's weight.
# Measured on a synthetic mixture (global batch 256, M 16): encoder-only level 1 leaves an LLM CV of 2.4%
# with deferral and no text-only samples (8% without deferral), a quarter weight 0.2% (0.6%), while the
# encoder CVs stay below 0.5%; deferral and text-only filling (level 2) then remove the rest.
_LEVEL1_LLM_DIVISOR = 4
# Exchange partners per group and pass of the refinement (bounds its cost at many DP ranks).
_PARTNERS = 8


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_real(owner: str, name: str, value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value!r}")


# ------------------------------------------------------------ inputs


@dataclass(frozen=True)
class ModuleCostCoeffs(JsonDataclass):
    """Cost model of one module per sample (../shared/REFERENCES.md section 3).

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
    training, 2 for a frozen LLM after a trainable projector), as in the Cornstarch frozen-aware cost model
    (../shared/REFERENCES.md section 1).

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
            _check_real("ModuleCostCoeffs", name, getattr(self, name))

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
        work: work per module, encoders first and the LLM last (see the module docstring), in any
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
        _check_int("SampleCost", "index", self.index, 0)
        _check_int(f"SampleCost {self.index}", "tokens", self.tokens, 0)
        work = tuple(self.work)
        if not work:
            raise ValueError(f"SampleCost {self.index}: work needs at least one module (the LLM)")
        for k, w in enumerate(work):
            _check_real(f"SampleCost {self.index}", f"work[{k}]", w)
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
        method: ``"arrival"``, ``"random"``, ``"lpt"`` or ``"hierarchical"`` (module docstring).
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
        _check_int("MicrobatchPolicy", "dp", self.dp, 1)
        _check_int("MicrobatchPolicy", "num_microbatches", self.num_microbatches, 1)
        _check_int("MicrobatchPolicy", "seed", self.seed, 0)
        _check_int("MicrobatchPolicy", "max_deferred", self.max_deferred, 0)
        _check_int("MicrobatchPolicy", "refine_rounds", self.refine_rounds, 0)
        if self.max_tokens_per_microbatch is not None:
            _check_int("MicrobatchPolicy", "max_tokens_per_microbatch", self.max_tokens_per_microbatch, 1)


def module_order(coeffs: Mapping[str, ModuleCostCoeffs], llm: str = "llm") -> tuple[str, ...]:
    """Module names in ``SampleCost.work`` order: the encoders in ``coeffs`` order, then ``llm`` last.

    Raises:
        ValueError: when ``coeffs`` has no entry named ``llm``.
    """
    if llm not in coeffs:
        raise ValueError(f"coeffs needs an entry for the LLM {llm!r}, got {sorted(coeffs)}")
    return tuple(name for name in coeffs if name != llm) + (llm,)


def _meta_field(meta: Any, name: str, position: int) -> Any:
    if isinstance(meta, Mapping):
        if name not in meta:
            raise ValueError(f"sample {position}: metadata lacks {name!r}")
        return meta[name]
    if not hasattr(meta, name):
        raise ValueError(f"sample {position}: metadata lacks {name!r}")
    return getattr(meta, name)


def _item_tokens(item: Any, position: int, coeffs: Mapping[str, ModuleCostCoeffs]) -> tuple[str, int, int]:
    """(encoder, placeholder tokens, encoder tokens) of one item: ``(encoder, placeholders)`` or
    ``(encoder, placeholders, encoder_tokens)``."""
    if not isinstance(item, Sequence) or isinstance(item, str) or len(item) not in (2, 3):
        raise ValueError(
            f"sample {position}: item {item!r} must be (encoder, placeholders[, encoder_tokens])"
        )
    name, placeholders = item[0], item[1]
    if name not in coeffs:
        raise ValueError(f"sample {position}: encoder {name!r} has no cost coefficients")
    _check_int(f"sample {position} item {name!r}", "placeholders", placeholders, 0)
    tokens = item[2] if len(item) == 3 else coeffs[name].encoder_tokens(placeholders)
    _check_int(f"sample {position} item {name!r}", "encoder_tokens", tokens, 0)
    return name, int(placeholders), int(tokens)


def sample_costs_from_metadata(
    meta_list: Sequence[Any], coeffs: Mapping[str, ModuleCostCoeffs], llm: str = "llm"
) -> tuple[SampleCost, ...]:
    """Per-sample module costs from loader metadata (../shared/REFERENCES.md section 3).

    Args:
        meta_list: one entry per sample of the global batch (its position is ``SampleCost.index``): a
            ``plait.data.processing.SampleMeta``, or any mapping/object with ``text_tokens`` (tokens that
            are not placeholders) and ``items`` (``(encoder, placeholders)`` per image/clip, the number of
            LLM placeholder tokens it fills, or ``(encoder, placeholders, encoder_tokens)`` when the
            encoder's own token count is known). An optional ``length`` (LLM tokens) is checked.
        coeffs: cost coefficients per module name: one per encoder and one for ``llm``.
        llm: the name of the LLM entry in ``coeffs``.

    Returns:
        One ``SampleCost`` per sample; ``work`` follows ``module_order(coeffs, llm)``: per encoder the sum of
        its items' costs, for the LLM ``coeffs[llm].cost(L)`` with ``L = text_tokens + placeholders``
        (``SampleCost.tokens = L``).

    Raises:
        ValueError: on a missing field, an unknown encoder, a negative token count, a ``length`` that is
            not ``L``, or no ``llm`` entry.
    """
    order = module_order(coeffs, llm)
    slot = {name: k for k, name in enumerate(order)}
    out = []
    for position, meta in enumerate(meta_list):
        text = _meta_field(meta, "text_tokens", position)
        _check_int(f"sample {position}", "text_tokens", text, 0)
        parts: list[list[float]] = [[] for _ in order]
        length = int(text)
        for item in _meta_field(meta, "items", position):
            name, placeholders, tokens = _item_tokens(item, position, coeffs)
            if name == llm:
                raise ValueError(f"sample {position}: item encoder {name!r} is the LLM")
            parts[slot[name]].append(coeffs[name].cost(tokens))
            length += placeholders
        _check_length(meta, position, length)
        parts[-1].append(coeffs[llm].cost(length))
        has = tuple(bool(p) for p in parts[:-1]) + (True,)
        work = tuple(math.fsum(p) for p in parts)
        out.append(SampleCost(index=position, work=work, tokens=length, has=has))
    return tuple(out)


def _check_length(meta: Any, position: int, length: int) -> None:
    given = meta.get("length") if isinstance(meta, Mapping) else getattr(meta, "length", None)
    if given is not None and given != length:
        raise ValueError(f"sample {position}: length={given} but text_tokens + placeholders = {length}")


# ------------------------------------------------------------ output


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
            (module docstring: the runtime treats it as a no-op; it contributes zero loss).
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
        _check_int("MicrobatchPlan", "dp", self.dp, 1)
        _check_int("MicrobatchPlan", "num_microbatches", self.num_microbatches, 1)
        _check_int("MicrobatchPlan", "step", self.step, 0)
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
                    _check_int("MicrobatchPlan", f"sample index in rank {r} microbatch {i}", index, 0)
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


# ------------------------------------------------------------ helpers


def _tie_keys(n: int, seed: int, step: int) -> list[int]:
    """A permutation of ``range(n)`` drawn from ``(seed, step)``: ``keys[p]`` breaks ties of sample ``p``."""
    digest = hashlib.sha256(f"plait.microbatch:{seed}:{step}".encode()).digest()
    perm = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(perm)
    keys = [0] * n
    for rank, position in enumerate(perm):
        keys[position] = rank
    return keys


def _chunks(items: Sequence[int], parts: int) -> list[Sequence[int]]:
    """``parts`` consecutive chunks whose sizes differ by at most one (the larger ones first)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for j in range(parts):
        size = q + (j < r)
        out.append(items[start : start + size])
        start += size
    return out


def _count_ok(counts: np.ndarray, n: int) -> np.ndarray:
    """Groups that may take one more item when ``n`` items must end ``floor`` or ``ceil(n / groups)`` each."""
    floor, extra = divmod(n, len(counts))
    at_ceil = int(np.count_nonzero(counts > floor))
    return (counts < floor) | ((counts == floor) & (at_ceil < extra))


def _pick(score: np.ndarray, counts: np.ndarray, mask: np.ndarray) -> int:
    """The allowed group with the least score, then the fewest items, then the lowest index; -1 if none."""
    candidates = np.flatnonzero(mask)
    if candidates.size == 0:
        return -1
    s = score[candidates]
    best = candidates[s == s.min()]
    return int(best[np.argmin(counts[best])])


def _no_fit(cost: SampleCost, policy: MicrobatchPolicy) -> ValueError:
    return ValueError(
        f"sample {cost.index} (tokens={cost.tokens}) fits in no microbatch under "
        f"max_tokens_per_microbatch={policy.max_tokens_per_microbatch} (method {policy.method!r}); "
        f"raise the cap or num_microbatches"
    )


def _ticks(costs: Sequence[SampleCost], positions: Sequence[int], modules: Sequence[int]) -> np.ndarray:
    """Work of ``positions`` x ``modules`` in integer ticks, each module's total over ``positions`` = _SCALE.

    Returns:
        int64 array of shape (len(positions), len(modules)); a module with zero total is all zeros.
    """
    out = np.zeros((len(positions), len(modules)), dtype=np.int64)
    for col, k in enumerate(modules):
        values = [costs[p].work[k] for p in positions]
        total = math.fsum(values)
        if total > 0:
            out[:, col] = [round(v / total * _SCALE) for v in values]
    return out


# ------------------------------------------------------------ baselines


def _plan_equal_groups(order: Sequence[int], policy: MicrobatchPolicy) -> list[tuple[int, int, int]]:
    """Consecutive equal-count groups of ``order``: first over DP ranks, then over microbatches."""
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * len(order)
    for r, chunk in enumerate(_chunks(order, policy.dp)):
        for i, part in enumerate(_chunks(chunk, policy.num_microbatches)):
            for p in part:
                assign[p] = (r, i, i)
    return assign


def _plan_arrival(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    return _plan_equal_groups(list(range(len(costs))), policy)


def _plan_random(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    return _plan_equal_groups(sorted(range(len(costs)), key=keys.__getitem__), policy)


def _plan_lpt(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    """Graham's LPT over all ``dp * M`` microbatches on the scalar total cost; microbatch ``g`` belongs to
    rank ``g // M``. Honours ``equal_counts_per_rank`` and ``max_tokens_per_microbatch``."""
    m, n = policy.num_microbatches, len(costs)
    groups = policy.dp * m
    totals = [c.total for c in costs]
    loads = np.zeros(groups)
    counts = np.zeros(groups, dtype=np.int64)
    tokens = np.zeros(groups, dtype=np.int64)
    rank_counts = np.zeros(policy.dp, dtype=np.int64)
    cap = policy.max_tokens_per_microbatch
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * n
    for p in sorted(range(n), key=lambda p: (-totals[p], keys[p])):
        mask = np.ones(groups, dtype=bool)
        if policy.equal_counts_per_rank:
            mask &= np.repeat(_count_ok(rank_counts, n), m)
        if cap is not None:
            mask &= tokens + costs[p].tokens <= cap
        g = _pick(loads, counts, mask)
        if g < 0:
            raise _no_fit(costs[p], policy)
        loads[g] += totals[p]
        counts[g] += 1
        tokens[g] += costs[p].tokens
        rank_counts[g // m] += 1
        assign[p] = (g // m, g % m, g % m)
    return assign


# ------------------------------------------------------------ vector partition


@dataclass
class _Groups:
    """Mutable state of a partition of items (rows of ``weights``) into groups, with its limits.

    ``weights``: int64 (items, dims) ticks; ``tokens``: int64 (items,); ``cap``: token cap per group or
    None; ``equal_counts``: final counts must be floor/ceil of items/groups (then only swaps refine).
    """

    weights: np.ndarray
    tokens: np.ndarray
    num_groups: int
    cap: int | None
    equal_counts: bool

    def __post_init__(self) -> None:
        self.group = np.full(len(self.weights), -1, dtype=np.int64)
        self.loads = np.zeros((self.num_groups, self.weights.shape[1]), dtype=np.int64)
        self.counts = np.zeros(self.num_groups, dtype=np.int64)
        self.load_tokens = np.zeros(self.num_groups, dtype=np.int64)

    def place(self, item: int, g: int, sign: int = 1) -> None:
        """Add (``sign=1``) or remove (``sign=-1``) ``item`` to/from group ``g``."""
        self.loads[g] += sign * self.weights[item]
        self.counts[g] += sign
        self.load_tokens[g] += sign * self.tokens[item]
        self.group[item] = g if sign > 0 else -1

    def members(self, g: int) -> np.ndarray:
        """Items of group ``g`` (ascending)."""
        return np.flatnonzero(self.group == g)


def _greedy_partition(state: _Groups, keys: Sequence[int]) -> int:
    """Vector LPT: items largest first (by their largest normalised entry) onto the group where they raise
    the sum of squared loads least, i.e. the least ``loads @ w``; ties to fewer items, then lower index.

    Returns:
        -1 when every item was placed, else the first item that fits in no group (token cap).
    """
    w = state.weights
    n = len(w)
    peak, size = w.max(axis=1, initial=0), w.sum(axis=1)
    for item in sorted(range(n), key=lambda i: (-int(peak[i]), -int(size[i]), keys[i])):
        mask = np.ones(state.num_groups, dtype=bool)
        if state.equal_counts:
            mask &= _count_ok(state.counts, n)
        if state.cap is not None:
            mask &= state.load_tokens + state.tokens[item] <= state.cap
        g = _pick(state.loads @ w[item], state.counts, mask)
        if g < 0:
            return item
        state.place(item, g)
    return -1


def _best_swap(state: _Groups, a: np.ndarray, b: np.ndarray, diff: np.ndarray, g1: int, g2: int):
    """Best swap of item ``a[x]`` (in g1) with ``b[y]`` (in g2): (delta, x, y), delta = change of the sum of
    squared loads / 2 (int); (0, -1, -1) when none improves. Evaluated in row blocks to bound memory."""
    best = (0, -1, -1)
    if len(a) == 0 or len(b) == 0:
        return best
    wa, wb = state.weights[a], state.weights[b]
    rows = max(1, _SWAP_BLOCK // max(1, len(b) * wa.shape[1]))
    for start in range(0, len(a), rows):
        d = wb[None, :, :] - wa[start : start + rows, None, :]
        delta = d @ diff + (d * d).sum(axis=2)
        if state.cap is not None:
            ta = state.tokens[a[start : start + rows], None]
            tb = state.tokens[b][None, :]
            ok = (state.load_tokens[g1] - ta + tb <= state.cap) & (
                state.load_tokens[g2] + ta - tb <= state.cap
            )
            delta = np.where(ok, delta, 0)
        flat = int(np.argmin(delta))
        x, y = divmod(flat, len(b))
        if int(delta[x, y]) < best[0]:
            best = (int(delta[x, y]), start + x, y)
    return best


def _best_move(state: _Groups, a: np.ndarray, diff: np.ndarray, target: int) -> tuple[int, int]:
    """Best move of an item ``a[x]`` to group ``target``; ``diff`` = load(source) - load(target).
    Returns (delta, x) with delta the change of the sum of squared loads / 2, or (0, -1)."""
    if len(a) == 0:
        return 0, -1
    wa = state.weights[a]
    delta = (wa * wa).sum(axis=1) - wa @ diff
    if state.cap is not None:
        delta = np.where(state.load_tokens[target] + state.tokens[a] <= state.cap, delta, 0)
    x = int(np.argmin(delta))
    return (int(delta[x]), x) if delta[x] < 0 else (0, -1)


def _improve_pair(state: _Groups, g1: int, g2: int) -> bool:
    """Apply the single best improving move or swap between groups g1 and g2; True if one was applied.

    Moving ``w`` from g1 to g2 changes the sum of squared loads by ``2 (|w|^2 - w . (L1 - L2))``; swapping
    ``a`` (g1) with ``b`` (g2), with ``d = b - a``, by ``2 (|d|^2 + d . (L1 - L2))``.
    """
    a, b = state.members(g1), state.members(g2)
    diff = state.loads[g1] - state.loads[g2]
    options = [_best_swap(state, a, b, diff, g1, g2)]
    if not state.equal_counts:
        d12, x = _best_move(state, a, diff, g2)
        d21, y = _best_move(state, b, -diff, g1)
        options += [(d12, x, -1), (d21, -1, y)]
    delta, x, y = min(options, key=lambda o: o[0])
    if delta >= 0:
        return False
    if x >= 0:
        state.place(int(a[x]), g1, -1)
        state.place(int(a[x]), g2)
    if y >= 0:
        state.place(int(b[y]), g2, -1)
        state.place(int(b[y]), g1)
    return True


def _settled(loads: np.ndarray) -> np.ndarray:
    """Groups whose load is within ``_SETTLED`` of the mean in every dimension (they need no exchange with
    each other). ``loads``: int64 (groups,) or (groups, dims). Returns bool (groups,)."""
    loads = loads.reshape(len(loads), -1)
    total = loads.sum(axis=0)
    return np.all(np.abs(loads * len(loads) - total) * _SETTLED <= total, axis=1)


def _pairs(loads: np.ndarray) -> list[tuple[int, int]]:
    """Group pairs worth an exchange, most unbalanced group first, each with its ``_PARTNERS`` most
    complementary groups (most negative dot product of deviations from the mean), or all pairs when
    there are few groups. Pairs of two settled groups are left out."""
    g = len(loads)
    dev = loads - loads.sum(axis=0) // g  # |dev| <= _SCALE, so dev @ dev stays far inside int64
    settled = _settled(loads)
    out: dict[tuple[int, int], None] = {}
    for g1 in np.argsort(-np.abs(dev).max(axis=1), kind="stable"):
        others = np.argsort(dev @ dev[g1], kind="stable") if g > _PARTNERS + 1 else np.arange(g)
        for g2 in [int(g2) for g2 in others if g2 != g1][:_PARTNERS]:
            if not (settled[g1] and settled[g2]) and (g2, int(g1)) not in out:
                out[(int(g1), g2)] = None
    return list(out)


def _refine_partition(state: _Groups, rounds: int) -> None:
    """Pairwise local search on the sum of squared normalised loads (each module weighs the same): up to
    ``rounds`` passes over the pairs of ``_pairs``, stopping at a pass with no improvement. Exact integer
    arithmetic, so it terminates (the objective strictly falls) and is the same on every rank."""
    for _ in range(rounds):
        changed = False
        for g1, g2 in _pairs(state.loads):
            changed |= _improve_pair(state, g1, g2)
        if not changed:
            return


def _balance(weights, tokens, groups, cap, equal_counts, keys, rounds) -> tuple[np.ndarray, int]:
    """Greedy vector LPT then refinement. Returns (group per item, -1 or the first item that did not fit)."""
    state = _Groups(weights, np.asarray(tokens, dtype=np.int64), groups, cap, equal_counts)
    failed = _greedy_partition(state, keys)
    if failed >= 0:
        return state.group, failed
    if groups > 1:
        _refine_partition(state, rounds)
    return state.group, -1


# ------------------------------------------------------------ hierarchical


def _level0(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]) -> list[list[int]]:
    """Level 0: split the global batch over DP ranks balancing the vector of all module totals.
    Returns the sample positions of each rank."""
    n = len(costs)
    if policy.dp == 1 or n == 0:
        return [list(range(n))] + [[] for _ in range(policy.dp - 1)]
    weights = _ticks(costs, range(n), range(len(costs[0].work)))
    group, _ = _balance(
        weights, np.zeros(n), policy.dp, None, policy.equal_counts_per_rank, keys, policy.refine_rounds
    )
    return [[p for p in range(n) if group[p] == r] for r in range(policy.dp)]


def _level1(costs, members: list[int], policy: MicrobatchPolicy, keys: list[int]) -> list[list[int]]:
    """Level 1: the samples of one rank that have encoder work, onto M microbatches balancing the vector of
    encoder totals plus, at 1/_LEVEL1_LLM_DIVISOR weight, their LLM total (token cap honoured). Returns
    the positions per microbatch."""
    m = policy.num_microbatches
    if not members:
        return [[] for _ in range(m)]
    llm = len(costs[members[0]].work) - 1
    weights = np.concatenate(
        [_ticks(costs, members, range(llm)), _ticks(costs, members, [llm]) // _LEVEL1_LLM_DIVISOR], axis=1
    )
    tokens = [costs[p].tokens for p in members]
    group, failed = _balance(
        weights,
        tokens,
        m,
        policy.max_tokens_per_microbatch,
        False,
        [keys[p] for p in members],
        policy.refine_rounds,
    )
    if failed >= 0:
        raise _no_fit(costs[members[failed]], policy)
    return [[members[x] for x in np.flatnonzero(group == g)] for g in range(m)]


@dataclass
class _Llm:
    """Level-2 state of one rank; items are the rank's samples in local numbering.

    ``work``/``tokens``: int64 (n,) LLM ticks and LLM tokens; ``enc``: encoder microbatch, -1 for a sample
    without encoder work (free: its encoder and LLM microbatch are the same and it may go anywhere);
    ``llm``: LLM microbatch, -1 while unplaced. Per microbatch: LLM ``load``, ``load_tokens``, ``counts``;
    per boundary ``k`` (between ``k`` and ``k + 1``): ``buffered`` samples with ``enc <= k < llm``.
    """

    work: np.ndarray
    tokens: np.ndarray
    enc: np.ndarray
    m: int
    cap: int | None
    max_deferred: int

    def __post_init__(self) -> None:
        self.llm = np.full(len(self.work), -1, dtype=np.int64)
        self.load = np.zeros(self.m, dtype=np.int64)
        self.load_tokens = np.zeros(self.m, dtype=np.int64)
        self.counts = np.zeros(self.m, dtype=np.int64)
        self.buffered = np.zeros(max(self.m - 1, 0), dtype=np.int64)

    def place(self, x: int, j: int, sign: int = 1) -> None:
        """Add (``sign=1``) or remove (``sign=-1``) item ``x``'s LLM work to/from microbatch ``j``."""
        self.load[j] += sign * self.work[x]
        self.load_tokens[j] += sign * self.tokens[x]
        self.counts[j] += sign
        if self.enc[x] >= 0:
            self.buffered[self.enc[x] : j] += sign
        self.llm[x] = j if sign > 0 else -1


def _place_free(state: _Llm, free: list[int], keys) -> int:
    """Level 2, first pass: samples without encoder work, largest LLM work first, onto the microbatch
    with the least LLM load (LPT) that fits the token cap. Returns -1, or the first item that fits nowhere."""
    for x in sorted(free, key=lambda x: (-int(state.work[x]), keys[x])):
        mask = np.ones(state.m, dtype=bool)
        if state.cap is not None:
            mask &= state.load_tokens + state.tokens[x] <= state.cap
        j = _pick(state.load, state.counts, mask)
        if j < 0:
            return x
        state.place(x, j)
    return -1


def _llm_feasible(state: _Llm, a: np.ndarray, b: np.ndarray, j1: int, j2: int):
    """Masks for moving items ``a`` (in j1) to j2 and ``b`` (in j2) to j1, j1 < j2, and for swapping them.

    An item with encoder work may move later only while every boundary it newly crosses buffers fewer than
    ``max_deferred`` samples, and earlier only down to its encoder microbatch; a swap of two such items
    leaves the buffers of [j1, j2) unchanged. Token caps are checked on the receiving microbatch(s).
    """
    room = state.max_deferred > 0 and bool((state.buffered[j1:j2] < state.max_deferred).all())
    a_free, b_free = state.enc[a] < 0, state.enc[b] < 0
    a_ok = a_free | room
    b_ok = b_free | (state.enc[b] <= j1)
    swap_ok = (a_ok[:, None] | ~b_free[None, :]) & b_ok[None, :]
    if state.cap is not None:
        ta, tb = state.tokens[a], state.tokens[b]
        a_ok = a_ok & (state.load_tokens[j2] + ta <= state.cap)
        b_ok = b_ok & (state.load_tokens[j1] + tb <= state.cap)
        swap_ok &= (state.load_tokens[j1] - ta[:, None] + tb[None, :] <= state.cap) & (
            state.load_tokens[j2] + ta[:, None] - tb[None, :] <= state.cap
        )
    return a_ok, b_ok, swap_ok


def _improve_llm_pair(state: _Llm, j1: int, j2: int) -> bool:
    """Apply the best improving LLM move or swap between microbatches j1 < j2 (1-D form of
    ``_improve_pair``: the sum of squared LLM loads must fall); True if one was applied."""
    a, b = np.flatnonzero(state.llm == j1), np.flatnonzero(state.llm == j2)
    if len(a) + len(b) == 0:
        return False
    wa, wb = state.work[a], state.work[b]
    diff = int(state.load[j1] - state.load[j2])
    a_ok, b_ok, swap_ok = _llm_feasible(state, a, b, j1, j2)
    d = wb[None, :] - wa[:, None]
    options = [
        (np.where(a_ok, wa * wa - wa * diff, 0), "a"),
        (np.where(b_ok, wb * wb + wb * diff, 0), "b"),
        (np.where(swap_ok, d * d + d * diff, 0).ravel(), "ab"),
    ]
    best, where, kind = 0, -1, ""
    for delta, name in options:
        if delta.size and int(delta.min()) < best:
            best, where, kind = int(delta.min()), int(np.argmin(delta)), name
    if best >= 0:
        return False
    x, y = (where, -1) if kind == "a" else (-1, where) if kind == "b" else divmod(where, len(b))
    for item, src, dst in ((x, a, j2), (y, b, j1)):
        if item >= 0:
            state.place(int(src[item]), int(state.llm[src[item]]), -1)
            state.place(int(src[item]), dst)
    return True


def _refine_llm(state: _Llm, rounds: int) -> None:
    """Level 2, second pass: pairwise local search on the LLM loads (moves and swaps of LLM work between
    microbatches within the deferral, buffer and token limits), like ``_refine_partition``; moving a
    sample with encoder work to a later microbatch is what defers it."""
    for _ in range(rounds):
        changed = False
        settled = _settled(state.load)
        for j1 in range(state.m):
            for j2 in range(j1 + 1, state.m):
                if not (settled[j1] and settled[j2]) and _improve_llm_pair(state, j1, j2):
                    changed = True
                    settled = _settled(state.load)
        if not changed:
            return


def _plan_rank(costs, members: list[int], policy: MicrobatchPolicy, keys) -> dict[int, tuple[int, int]]:
    """Levels 1 and 2 for one rank. Returns ``{position: (encoder_microbatch, llm_microbatch)}``."""
    m = policy.num_microbatches
    if not members:
        return {}
    bound = [p for p in members if costs[p].encoder_work > 0]
    groups = _level1(costs, bound, policy, keys)
    local = {p: x for x, p in enumerate(members)}
    work = _ticks(costs, members, [len(costs[members[0]].work) - 1])[:, 0]
    # Relabel: LLM-heavy microbatches first, so forward-only deferral can spread their excess.
    groups.sort(key=lambda g: -sum(int(work[local[p]]) for p in g))
    enc = np.full(len(members), -1, dtype=np.int64)
    for i, g in enumerate(groups):
        enc[[local[p] for p in g]] = i
    state = _Llm(
        work,
        np.array([costs[p].tokens for p in members], dtype=np.int64),
        enc,
        m,
        policy.max_tokens_per_microbatch,
        policy.max_deferred if policy.allow_deferral else 0,
    )
    for x in np.flatnonzero(enc >= 0):
        state.place(int(x), int(enc[x]))
    failed = _place_free(state, [x for x in range(len(members)) if enc[x] < 0], [keys[p] for p in members])
    if failed >= 0:
        raise _no_fit(costs[members[failed]], policy)
    _refine_llm(state, policy.refine_rounds)
    return {
        p: (int(state.llm[x]) if enc[x] < 0 else int(enc[x]), int(state.llm[x]))
        for x, p in enumerate(members)
    }


def _plan_hierarchical(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    """Entrain-style hierarchical assignment (reconstruction; module docstring): level 0 over ranks, then
    levels 1 and 2 inside each rank."""
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * len(costs)
    for r, members in enumerate(_level0(costs, policy, keys)):
        for p, (i, j) in _plan_rank(costs, members, policy, keys).items():
            assign[p] = (r, i, j)
    return assign


_PLANNERS = {
    "arrival": _plan_arrival,
    "random": _plan_random,
    "lpt": _plan_lpt,
    "hierarchical": _plan_hierarchical,
}


def _check_costs(costs: Sequence[SampleCost]) -> tuple[SampleCost, ...]:
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


def plan_microbatches(costs: Sequence[SampleCost], policy: MicrobatchPolicy, step: int) -> MicrobatchPlan:
    """Assign the samples of one global batch to DP ranks and microbatches.

    Args:
        costs: one ``SampleCost`` per sample, in arrival order (the order ``"arrival"`` keeps).
        policy: method, ``dp``, ``num_microbatches`` and options (``MicrobatchPolicy``).
        step: the training step (>= 0); with ``policy.seed`` it seeds shuffles and tie-breaking, so the
            same inputs give the same plan on every rank.

    Returns:
        A ``MicrobatchPlan`` in which every sample appears exactly once; microbatches may be empty (module
        docstring). Only ``"hierarchical"`` defers samples (``llm_microbatch`` > encoder microbatch).

    Raises:
        ValueError: on inconsistent costs (duplicate index, differing module counts), a negative step, or a
            sample that fits in no microbatch under ``max_tokens_per_microbatch``.
    """
    costs = _check_costs(costs)
    _check_int("plan_microbatches", "step", step, 0)
    keys = _tie_keys(len(costs), policy.seed, step)
    assign = _PLANNERS[policy.method](costs, policy, keys)
    mbs: list[list[list[tuple[int, int]]]] = [
        [[] for _ in range(policy.num_microbatches)] for _ in range(policy.dp)
    ]
    for cost, (r, i, j) in zip(costs, assign):
        mbs[r][i].append((cost.index, j))
    return MicrobatchPlan(
        method=policy.method,
        dp=policy.dp,
        num_microbatches=policy.num_microbatches,
        step=step,
        microbatches=tuple(tuple(tuple(x for x, _ in sorted(mb)) for mb in rank) for rank in mbs),
        llm_microbatch=tuple(tuple(tuple(j for _, j in sorted(mb)) for mb in rank) for rank in mbs),
    )


# ------------------------------------------------------------ metrics


@dataclass(frozen=True)
class WorkloadStats(JsonDataclass):
    """Work balance of a plan (Entrain's metric, ../shared/REFERENCES.md section 3).

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


def _spread(values: np.ndarray) -> tuple[float, float]:
    """(cv, max/mean) of ``values``; (0, 1) when they are all zero."""
    mean = float(values.mean()) if values.size else 0.0
    if mean <= 0:
        return 0.0, 1.0
    return float(values.std() / mean), float(values.max() / mean)


def _per_microbatch_work(plan: MicrobatchPlan, costs: Sequence[SampleCost]) -> np.ndarray:
    """Array (dp * M, modules) of the work each microbatch runs per module.

    Raises:
        ValueError: when the plan and ``costs`` do not hold the same sample indices.
    """
    by_index = {c.index: c for c in costs}
    if set(by_index) != set(plan.placements):
        missing = sorted(set(by_index) ^ set(plan.placements))[:5]
        raise ValueError(f"workload_stats: plan and costs differ in samples, e.g. {missing}")
    k = len(costs[0].work) if costs else 1
    work = np.zeros((plan.dp * plan.num_microbatches, k))
    for index, (r, i, j) in plan.placements.items():
        w = by_index[index].work
        work[r * plan.num_microbatches + i, :-1] += w[:-1]
        work[r * plan.num_microbatches + j, -1] += w[-1]
    return work


def workload_stats(
    plan: MicrobatchPlan, costs: Sequence[SampleCost], module_names: Sequence[str] | None = None
) -> WorkloadStats:
    """Per-module balance of ``plan`` under ``costs``: CV and max/mean over all microbatches of all ranks.

    Args:
        plan: a plan for exactly the samples of ``costs``.
        costs: the per-sample costs (any order).
        module_names: names in ``work`` order; default ``("module0", ..., "llm")``.

    Raises:
        ValueError: when plan and costs hold different samples, or names do not match the module count.
    """
    costs = _check_costs(costs)
    work = _per_microbatch_work(plan, costs)
    k = work.shape[1]
    names = (
        tuple(module_names)
        if module_names is not None
        else tuple(f"module{x}" for x in range(k - 1)) + ("llm",)
    )
    if len(names) != k:
        raise ValueError(f"workload_stats: {len(names)} module names for {k} modules")
    per_module = [_spread(work[:, x]) for x in range(k)]
    total_cv, total_mom = _spread(work.sum(axis=1))
    per_rank = work.reshape(plan.dp, plan.num_microbatches, k).sum(axis=1)
    buffered = [b for r in range(plan.dp) for b in plan.buffered(r)]
    return WorkloadStats(
        modules=names,
        cv=tuple(cv for cv, _ in per_module),
        max_over_mean=tuple(mom for _, mom in per_module),
        total_cv=total_cv,
        total_max_over_mean=total_mom,
        rank_max_over_mean=tuple(_spread(per_rank[:, x])[1] for x in range(k)),
        num_microbatches=plan.dp * plan.num_microbatches,
        num_deferred=len(plan.deferred()),
        max_buffered=max(buffered, default=0),
    )
