"""Context-parallel token distribution on packed multimodal batches: balance and planning time.

Part 1 (planning, no attention): realistic packed rows of 32k and 128k tokens (documents with text,
images of 256-1024 tokens, audio clips of 100-1500 tokens, some text-only documents;
``bidirectional_items`` masks) distributed over CP = 2, 4, 8 ranks by each method of
``plait.planner.token_distributor.plan_tokens``. Per method: attention max/mean (pairs per rank), total
max/mean (attention + linear work, ``beta`` from the model shape), tokens max/min, planning time.

Part 2 (measured, single process): at a size that fits a CPU (4k tokens, CP = 4) each rank's query subset
is run against the full K/V, one rank after the other, and the per-rank time is printed next to the
predicted work. On CPU flex_attention has no backward: forward+backward is measured with plait's chunked
SDPA path, forward with compiled flex_attention (``--flex compiled``). On CUDA both are flex. Each
per-rank time is the minimum over rounds that visit the ranks in turn (other load on a shared machine
only adds time); the planning objective there is attention only (beta = 0).

Run: ``.venv/bin/python bench/cp_balance.py`` (``--help`` for sizes, CP degrees, model shape).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import numpy as np
import torch

from plait.attention.interface import plait_attention
from plait.attention.masks import MaskInfo, block_work
from plait.planner.token_distributor import IlpLimits, TokenAssignment, WorkWeights, plan_tokens

IMAGE_TOKENS = (256, 576, 729, 1024)  # e.g. 16x16, 24x24, 27x27, 32x32 patches


def _document(rng: np.random.Generator) -> list[tuple[str, int]]:
    """Segments ``(kind, tokens)`` of one document: text-only (25%) or text interleaved with items."""
    if rng.random() < 0.25:
        return [("text", int(rng.lognormal(7.0, 0.9)) + 16)]
    segments = [("text", int(rng.integers(20, 400)))]
    for _ in range(int(rng.integers(1, 7))):
        if rng.random() < 0.6:
            segments.append(("item", int(rng.choice(IMAGE_TOKENS))))
        else:
            segments.append(("item", int(rng.integers(100, 1501))))
        segments.append(("text", int(rng.lognormal(5.0, 1.0)) + 8))
    return segments


def make_batch(num_tokens: int, seed: int) -> MaskInfo:
    """One packed row of ``num_tokens`` tokens; the last document may be cut; a tail < 1024 tokens may be padding."""
    rng = np.random.default_rng(seed)
    docs = np.full(num_tokens, -1, dtype=np.int64)
    items = np.full(num_tokens, -1, dtype=np.int64)
    pos = np.zeros(num_tokens, dtype=np.int64)
    cursor, doc, item = 0, 0, 0
    while num_tokens - cursor >= 256:
        segments = _document(rng)
        if cursor + sum(length for _, length in segments) > num_tokens and num_tokens - cursor < 1024:
            break  # a short tail stays padding
        start = cursor
        for kind, length in segments:
            end = min(cursor + length, num_tokens)
            if kind == "item":
                items[cursor:end] = item
                item += 1
            cursor = end
        docs[start:cursor] = doc
        pos[start:cursor] = np.arange(cursor - start)
        doc += 1
    as_row = [torch.from_numpy(a)[None] for a in (docs, items, pos)]
    return MaskInfo(*as_row, mode="bidirectional_items")


def linear_beta(hidden: int, ffn: int, kv_dim: int) -> float:
    """Linear FLOPs per token / attention FLOPs per (q, k) pair of one decoder layer (forward).

    Per token: 2 * (q, o: hidden^2 each; k, v: hidden * kv_dim each; gated MLP: 3 * hidden * ffn).
    Per pair: 4 * hidden (QK^T and PV over all heads).
    """
    per_token = 2 * (2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn)
    return per_token / (4 * hidden)


def _plan(attn: np.ndarray, n: int, cp: int, method: str, args) -> tuple[TokenAssignment, float]:
    """Plan, returning the assignment and its planning time in ms (median of repeats)."""
    nb = attn.size
    cap = (math.ceil(nb / cp) + args.slack_blocks) * args.block
    kwargs = dict(weights=WorkWeights(alpha=1.0, beta=args.plan_beta), block_size=args.block,
                  ilp=IlpLimits(time_s=args.ilp_time))
    if method in ("lpt", "ilp"):
        kwargs["max_tokens_per_rank"] = cap
    repeats = 1 if method == "ilp" else 5
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_tokens(attn, n, cp, method=method, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
    return plan, statistics.median(times)


def _rank_sums(plan: TokenAssignment, per_block: np.ndarray) -> np.ndarray:
    sums = np.zeros(plan.cp)
    for r, spans in enumerate(plan.ranges):
        for start, end in spans:
            sums[r] += per_block[start // plan.block_size: math.ceil(end / plan.block_size)].sum()
    return sums


def planning_table(args) -> None:
    beta = linear_beta(args.hidden, args.ffn, args.kv_dim)
    print(f"Part 1: planning. block={args.block}, plan objective alpha=1, beta={args.plan_beta} "
          f"(+ token cap ceil(blocks/cp)+{args.slack_blocks} blocks for lpt/ilp); total work column uses "
          f"beta={beta:.0f} pairs/token (hidden={args.hidden}, ffn={args.ffn}, kv_dim={args.kv_dim})")
    header = f"{'tokens':>7} {'cp':>3} {'method':<8} {'attn max/mean':>13} {'total max/mean':>14} " \
             f"{'tokens max/min':>14} {'plan ms':>8} {'block_work ms':>13}  note"
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        info = make_batch(n, args.seed)
        start = time.perf_counter()
        attn = block_work(info, args.block).astype(np.float64)
        work_ms = (time.perf_counter() - start) * 1e3
        tokens = np.minimum(args.block, n - np.arange(attn.size) * args.block)
        for cp in args.cps:
            for method in args.methods:
                plan, ms = _plan(attn, n, cp, method, args)
                a = _rank_sums(plan, attn)
                total = a + beta * _rank_sums(plan, tokens)
                held = plan.tokens_per_rank
                print(f"{n:>7} {cp:>3} {plan.method if method == plan.method else method + '*':<8} "
                      f"{a.max() / a.mean():>13.3f} {total.max() / total.mean():>14.3f} "
                      f"{max(held) / min(held):>14.3f} {ms:>8.2f} {work_ms:>13.2f}  {plan.note}")
        docs = int(info.document_ids.max()) + 1
        print(f"        (batch {n}: {docs} documents, {int(info.item_ids.max()) + 1} items, "
              f"{int((info.document_ids < 0).sum())} padding tokens)")


def _run(q, k, v, info, q_global, backend, backward) -> float:
    """One attention call (+ backward) on this rank's queries; seconds."""
    qq, kk, vv = (t.detach().requires_grad_(backward) for t in (q, k, v))
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = plait_attention(qq, kk, vv, info, q_global=q_global, backend=backend, compile_flex=True)
        if backward:
            out.sum().backward()
    if q.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _time_ranks(plan, q, k, v, info, backend, backward, repeats) -> list[float]:
    """Per-rank time (ms): minimum over ``repeats`` rounds that visit the ranks in turn, after a warm-up
    round (compilation, block masks); the minimum is the least disturbed by other load on the machine."""
    subsets = [torch.from_numpy(plan.token_indices(r)).to(q.device)[None] for r in range(plan.cp)]
    best = [math.inf] * plan.cp
    for round_ in range(repeats + 1):
        for r, q_global in enumerate(subsets):
            seconds = _run(q[:, :, q_global[0]], k, v, info, q_global, backend, backward)
            if round_:
                best[r] = min(best[r], seconds * 1e3)
    return best


