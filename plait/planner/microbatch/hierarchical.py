"""Source: Entrain, "variable heterogeneity in multimodal training" (arXiv 2605.27918). The source text of the
algorithm was not available: the
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from plait.planner.microbatch.partition import balance, no_fit, pick, settled_mask, ticks
from plait.planner.microbatch.types import MicrobatchPolicy, SampleCost

__all__ = [
    "plan_hierarchical",
]


# Level 1 also balances the LLM work of the samples with encoder work, at a quarter of an encoder's weight.
# Measured on a synthetic mixture (global batch 256, M 16): encoder-only level 1 leaves an LLM CV of 2.4%
# with deferral and no text-only samples (8% without deferral), a quarter weight 0.2% (0.6%), while the
# encoder CVs stay below 0.5%; deferral and text-only filling (level 2) then remove the rest.
_LEVEL1_LLM_DIVISOR = 4


def _level0(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]) -> list[list[int]]:
    """Level 0: split the global batch over DP ranks balancing the vector of all module totals.
    Returns the sample positions of each rank."""
    n = len(costs)
    if policy.dp == 1 or n == 0:
        return [list(range(n))] + [[] for _ in range(policy.dp - 1)]
    weights = ticks(costs, range(n), range(len(costs[0].work)))
    group, _ = balance(
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
        [ticks(costs, members, range(llm)), ticks(costs, members, [llm]) // _LEVEL1_LLM_DIVISOR], axis=1
    )
    tokens = [costs[p].tokens for p in members]
    group, failed = balance(
        weights,
        tokens,
        m,
        policy.max_tokens_per_microbatch,
        False,
        [keys[p] for p in members],
        policy.refine_rounds,
    )
    if failed >= 0:
        raise no_fit(costs[members[failed]], policy)
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
        j = pick(state.load, state.counts, mask)
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
        settled = settled_mask(state.load)
        for j1 in range(state.m):
            for j2 in range(j1 + 1, state.m):
                if not (settled[j1] and settled[j2]) and _improve_llm_pair(state, j1, j2):
                    changed = True
                    settled = settled_mask(state.load)
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
    work = ticks(costs, members, [len(costs[members[0]].work) - 1])[:, 0]
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
        raise no_fit(costs[members[failed]], policy)
    _refine_llm(state, policy.refine_rounds)
    return {
        p: (int(state.llm[x]) if enc[x] < 0 else int(enc[x]), int(state.llm[x]))
        for x, p in enumerate(members)
    }


def plan_hierarchical(costs: Sequence[SampleCost], policy: MicrobatchPolicy, keys: list[int]):
    """Entrain-style hierarchical assignment (reconstruction; module docstring): level 0 over ranks, then
    levels 1 and 2 inside each rank."""
    assign: list[tuple[int, int, int]] = [(0, 0, 0)] * len(costs)
    for r, members in enumerate(_level0(costs, policy, keys)):
        for p, (i, j) in _plan_rank(costs, members, policy, keys).items():
            assign[p] = (r, i, j)
    return assign
