"""Distribute one microbatch's LLM tokens over the ranks of a context-parallel (CP) group.

Pure planner: plain data in (per-block attention work from
:func:`plait.attention.masks.block_work`), a frozen, JSON round-trippable :class:`TokenAssignment` out.

Tokens are grouped in blocks of ``block_size`` consecutive tokens (the last block may be shorter); a block
is the unit of assignment. The work of block ``b`` is ``alpha * attn_b + beta * tokens_b``: ``attn_b`` the
(query, key) pairs its queries attend (quadratic part: attention), ``tokens_b`` its token count (linear
part: projections, MLP, norms). Methods (Cornstarch):

- ``"uniform"``: ``cp`` contiguous chunks of (almost) equal block counts;
- ``"zigzag"``: ``2 * cp`` contiguous chunks, rank ``r`` takes chunks ``r`` and ``2cp - 1 - r`` (balanced for
  a single causal document, not for packed or bidirectional masks);
- ``"lpt"``: longest processing time first (Graham 1969, "Bounds on multiprocessing timing anomalies", SIAM
  J. Appl. Math. 17(2)): blocks by decreasing work, each onto the least-loaded rank that still has room
  under ``max_tokens_per_rank``; makespan within 4/3 - 1/(3 cp) of optimal without the cap. Unlike
  Cornstarch's LPT, the per-token (linear) cost is part of the work, so ranks do not end up with very
  unequal token counts;
- ``"ilp"``: exact makespan minimisation with HiGHS (``highspy``), warm-started from LPT and stopped at
  ``IlpLimits.time_s``; used only when ``num_blocks * cp <= IlpLimits.max_vars``, otherwise (or without highspy) the
  LPT result is returned and ``note`` says why.

Every method is deterministic (ties go to the lower block index and the lower rank), except ``"ilp"``
when its time limit binds: compute an ILP plan on one rank and broadcast it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from plait.planner.serialize import JsonDataclass

__all__ = ["TOKEN_METHODS", "IlpLimits", "TokenAssignment", "WorkWeights", "plan_tokens"]

TOKEN_METHODS = ("uniform", "zigzag", "lpt", "ilp")


@dataclass(frozen=True)
class TokenAssignment(JsonDataclass):
    """Which tokens of a microbatch row each CP rank holds, and the predicted work per rank.

    Attributes:
        num_tokens: tokens per row (N).
        block_size: tokens per block (the unit of assignment).
        method: the method that produced the assignment (``"lpt"`` when ``"ilp"`` fell back).
        ranges: per rank, sorted disjoint half-open token ranges ``((start, end), ...)``; together they
            cover ``[0, N)`` exactly once.
        work: predicted work per rank, ``alpha * attention pairs + beta * tokens`` (units of the inputs).
        note: why a requested method was replaced, or ``""``.

    Raises:
        ValueError: when the ranges do not partition ``[0, num_tokens)`` or ``work`` has the wrong length.
    """

    num_tokens: int
    block_size: int
    method: str
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    work: tuple[float, ...]
    note: str = ""

    def __post_init__(self) -> None:
        if len(self.work) != len(self.ranges):
            raise ValueError(f"TokenAssignment: {len(self.work)} work values for {len(self.ranges)} ranks")
        spans = sorted(span for rank in self.ranges for span in rank)
        edge = 0
        for start, end in spans:
            if start != edge or end <= start:
                raise ValueError(f"TokenAssignment: ranges {spans[:8]}... do not partition [0, {self.num_tokens})")
            edge = end
        if edge != self.num_tokens:
            raise ValueError(f"TokenAssignment: ranges cover [0, {edge}), expected [0, {self.num_tokens})")

    @property
    def cp(self) -> int:
        """CP degree (number of ranks)."""
        return len(self.ranges)

    @property
    def tokens_per_rank(self) -> tuple[int, ...]:
        """Tokens held by each rank."""
        return tuple(sum(end - start for start, end in rank) for rank in self.ranges)

    @property
    def max_work(self) -> float:
        """Predicted work of the most loaded rank (the makespan)."""
        return max(self.work)

    @property
    def mean_work(self) -> float:
        """Mean predicted work per rank."""
        return sum(self.work) / len(self.work)

    @property
    def imbalance(self) -> float:
        """``max_work / mean_work`` (1.0 = perfectly balanced)."""
        return self.max_work / self.mean_work if self.mean_work > 0 else 1.0

    def token_indices(self, rank: int) -> np.ndarray:
        """Sorted global token indices held by ``rank``, int64 ``[n_rank]``.

        Raises:
            ValueError: on a rank outside ``[0, cp)``.
        """
        if not 0 <= rank < self.cp:
            raise ValueError(f"TokenAssignment.token_indices: rank {rank} outside [0, {self.cp})")
        parts = [np.arange(start, end, dtype=np.int64) for start, end in self.ranges[rank]]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _validate(block_attn_work: np.ndarray, num_tokens: int, cp: int, method: str, alpha: float,
              beta: float, block_size: int, max_tokens_per_rank: int | None) -> int:
    """Check the inputs; return the number of blocks."""
    if method not in TOKEN_METHODS:
        raise ValueError(f"plan_tokens: method must be one of {TOKEN_METHODS}, got {method!r}")
    if cp < 1 or block_size < 1 or num_tokens < 1:
        raise ValueError(f"plan_tokens: need cp >= 1, block_size >= 1, num_tokens >= 1; "
                         f"got cp={cp}, block_size={block_size}, num_tokens={num_tokens}")
    num_blocks = math.ceil(num_tokens / block_size)
    if block_attn_work.shape != (num_blocks,):
        raise ValueError(f"plan_tokens: block_attn_work has shape {block_attn_work.shape}, expected "
                         f"({num_blocks},) = ceil(num_tokens={num_tokens} / block_size={block_size})")
    if not np.all(np.isfinite(block_attn_work)) or np.any(block_attn_work < 0):
        raise ValueError("plan_tokens: block_attn_work must be finite and >= 0")
    if alpha < 0 or beta < 0 or alpha + beta == 0:
        raise ValueError(f"plan_tokens: need alpha, beta >= 0, not both 0; got alpha={alpha}, beta={beta}")
    if num_blocks < cp:
        raise ValueError(f"plan_tokens: {num_blocks} blocks for cp={cp} ranks; every rank needs a block: "
                         f"use block_size <= {num_tokens // cp}")
    if max_tokens_per_rank is not None:
        need = math.ceil(num_blocks / cp) * block_size
        if max_tokens_per_rank // block_size * cp < num_blocks:
            raise ValueError(f"plan_tokens: max_tokens_per_rank={max_tokens_per_rank} too small for "
                             f"{num_blocks} blocks of {block_size} over cp={cp}; need >= {need}")
    return num_blocks


def _block_tokens(num_tokens: int, block_size: int, num_blocks: int) -> np.ndarray:
    tokens = np.full(num_blocks, block_size, dtype=np.int64)
    tokens[-1] = num_tokens - (num_blocks - 1) * block_size
    return tokens


def _contiguous_owner(num_blocks: int, chunks: int) -> np.ndarray:
    """Chunk index of each block when splitting blocks into ``chunks`` near-equal contiguous chunks."""
    sizes = [len(part) for part in np.array_split(np.arange(num_blocks), chunks)]
    return np.repeat(np.arange(chunks), sizes)


def _uniform(num_blocks: int, cp: int) -> np.ndarray:
    return _contiguous_owner(num_blocks, cp)


def _zigzag(num_blocks: int, cp: int) -> np.ndarray:
    chunk = _contiguous_owner(num_blocks, 2 * cp)
    return np.where(chunk < cp, chunk, 2 * cp - 1 - chunk)


def _lpt(work: np.ndarray, tokens: np.ndarray, cp: int, cap: int | None) -> np.ndarray:
    """Graham's LPT with a per-rank token cap; returns the rank of each block."""
    order = np.lexsort((np.arange(work.size), -work))
    owner = np.empty(work.size, dtype=np.int64)
    heap = [(0.0, rank) for rank in range(cp)]
    held = [0] * cp
    for block in order.tolist():
        size, full = int(tokens[block]), []
        while True:
            load, rank = heapq.heappop(heap)
            if cap is None or held[rank] + size <= cap:
                break
            full.append((load, rank))
        owner[block] = rank
        held[rank] += size
        heapq.heappush(heap, (load + float(work[block]), rank))
        for item in full:
            heapq.heappush(heap, item)
    return owner


