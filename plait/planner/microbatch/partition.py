"""Vector partition: items with a work vector (one entry per module) split into groups whose every module
is balanced (the engine of levels 0 and 1 of ``hierarchical``), plus the helpers the planners share.

Greedy placement largest first onto the group where the item raises the squared normalised load least (a
vector form of LPT), then pairwise moves and swaps between groups while the sum of squared loads drops.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.planner.microbatch.types import MicrobatchPolicy, SampleCost

__all__ = [
    "balance",
    "chunks",
    "count_ok",
    "no_fit",
    "pick",
    "settled_mask",
    "ticks",
    "tie_keys",
]


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
# Exchange partners per group and pass of the refinement (bounds its cost at many DP ranks).
_PARTNERS = 8


def tie_keys(n: int, seed: int, step: int) -> list[int]:
    """A permutation of ``range(n)`` drawn from ``(seed, step)``: ``keys[p]`` breaks ties of sample ``p``."""
    digest = hashlib.sha256(f"plait.microbatch:{seed}:{step}".encode()).digest()
    perm = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(perm)
    keys = [0] * n
    for rank, position in enumerate(perm):
        keys[position] = rank
    return keys


def chunks(items: Sequence[int], parts: int) -> list[Sequence[int]]:
    """``parts`` consecutive chunks whose sizes differ by at most one (the larger ones first)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for j in range(parts):
        size = q + (j < r)
        out.append(items[start : start + size])
        start += size
    return out


def count_ok(counts: np.ndarray, n: int) -> np.ndarray:
    """Groups that may take one more item when ``n`` items must end ``floor`` or ``ceil(n / groups)`` each."""
    floor, extra = divmod(n, len(counts))
    at_ceil = int(np.count_nonzero(counts > floor))
    return (counts < floor) | ((counts == floor) & (at_ceil < extra))


def pick(score: np.ndarray, counts: np.ndarray, mask: np.ndarray) -> int:
    """The allowed group with the least score, then the fewest items, then the lowest index; -1 if none."""
    candidates = np.flatnonzero(mask)
    if candidates.size == 0:
        return -1
    s = score[candidates]
    best = candidates[s == s.min()]
    return int(best[np.argmin(counts[best])])


def no_fit(cost: SampleCost, policy: MicrobatchPolicy) -> ValueError:
    """The error for a sample whose tokens exceed ``max_tokens_per_microbatch`` wherever it goes."""
    return ValueError(
        f"sample {cost.index} (tokens={cost.tokens}) fits in no microbatch under "
        f"max_tokens_per_microbatch={policy.max_tokens_per_microbatch} (method {policy.method!r}); "
        f"raise the cap or num_microbatches"
    )


def ticks(costs: Sequence[SampleCost], positions: Sequence[int], modules: Sequence[int]) -> np.ndarray:
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
            mask &= count_ok(state.counts, n)
        if state.cap is not None:
            mask &= state.load_tokens + state.tokens[item] <= state.cap
        g = pick(state.loads @ w[item], state.counts, mask)
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


def settled_mask(loads: np.ndarray) -> np.ndarray:
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
    settled = settled_mask(loads)
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


def balance(weights, tokens, groups, cap, equal_counts, keys, rounds) -> tuple[np.ndarray, int]:
    """Greedy vector LPT then refinement. Returns (group per item, -1 or the first item that did not fit)."""
    state = _Groups(weights, np.asarray(tokens, dtype=np.int64), groups, cap, equal_counts)
    failed = _greedy_partition(state, keys)
    if failed >= 0:
        return state.group, failed
    if groups > 1:
        _refine_partition(state, rounds)
    return state.group, -1
