"""Lower bounds of the layout search's candidates, and the candidates themselves as sorted streams.

Per (layout, DP degree ``d``, LLM chunks per rank ``v``) a ``Stream`` holds every candidate (stage count
per module) with its first lower bound ``LB1``, sorted; the branch and bound (``search_candidates``) takes
candidates in increasing bound. ``LB1`` (``layout_stream``) is computed vectorised (numpy over the grid of
stage counts), the largest of: ``M_r`` (microbatches per replica) times the least possible encoder
bottleneck; the LLM partition's per-stage bounds (below) after the encoder paths (forwards and transfers
in, backwards and transfers out); each encoder chain's last-microbatch exit (its path plus ``M_r - 1``
times its least possible largest stage forward) followed by one microbatch's whole LLM path; plus the
least possible gradient all-reduce (the LLM partition's largest stage gradient, and per encoder the
min-max partition of its gradient bytes).

Per-stage bound (``stage_bounds``, also the second bound ``LB2`` of a concrete candidate; valid for the
1F1B order of ``schedules.one_f_one_b`` with one stage per rank): stage ``k`` cannot start before
microbatch 0 has crossed its upstream path (``A_k``, forwards and transfers); it is then busy
``M_r (F_k + B_k)``; its first backward waits for ``min(w + 1, M_r)`` forwards (``w`` the warm-up
``min(depth - 1, M_r)``) and for the round trip through the downstream stages; after its last backward,
the upstream stages still run theirs (``Z_k``). For a balanced chain this is exactly the 1F1B makespan
``(M_r + S - 1)(F + B)``.

Interleaved candidates (``v > 1``: the LLM cut into ``v p`` chunks cyclic over ``p`` ranks) get a bound
valid for ``schedules_interleaved.interleaved_1f1b`` (``_interleaved_llm_terms``: per LLM rank, arrival + busy time +
upstream backwards; memory floors from the warm-up); candidates with every encoder one stage on the first
LLM rank (``attached_stream``) one valid for any schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plait.planner.pipeline.interleaved import interleaved_chunk_order, interleaved_warmups
from plait.planner.search.model import (
    CandidateStages,
    ChunkSums,
    Partitions,
    Ranges,
    fill_stages,
    grad_sync_terms,
    in_flight,
)
from plait.planner.pipeline.types import P2PModel
from plait.planner.types import LLM_MODULE

__all__ = ["Stream", "attached_stream", "in_bubble_stream", "layout_stream", "stage_bounds"]


def stage_bounds(st: CandidateStages, nb: int) -> list[float]:
    """Per stage, a lower bound on the 1F1B makespan (module docstring), stages in topological order."""
    n = len(st.forward)
    f, b, rb, send = st.forward, st.backward, st.runs_backward, st.send
    start = [0.0] * n
    for s in range(n):
        if st.succ[s] >= 0:
            t = st.succ[s]
            start[t] = max(start[t], start[s] + f[s] + send[s])
    tail = [0.0] * n  # after stage s's last backward: upstream backwards
    for s in range(n):
        for p in st.preds[s]:
            if rb[p]:
                tail[s] = max(tail[s], send[p] + b[p] + tail[p])
    trip = [0.0] * n  # end of F(s, i) to earliest start of B(s, i)
    after_f = [0.0] * n  # end of F(s, Nb-1) to the end of the iteration, for forward-only stages
    for s in range(n - 1, -1, -1):
        t = st.succ[s]
        if t < 0:
            continue
        trip[s] = send[s] + f[t] + trip[t] + b[t] + send[s]
        after_f[s] = send[s] + f[t] + (trip[t] + b[t] + tail[t] if rb[t] else after_f[t])
    bounds = []
    for s in range(n):
        if not rb[s]:
            bounds.append(start[s] + nb * f[s] + after_f[s])
            continue
        before = min(min(st.depth[s] - 1, nb) + 1, nb)
        first_b = max(before * f[s], f[s] + trip[s])
        bounds.append(start[s] + first_b + nb * b[s] + (nb - before) * f[s] + tail[s])
    return bounds



# --------------------------------------------------------------------------------------------------
# Vectorised lower bounds per (layout, DP degree)


@dataclass
class Stream:
    """Candidates of one (layout, dp, v) sorted by their first lower bound; the branch and bound advances
    ``position`` as it takes them.

    Attributes:
        layout: the candidates' layout; dp: their DP degree; nb: microbatches per replica.
        bounds: per candidate, its lower bound (seconds), increasing.
        counts: ``(candidates, axes)`` stage counts: one axis per encoder (``encoder_parallel``) or one shared
            by the colocated encoders, then the LLM (its rank count when ``v > 1`` or ``attached``).
        position: the next candidate to take.
        v: LLM chunks per LLM rank (interleaved 1F1B when > 1).
        attached: every encoder is one stage on LLM rank 0.
        in_bubble: every encoder is one stage on the last LLM rank (its work in that rank's bubbles).
    """

    layout: str
    dp: int
    nb: int
    bounds: np.ndarray
    counts: np.ndarray
    position: int = 0
    v: int = 1
    attached: bool = False
    in_bubble: bool = False


def _chain_bounds(parts: Partitions, ranges: Ranges, nb: int, p2p: P2PModel) -> tuple[float, ...]:
    """LLM chain alone: (max bound over stages that run backward, over forward-only stages, one microbatch's
    path: every forward, then every backward, with the transfers between stages; the largest stage's
    gradient bytes)."""
    depth = [len(ranges) - j for j in range(len(ranges))]
    succ = [j + 1 if j < len(ranges) - 1 else -1 for j in range(len(ranges))]
    st = fill_stages(Partitions(parts.model, None), [[r] for r in ranges], depth, succ, nb, p2p)
    bounds = stage_bounds(st, nb)
    back = [x for x, rb in zip(bounds, st.runs_backward) if rb]
    fwd = [x for x, rb in zip(bounds, st.runs_backward) if not rb]
    path = sum(st.forward) + sum(st.backward) + sum(st.send[:-1])
    path += sum(t for t, rb in zip(st.send[:-1], st.runs_backward[:-1]) if rb)
    return max(back, default=-math.inf), max(fwd, default=-math.inf), path, max(st.grad)


def _llm_terms(parts: Partitions, nb: int, max_stages: int, p2p: P2PModel) -> tuple[np.ndarray, ...]:
    """Per LLM stage count 1..max_stages, ``_chain_bounds`` of its partition (inf when none fits memory);
    memoised per microbatch count."""
    cached = parts.llm_terms.get(nb)
    if cached is not None and len(cached[0]) >= max_stages:
        return tuple(c[:max_stages] for c in cached)
    terms = np.full((4, max_stages), math.inf)
    for s in range(1, max_stages + 1):
        ranges = parts.fitted(LLM_MODULE, s, in_flight(s, 0, nb))
        if ranges is not None:
            terms[:, s - 1] = _chain_bounds(parts, ranges, nb, p2p)
    parts.llm_terms[nb] = tuple(terms)
    return tuple(terms)


def _encoder_terms(parts: Partitions, modules: Sequence[str], max_stages: int, nb: int,
                   p2p: P2PModel) -> dict[str, Any]:
    """Lower-bound terms of a chain of encoder stages (one encoder, or colocated ``modules``) per stage
    count 1..max_stages: ``neck`` ``nb`` x the plain bottleneck (no partition has a smaller one);
    ``path`` the forward path into the LLM (forwards, per internal boundary the transfer of the smallest
    output that can end a stage, the projector outputs' transfer); ``through`` the last microbatch's exit,
    ``path + (nb - 1)`` x the least possible largest stage forward; ``backward`` the backward path from the
    LLM (0 if the chain runs none)."""
    model = parts.model
    stages = np.arange(1, max_stages + 1)
    spans = [model.span[m] for m in modules]
    necks = [[max(model.total("W", x, y) for x, y in parts.plain(m, s)) for s in stages] for m in modules]
    into_llm = p2p.transfer_s(sum(model.output[b - 1] for _, b in spans))
    forward = sum(model.total("F", a, b) for a, b in spans)
    inner = p2p.transfer_s(sum(min(model.output[a:b - 1], default=0.0) for a, b in spans))
    path = forward + (stages - 1) * inner + into_llm
    largest = max(max(model.forward[a:b]) for a, b in spans)
    through = path + (nb - 1) * np.maximum(forward / stages, largest)
    runs = any(any(model.runs_backward[a:b]) for a, b in spans)
    every = all(model.runs_backward[a] for a, _ in spans)  # every stage runs a backward: inner transfers too
    backward = sum(model.total("B", a, b) for a, b in spans) + into_llm if runs else 0.0
    backward = backward + (stages - 1) * inner if every else backward
    return {"neck": nb * np.max(necks, axis=0), "path": path, "through": through, "backward": backward}


def layout_stream(parts: Partitions, layout: str, dp: int, devices: int, microbatches: int, p2p: P2PModel,
            link: P2PModel | None, v: int = 1) -> Stream | None:
    """All candidates of (layout, dp, v) with their vectorised lower bound ``LB1``, sorted. With ``v > 1``
    the LLM entry of a candidate is its LLM rank count ``p`` (``v p`` LLM stages, interleaved 1F1B)."""
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    k = len(model.encoders)
    enc_ranks = k if layout == "encoder_parallel" else min(k, 1)
    max_llm = min(model.size(LLM_MODULE) // v, pipe - enc_ranks)
    if pipe < enc_ranks + 1 or max_llm < (2 if v > 1 else 1):
        return None
    llm = _llm_terms(parts, nb, max_llm, p2p) if v == 1 else _interleaved_llm_terms(parts, nb, max_llm, v, p2p)
    if not k:
        grids, lb = [np.arange(1, max_llm + 1)], np.maximum(llm[0], llm[1])
    else:
        grids, lb = _encoder_bounds(parts, layout, nb, pipe, max_llm, llm, p2p)
    lb = lb + _sync_bounds(parts, layout, grids, dp, link, llm[3])
    counts = np.stack([g.ravel() for g in np.broadcast_arrays(*grids)], axis=1)
    lb = np.broadcast_to(lb, np.broadcast_shapes(*(g.shape for g in grids))).ravel()
    keep = (counts.sum(axis=1) <= pipe) & np.isfinite(lb)
    counts, lb = counts[keep], lb[keep]
    order = np.lexsort((counts.sum(axis=1), lb))
    return Stream(layout, dp, nb, lb[order], counts[order], v=v)


def _interleaved_llm_terms(parts: Partitions, nb: int, max_ranks: int, v: int,
                           p2p: P2PModel) -> tuple[np.ndarray, ...]:
    """``_llm_terms`` for an LLM of ``v p`` stages cyclically on ``p = 1..max_ranks`` ranks (inf for
    ``p = 1`` and where even one microbatch per rank exceeds the memory cap). Per LLM rank ``i`` the bound
    is valid for any schedule whose last action on the rank is the backward of its first chunk (the
    ``interleaved_1f1b`` order): microbatch 0 reaches the rank (forwards and transfers of the LLM stages
    before it), the rank is busy ``nb`` x its chunks' work, then the upstream LLM stages' backwards follow."""
    terms = np.full((4, max_ranks), math.inf)
    for p in range(2, max_ranks + 1):
        sums = [parts.chunk(a, b) for a, b in parts.cyclic(p, v)]
        f, b, rb = [c.forward for c in sums], [c.backward for c in sums], [c.runs_backward for c in sums]
        send = [p2p.transfer_s(c.output) for c in sums]
        if parts.cap is not None and max(_interleaved_memory_floor(sums, p, v, nb)) > parts.cap:
            continue
        first_b = _first_backward_starts(f, b, rb, send, p, v, nb)
        back, fwd, arrive, tail = [], [], 0.0, 0.0
        for i in range(p):
            work = nb * sum(f[j] + b[j] for j in range(i, v * p, p))
            busy = arrive + work
            if first_b[i] is not None:  # the order's warm-up: rank i's first B waits for a round trip
                warm, start_b = first_b[i]
                busy = max(busy, max(start_b, arrive + warm) + work - warm)
            (back if rb[i] else fwd).append(busy + tail)
            arrive += f[i] + send[i]
            tail += send[i] + b[i] if rb[i] else 0.0
        path = sum(f) + sum(b) + sum(send[:-1]) + sum(t for t, r in zip(send[:-1], rb[:-1]) if r)
        grad = max(sum(c.grad for c in sums[i::p]) for i in range(p))
        terms[:, p - 1] = (max(back, default=-math.inf), max(fwd, default=-math.inf), path, grad)
    return tuple(terms)


def _sync_bounds(parts: Partitions, layout: str, grids: list[np.ndarray], dp: int, link: P2PModel | None,
                 llm_grad: np.ndarray) -> np.ndarray | float:
    """Lower bound of the gradient all-reduce per candidate: the LLM partition's largest stage gradient
    (``llm_grad`` per LLM stage count) and, per encoder, the least largest stage gradient of any partition
    into the candidate's stage count (``Partitions.grad_floor``)."""
    if link is None or dp == 1:
        return 0.0
    model = parts.model
    chains = [[m] for m in model.encoders] if layout == "encoder_parallel" else [list(model.encoders)]
    chains = [c for c in chains if c]
    most: np.ndarray | float = llm_grad.reshape([1] * len(chains) + [-1])
    for grid, modules in zip(grids, chains):
        floors = [[parts.grad_floor(m, int(g)) for g in grid.ravel()] for m in modules]
        most = np.maximum(most, np.max(floors, axis=0).reshape(grid.shape))
    if model.dp_shard > 1:  # FSDP2: reduce-scatter then all-reduce of the shards (search_model.grad_sync_terms)
        latency, per_byte = grad_sync_terms(dp, model.dp_shard, link)
        return latency + per_byte * most
    return 2 * (dp - 1) * link.latency_s + 2.0 * (dp - 1) / dp * most / (link.bandwidth_Bps or math.inf)


def _encoder_bounds(parts: Partitions, layout: str, nb: int, pipe: int, max_llm: int,
                    llm: tuple[np.ndarray, ...], p2p: P2PModel) -> tuple[list[np.ndarray], np.ndarray]:
    """Grids (one axis per encoder chain: each encoder for ``encoder_parallel``, one shared count for
    ``encoders_colocated``; then the LLM) and LB1: the largest of the encoder bottlenecks, the LLM chain
    bound after the encoder paths, and each encoder chain's ``through`` plus the LLM path."""
    model = parts.model
    chains = [[m] for m in model.encoders] if layout == "encoder_parallel" else [list(model.encoders)]
    axes = len(chains) + 1
    grids, neck, path, through, backward = [], 0.0, 0.0, 0.0, np.zeros(1)
    for axis, modules in enumerate(chains):
        top = min(min(model.max_stages(m) for m in modules), pipe - len(chains))
        terms = _encoder_terms(parts, modules, top, nb, p2p)
        shape = [1] * axes
        shape[axis] = top
        grids.append(np.arange(1, top + 1).reshape(shape))
        neck = np.maximum(neck, terms["neck"].reshape(shape))
        path = np.maximum(path, terms["path"].reshape(shape))
        through = np.maximum(through, terms["through"].reshape(shape))
        backward = np.maximum(backward, np.broadcast_to(terms["backward"], (top,)).reshape(shape))
    shape = [1] * (axes - 1) + [max_llm]
    grids.append(np.arange(1, max_llm + 1).reshape(shape))
    back, fwd, llm_path = (t.reshape(shape) for t in llm[:3])
    chain = path + np.maximum(back + backward, fwd)
    return grids, np.maximum(np.maximum(neck, chain), through + llm_path + backward)



# --------------------------------------------------------------------------------------------------
# Candidates with several LLM chunks per rank, or the encoders on the first LLM rank


def attached_stream(parts: Partitions, dp: int, devices: int, microbatches: int, p2p: P2PModel,
                     v: int) -> Stream | None:
    """Candidates with the encoders one stage on LLM rank 0 (layout ``encoders_colocated``: one action per
    microbatch and direction for all of them, not one per encoder) and the LLM on ``p = 2..`` ranks (``v``
    chunks each), sorted by a lower bound valid for any schedule: per LLM rank, microbatch 0's arrival (the
    encoders' forwards run on rank 0 first), ``nb`` x its work (rank 0: with the encoders'), then the
    upstream LLM backwards; and one microbatch's whole path; plus nothing for the all-reduce."""
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    top = min(model.size(LLM_MODULE) // v, pipe)
    enc_f, enc_w, enc_static = _encoder_sums(model)
    bounds, rows = [], []
    for p in range(2, top + 1):
        ranges = parts.cyclic(p, v) if v > 1 else parts.fitted(LLM_MODULE, p, in_flight(p, 0, nb))
        if ranges is None:
            continue
        sums = [parts.chunk(a, b) for a, b in ranges]
        floor = _interleaved_memory_floor(sums, p, v, nb) if v > 1 else [c.static + c.activation for c in sums]
        if parts.cap is not None and (floor[0] + enc_static > parts.cap or max(floor) > parts.cap):
            continue
        arrive, tail, worst = enc_f, 0.0, 0.0
        for i in range(p):
            work = sum(c.forward + c.backward for c in sums[i::p]) + (enc_w if i == 0 else 0.0)
            worst = max(worst, (0.0 if i == 0 else arrive) + nb * work + tail)
            arrive += sums[i].forward + p2p.transfer_s(sums[i].output)
            tail += p2p.transfer_s(sums[i].output) + sums[i].backward if sums[i].runs_backward else 0.0
        bounds.append(max(worst, sum(model.work)))
        rows.append([1, p])
    if not rows:
        return None
    order = np.argsort(np.asarray(bounds), kind="stable")
    return Stream("encoders_colocated", dp, nb, np.asarray(bounds)[order], np.asarray(rows)[order], v=v,
                   attached=True)


def _encoder_sums(model: Any) -> tuple[float, float, float]:
    """Every encoder's forward seconds, work seconds (forward + backward) and static + activation bytes, summed: one
    stage holding them all (attached or in the bubbles)."""
    spans = [model.span[m] for m in model.encoders]
    return (sum(model.total("F", a, b) for a, b in spans), sum(model.total("W", a, b) for a, b in spans),
            sum(model.total("S", a, b) + model.total("A", a, b) for a, b in spans))


def in_bubble_stream(parts: Partitions, dp: int, devices: int, microbatches: int, p2p: P2PModel) -> Stream | None:
    """Candidates with the encoders one stage on the last LLM rank (layout ``encoders_colocated``; placement
    ``plan.stage_ranks(1, p, in_bubble=True)``: the encoders' work in that rank's warm-up and drain bubbles, after
    Optimus, ATC'25) and the LLM on ``p = 2..`` ranks of one stage each, sorted by a lower bound valid for any
    schedule: per LLM rank, microbatch 0's arrival (the encoders' forward first) plus ``nb`` x its LLM work plus the
    upstream LLM backwards; the last rank also at least ``nb`` x (its LLM work + the encoders' work) busy; and one
    microbatch's whole path. The last rank's memory holds the encoders' static bytes."""
    model = parts.model
    nb, pipe = -(-microbatches // dp), devices // dp
    top = min(model.size(LLM_MODULE), pipe)
    enc_f, enc_w, enc_static = _encoder_sums(model)
    bounds, rows = [], []
    for p in range(2, top + 1):
        ranges = parts.fitted(LLM_MODULE, p, in_flight(p, 0, nb))
        if ranges is None:
            continue
        sums = [parts.chunk(a, b) for a, b in ranges]
        floor = [c.static + c.activation for c in sums]
        if parts.cap is not None and (floor[-1] + enc_static > parts.cap or max(floor) > parts.cap):
            continue
        arrive, tail, worst = enc_f, 0.0, 0.0
        for i in range(p):
            work = sums[i].forward + sums[i].backward
            worst = max(worst, arrive + nb * work + tail)
            arrive += sums[i].forward + p2p.transfer_s(sums[i].output)
            tail += p2p.transfer_s(sums[i].output) + sums[i].backward if sums[i].runs_backward else 0.0
        worst = max(worst, nb * (sums[-1].forward + sums[-1].backward + enc_w))
        bounds.append(max(worst, sum(model.work)))
        rows.append([1, p])
    if not rows:
        return None
    order = np.argsort(np.asarray(bounds), kind="stable")
    return Stream("encoders_colocated", dp, nb, np.asarray(bounds)[order], np.asarray(rows)[order], in_bubble=True)


def _first_backward_starts(f: Sequence[float], b: Sequence[float], rb: Sequence[bool], send: Sequence[float],
                           p: int, v: int, nb: int) -> list[tuple[float, float] | None]:
    """Per LLM rank ``i`` of ``interleaved_1f1b``: (forward seconds of the ``warm-up + 1`` forwards it runs
    before its first backward, the earliest start of that backward ``B(stage (v-1) p + i, 0)``: microbatch
    0's forwards through every LLM stage and backwards down to it, with transfers; both from microbatch 0
    reaching the LLM). None where the stages after it do not all run backward."""
    k = v * p
    forward_end = sum(f) + sum(send[:-1])
    warmups = interleaved_warmups(p, v, nb)
    order = interleaved_chunk_order(nb, v, p)
    out: list[tuple[float, float] | None] = []
    for i in range(p):
        s = (v - 1) * p + i
        if not all(rb[s:]):
            out.append(None)
            continue
        start = forward_end + sum(b[s + 1:]) + sum(send[s:k - 1])
        warm = sum(f[c * p + i] for c, _ in order[: warmups[i] + 1])
        out.append((warm, start))
    return out


def _interleaved_memory_floor(sums: Sequence[ChunkSums], p: int, v: int, nb: int) -> list[float]:
    """Per LLM rank, a floor of its peak memory under ``interleaved_1f1b``: static bytes of its chunks plus
    the activations of its warm-up forwards and the first steady forward, all held before its first
    backward (``sums``: ``Partitions.chunk`` of each LLM stage)."""
    warmups = interleaved_warmups(p, v, nb)
    order = interleaved_chunk_order(nb, v, p)
    out = []
    for i in range(p):
        chunks = [sums[c * p + i] for c, _ in order[: warmups[i] + 1]]
        held = sum(c.activation for c in chunks if c.runs_backward)
        out.append(sum(c.static for c in sums[i::p]) + held)
    return out