def _ilp(work: np.ndarray, tokens: np.ndarray, cp: int, cap: int | None, start: np.ndarray,
         time_limit_s: float) -> np.ndarray | None:
    """Min-makespan assignment by MILP (HiGHS), warm-started from ``start``; None when no solution."""
    import highspy

    nb = work.size
    nx = nb * cp  # x[b, r] at column b * cp + r, then the makespan T
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-4)
    lower = np.zeros(nx + 1)
    lower[int(np.argmax(work)) * cp] = 1.0  # symmetry: the heaviest block goes to rank 0
    upper = np.r_[np.ones(nx), highspy.kHighsInf]
    h.addVars(nx + 1, lower, upper)
    h.changeColsCost(1, np.array([nx], dtype=np.int32), np.array([1.0]))
    h.changeColsIntegrality(nx, np.arange(nx, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * nx))
    cols = np.arange(nx, dtype=np.int32).reshape(nb, cp)
    rows = [(cols[b], np.ones(cp), 1.0, 1.0) for b in range(nb)]
    for r in range(cp):
        rows.append((np.r_[cols[:, r], nx].astype(np.int32), np.r_[work, -1.0], -highspy.kHighsInf, 0.0))
        rows.append((cols[:, r], np.ones(nb), 1.0, highspy.kHighsInf))
        if cap is not None:
            rows.append((cols[:, r], tokens.astype(float), -highspy.kHighsInf, float(cap)))
    _add_rows(h, rows)
    solution = highspy.HighsSolution()
    x0 = np.zeros(nx + 1)
    x0[np.arange(nb) * cp + start] = 1.0
    x0[nx] = np.bincount(start, weights=work, minlength=cp).max()
    solution.col_value = x0.tolist()
    h.setSolution(solution)
    h.run()
    values = np.asarray(h.getSolution().col_value)
    if values.size != nx + 1:
        return None
    return values[:nx].reshape(nb, cp).argmax(axis=1)