def measured_table(args) -> None:
    n, cp, device = args.measure_tokens, args.measure_cp, torch.device(args.device)
    info = make_batch(n, args.measure_seed).to(device)
    attn = block_work(info, args.block).astype(np.float64)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen).to(device) for h in (8, 2, 2))
    runs = [("sdpa", True, "chunked SDPA fwd+bwd")]
    if device.type == "cuda":
        runs = [("flex", True, "flex fwd+bwd (compiled)")]
    elif args.flex == "compiled":
        # static shapes per rank: the CPU inductor flex template miscompiles some dynamic-shape cases
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        runs.append(("flex", False, "flex fwd (compiled, CPU)"))
    docs, items = int(info.document_ids.max()) + 1, int(info.item_ids.max()) + 1
    print(f"\nPart 2: measured per-rank attention time, {n} tokens ({docs} documents, {items} items), CP={cp}, "
          f"H=8/2 (GQA), D=64, "
          f"{device.type}, {torch.get_num_threads()} threads, plan beta=0; min of {args.repeats} rounds (ms)")
    for backend, backward, label in runs:
        print(f"{label}:")
        print(f"  {'method':<8} {'predicted max/mean':>18} {'measured max/mean':>17}   per-rank ms")
        for method in ("uniform", "zigzag", "lpt"):
            plan = plan_tokens(attn, n, cp, method=method, block_size=args.block,
                               max_tokens_per_rank=None if method != "lpt" else
                               (math.ceil(attn.size / cp) + args.slack_blocks) * args.block)
            try:
                ms = _time_ranks(plan, q, k, v, info, backend, backward, args.repeats)
            except Exception as exc:  # a compiler failure must not hide the other rows
                print(f"  {method:<8} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
                continue
            pred = np.array(plan.work)
            print(f"  {method:<8} {pred.max() / pred.mean():>18.3f} {max(ms) / statistics.mean(ms):>17.3f}   "
                  + " ".join(f"{t:7.1f}" for t in ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["uniform", "zigzag", "lpt", "ilp"])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--plan-beta", type=float, default=0.0, help="beta of the planning objective")
    parser.add_argument("--slack-blocks", type=int, default=1, help="token cap slack (blocks) for lpt/ilp")
    parser.add_argument("--ilp-time", type=float, default=1.0, help="ILP time limit (s)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--kv-dim", type=int, default=1024)
    parser.add_argument("--measure-tokens", type=int, default=4096)
    parser.add_argument("--measure-cp", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--flex", choices=["compiled", "off"], default="compiled",
                        help="CPU: also time compiled flex forward (first call compiles, ~30 s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for part 2")
    parser.add_argument("--skip-measure", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure-seed", type=int, default=3, help="part 2 batch (seed 3: 3 documents)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(args.seed)
    planning_table(args)
    if not args.skip_measure:
        torch.set_num_threads(args.threads)
        measured_table(args)


if __name__ == "__main__":
    main()