def _add_rows(h: Any, rows: list[tuple[np.ndarray, np.ndarray, float, float]]) -> None:
    starts = np.cumsum([0] + [len(idx) for idx, *_ in rows[:-1]]).astype(np.int32)
    index = np.concatenate([idx for idx, *_ in rows]).astype(np.int32)
    value = np.concatenate([val for _, val, *_ in rows]).astype(float)
    lower = np.array([lo for *_, lo, _ in rows], dtype=float)
    upper = np.array([up for *_, up in rows], dtype=float)
    h.addRows(len(rows), lower, upper, index.size, starts, index, value)


def _ranges(owner: np.ndarray, num_tokens: int, block_size: int, cp: int) -> tuple:
    """Per rank, merged token ranges of its blocks (blocks in increasing order)."""
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for block, rank in enumerate(owner.tolist()):
        start, end = block * block_size, min((block + 1) * block_size, num_tokens)
        spans = per_rank[rank]
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return tuple(tuple(spans) for spans in per_rank)


@dataclass(frozen=True)
class WorkWeights(JsonDataclass):
    """Weights of a block's work: ``alpha`` per attention pair, ``beta`` per token (same work unit, e.g. FLOPs)."""

    alpha: float = 1.0
    beta: float = 0.0


@dataclass(frozen=True)
class IlpLimits(JsonDataclass):
    """Limits of the ILP refinement (``plan_tokens(method="ilp")``): wall-clock seconds of a solve (``time_s``)
    and the largest ``num_blocks * cp`` it is tried on (``max_vars``)."""

    time_s: float = 1.0
    max_vars: int = 4096


def plan_tokens(block_attn_work: Sequence[float] | np.ndarray, num_tokens: int, cp: int,
                method: str = "lpt", weights: WorkWeights = WorkWeights(), block_size: int = 128,
                max_tokens_per_rank: int | None = None, ilp: IlpLimits = IlpLimits()) -> TokenAssignment:
    """Assign the blocks of one row (or of rows sharing an assignment) to ``cp`` ranks.

    Args:
        block_attn_work: attention pairs per block, ``[ceil(num_tokens / block_size)]``
            (:func:`plait.attention.masks.block_work` with the same ``block_size``; summed over rows when
            the rows of a microbatch share one assignment).
        num_tokens: tokens per row (N); need not be a multiple of ``block_size`` or ``cp``.
        cp: CP degree.
        method: ``"uniform"``, ``"zigzag"``, ``"lpt"`` or ``"ilp"`` (module docstring).
        weights: ``alpha``, the weight of an attention pair, and ``beta``, of a token (:class:`WorkWeights`).
        block_size: tokens per block.
        max_tokens_per_rank: cap on tokens per rank (activation memory), honoured by ``"lpt"``/``"ilp"``
            and checked for all methods; must allow ``ceil(num_blocks / cp)`` full blocks per rank.
        ilp: the ILP solve's time limit and largest ``num_blocks * cp`` it is tried on (:class:`IlpLimits`).

    Returns:
        A :class:`TokenAssignment` with ranges, predicted work per rank and the method used.

    Raises:
        ValueError: on an unknown method, non-positive sizes, a work array of the wrong length or with
            negative values, fewer blocks than ranks, ``alpha = beta = 0``, or a cap too small.
    """
    alpha, beta = weights.alpha, weights.beta
    attn = np.asarray(block_attn_work, dtype=np.float64)
    num_blocks = _validate(attn, num_tokens, cp, method, alpha, beta, block_size, max_tokens_per_rank)
    tokens = _block_tokens(num_tokens, block_size, num_blocks)
    work = alpha * attn + beta * tokens
    used, note = method, ""
    if method == "uniform":
        owner = _uniform(num_blocks, cp)
    elif method == "zigzag":
        owner = _zigzag(num_blocks, cp)
    else:
        owner = _lpt(work, tokens, cp, max_tokens_per_rank)
        if method == "ilp":
            owner, used, note = _refine_ilp(owner, work, tokens, cp, max_tokens_per_rank, ilp.time_s, ilp.max_vars)
    per_rank = np.bincount(owner, weights=work, minlength=cp)
    return TokenAssignment(num_tokens=num_tokens, block_size=block_size, method=used,
                           ranges=_ranges(owner, num_tokens, block_size, cp),
                           work=tuple(float(w) for w in per_rank), note=note)


def _refine_ilp(owner: np.ndarray, work: np.ndarray, tokens: np.ndarray, cp: int, cap: int | None,
                time_limit_s: float, ilp_max_vars: int) -> tuple[np.ndarray, str, str]:
    """Try the ILP from the LPT start; keep whichever makespan is lower (ties keep LPT)."""
    size = work.size * cp
    if size > ilp_max_vars:
        return owner, "lpt", f"ilp skipped: {size} binaries > ilp_max_vars={ilp_max_vars}; used lpt"
    try:
        refined = _ilp(work, tokens, cp, cap, owner, time_limit_s)
    except ImportError:
        return owner, "lpt", "ilp skipped: highspy not installed; used lpt"
    if refined is None:
        return owner, "lpt", "ilp found no solution; used lpt"
    loads = np.bincount(refined, weights=work, minlength=cp)
    held = np.bincount(refined, weights=tokens, minlength=cp)
    feasible = np.bincount(refined, minlength=cp).min() >= 1 and (cap is None or held.max() <= cap)
    if feasible and loads.max() < np.bincount(owner, weights=work, minlength=cp).max() * (1 - 1e-12):
        return refined, "ilp", ""
    return owner, "ilp", "ilp kept the lpt assignment (no better solution within the limit)"
