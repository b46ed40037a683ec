"""Workload-balanced microbatches on a realistic multimodal mixture: balance, pipeline time, planning time.

Mixture (``make_metas``): 40% image-only, 20% audio-only, 10% image+audio and 30% text-only samples.
Images (1 or, 20% of the time, 2 per sample) are square with a side drawn uniformly from 224..1344 px in
steps of 28 px: ``(px / 14)^2`` patches for the vision encoder, a 2x2 merge gives ``patches / 4`` LLM
placeholder tokens. Audio clips last 1..30 s (uniform): 50 encoder frames per second (100 mel frames/s,
stride 2), pooled by 2 into 25 placeholders per second. Text is log-normal (median ~260 tokens, capped at
8192). Each sample is a ``plait.data.processing.SampleMeta``, as the loader emits it.

Cost model (``make_coeffs``): ``ModuleCostCoeffs`` with per-token and per-attended-pair FLOPs from the
shapes of three public models, with the conventions of ``plait.planner.cost.analytic`` (2 FLOPs per MAC,
attention ``4 * pairs * q_dim`` per layer): a frozen SigLIP-so400m-like vision tower (and frozen
projector; forward only), a trainable Whisper-large-v3-like audio encoder (forward + dX + dW = 3x) and a
trainable Qwen2-1.5B-like LLM (3x; causal, so ``L^2 / 2`` pairs). FLOPs become seconds at 400 TFLOP/s
(an H100 at ~40% MFU); only ratios matter.

Part 1 prints ``plait.planner.microbatch.macrobatch.macrobatch_stats`` for a 20k-sample dataset (what ``plait plan``
reports) and the batch-to-batch CV for global batches of 1, 8, 64, 256 (Entrain's ``1 / sqrt(B)`` point).

Part 2: for each seed a fresh global batch of 256 samples, split over ``dp`` in (1, 4) replicas and 16
microbatches by each method of ``plan_microbatches``. Per method: CV and max/mean of the per-microbatch
work per module (``workload_stats``), the CV reduction factor against ``arrival``, the simulated pipeline
iteration time and its gain over ``arrival``, the planning time, and the deferred samples. Figures are
the mean over seeds with the worst seed in brackets. The "bound" rows (``fluid_bound``) are the CV and
max/mean below which no assignment of these indivisible samples can go: when few samples share a
microbatch (dp=4: 4 per microbatch) the largest images and clips alone keep the encoder CV up, and the
"CV >= 5x lower than arrival" target can be out of reach for every method; the bound says by how much.

Pipeline (``make_pipeline``): ``encoder_parallel`` plan, vision 1 stage, audio 1 stage, LLM 2 stages, each
on its own rank; multimodal 1F1B (``one_f_one_b``), no P2P cost. Per-microbatch stage costs, frozen-aware:
vision ``F`` = forward of the encoder view's images (the stage is forward-only, no ``B``); audio ``F`` =
forward of the encoder view's clips, audio ``B`` = its backward (2x forward) for the clips whose LLM work
runs in that microbatch (the LLM view: a deferred sample's encoder gradient only arrives with its LLM
microbatch's backward); each LLM stage gets half of the LLM forward / backward of the LLM view
(``MicrobatchPlan.llm_microbatches``). The iteration time is the slowest DP replica's makespan (they
meet at the gradient all-reduce). The "balanced" row gives every microbatch the mean work (the bound
no assignment can beat).

Run: ``.venv/bin/python bench/microbatches.py`` (``--help``: seeds, sizes, DP degrees).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from plait.data.loader import GlobalBatchLoader
from plait.data.processing import SampleMeta
from plait.planner.microbatch.macrobatch import cv_by_batch_size, macrobatch_stats
from plait.planner.microbatch import (
    METHODS,
    MicrobatchPlan,
    MicrobatchPolicy,
    ModuleCostCoeffs,
    SampleCost,
    module_order,
    plan_microbatches,
    sample_costs_from_metadata,
    workload_stats,
)
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.pipeline.schedules import one_f_one_b
from plait.planner.pipeline.simulator import simulate

KINDS = ("image", "audio", "image+audio", "text")
KIND_SHARES = (0.4, 0.2, 0.1, 0.3)
FLOPS_PER_S = 400e12
TARGET_FACTOR = 5.0


# ------------------------------------------------------------ data and costs


def _image(rng: np.random.Generator) -> tuple[str, int]:
    side = 2 * int(rng.integers(8, 49))  # patches per side: 16..96 (224..1344 px at 14 px per patch)
    return ("vision", side * side // 4)  # 2x2 merge: placeholders


def _audio(rng: np.random.Generator) -> tuple[str, int]:
    frames = int(round(50 * rng.uniform(1.0, 30.0)))  # encoder frames at 50 per second
    return ("audio", max(1, frames // 2))  # pooled by 2: placeholders


def make_metas(n: int, rng: np.random.Generator, start: int = 0) -> list[SampleMeta]:
    """``n`` samples of the mixture (module docstring) as loader metadata."""
    out = []
    kinds = rng.choice(len(KINDS), size=n, p=KIND_SHARES)
    for x, k in enumerate(kinds):
        items: list[tuple[str, int]] = []
        if KINDS[k] in ("image", "image+audio"):
            items += [_image(rng) for _ in range(1 + int(rng.random() < 0.2))]
        if KINDS[k] in ("audio", "image+audio"):
            items.append(_audio(rng))
        text = min(8192, 16 + int(rng.lognormal(5.5, 0.8)))
        length = text + sum(p for _, p in items)
        meta = SampleMeta(f"s{start + x}", KINDS[k], length, text, max(1, text // 3), tuple(items))
        out.append(meta)
    return out


def _encoder_flops(hidden: int, mlp: int, layers: int) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per attended pair) of a ViT/Whisper-style encoder forward."""
    macs = layers * (4 * hidden * hidden + 2 * hidden * mlp)
    return 2.0 * macs, 4.0 * hidden * layers


def make_coeffs() -> dict[str, ModuleCostCoeffs]:
    """Seconds per token / per squared token of each module (module docstring), frozen-aware."""
    v_lin, v_quad = _encoder_flops(1152, 4304, 27)  # SigLIP-so400m-like, full attention
    a_lin, a_quad = _encoder_flops(1280, 5120, 32)  # Whisper-large-v3 encoder-like
    h, kv, ffn, layers, vocab = 1536, 256, 8960, 28, 151936  # Qwen2-1.5B-like, GQA
    l_lin = 2.0 * (layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + h * vocab)
    l_quad = 0.5 * 4.0 * h * layers  # causal: L^2 / 2 pairs
    s = 1.0 / FLOPS_PER_S
    return {
        "vision": ModuleCostCoeffs(v_lin * s, v_quad * s, trainable=False, encoder_tokens_per_feature=4.0),
        "audio": ModuleCostCoeffs(a_lin * s, a_quad * s, trainable=True, encoder_tokens_per_feature=2.0),
        "llm": ModuleCostCoeffs(l_lin * s, l_quad * s, trainable=True, needs_input_grad=True),
    }


def make_pipeline(num_microbatches: int) -> PipelinePlan:
    """Encoder-parallel plan: vision (frozen) 1 stage, audio (trainable) 1 stage, LLM (trainable) 2 stages."""
    units = synthetic_units({"vision": [False] * 28, "audio": [True] * 33}, [True] * 30)
    return plan_pipeline(
        units,
        "encoder_parallel",
        stages_per_module={"vision": 1, "audio": 1, "llm": 2},
        num_microbatches=num_microbatches,
    )


# ------------------------------------------------------------ simulation


def _view_sums(view: Sequence[Sequence[int]], values: np.ndarray) -> list[float]:
    """Per microbatch of ``view``, the sum of ``values`` over its sample indices."""
    return [float(values[list(mb)].sum()) if mb else 0.0 for mb in view]


def stage_costs(plan: MicrobatchPlan, rank: int, fwd: np.ndarray, bwd: np.ndarray) -> dict:
    """``{(stage, kind): [seconds per microbatch]}`` of one DP replica (module docstring).

    ``fwd``/``bwd``: (samples, 3) forward / backward seconds of vision, audio, LLM per sample index.
    """
    enc, llm = plan.microbatches[rank], plan.llm_microbatches(rank)
    llm_f, llm_b = _view_sums(llm, fwd[:, 2]), _view_sums(llm, bwd[:, 2])
    return {
        (0, "F"): _view_sums(enc, fwd[:, 0]),
        (1, "F"): _view_sums(enc, fwd[:, 1]),
        (1, "B"): _view_sums(llm, bwd[:, 1]),
        (2, "F"): [x / 2 for x in llm_f],
        (2, "B"): [x / 2 for x in llm_b],
        (3, "F"): [x / 2 for x in llm_f],
        (3, "B"): [x / 2 for x in llm_b],
    }


def _balanced_costs(costs: dict, m: int) -> dict:
    """Every microbatch of a stage action gets the mean over the replicas' microbatches."""
    return {key: [statistics.fmean(v)] * m for key, v in costs.items()}


def split_passes(
    costs: Sequence[SampleCost], coeffs: dict[str, ModuleCostCoeffs]
) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds per sample index and module: forward = work / pass factor."""
    factors = np.array([coeffs[name].pass_factor for name in module_order(coeffs)], dtype=np.float64)
    work = np.zeros((1 + max(c.index for c in costs), len(factors)))
    for c in costs:
        work[c.index] = c.work
    fwd = work / factors
    return fwd, work - fwd


def iteration_time(schedule, plan: MicrobatchPlan, fwd, bwd) -> tuple[float, float]:
    """(slowest replica's makespan, makespan with perfectly balanced microbatches), seconds."""
    per_rank = [stage_costs(plan, r, fwd, bwd) for r in range(plan.dp)]
    times = [simulate(schedule, c).makespan_s for c in per_rank]
    pooled = {key: [x for c in per_rank for x in c[key]] for key in per_rank[0]}
    bound = simulate(schedule, _balanced_costs(pooled, plan.num_microbatches)).makespan_s
    return max(times), bound


def fluid_bound(values: np.ndarray, groups: int) -> tuple[float, float]:
    """(CV, max/mean) that no split of these indivisible work values into ``groups`` sums can beat.

    Relaxation: the ``groups`` largest values sit in distinct groups and all other work is a fluid poured
    onto the lightest groups (water filling), so loads are ``max(w_g, level)``. Any real split's load
    vector majorizes this one (its top-k loads hold at least the top-k values, and the rest averages at
    most the level), so its variance, and its maximum, are at least this vector's (Schur convexity).
    """
    w = np.sort(np.asarray(values, dtype=np.float64))[::-1]
    total = float(w.sum())
    if total <= 0:
        return 0.0, 1.0
    tops = np.zeros(groups)
    tops[: min(groups, len(w))] = w[:groups]
    for k in range(groups):
        level = (total - tops[:k].sum()) / (groups - k)
        if tops[k] <= level:
            break
    loads = np.maximum(tops, level)
    return float(loads.std() / loads.mean()), float(loads.max() / loads.mean())


def bound_figures(costs: Sequence[SampleCost], modules: Sequence[str], groups: int) -> dict[str, float]:
    """``fluid_bound`` of every module over ``groups`` microbatches, as ``cv_``/``mom_`` figures."""
    row: dict[str, float] = {}
    for k, name in enumerate(modules):
        row[f"cv_{name}"], row[f"mom_{name}"] = fluid_bound(np.array([c.work[k] for c in costs]), groups)
    return row


# ------------------------------------------------------------ experiment


def run_seed(seed: int, args, coeffs, schedule, dp: int) -> dict[str, dict[str, float]]:
    """All methods on one fresh global batch: per method, its figures (``_figures``)."""
    rng = np.random.default_rng(10_000 + seed)
    costs = sample_costs_from_metadata(make_metas(args.batch, rng), coeffs)
    fwd, bwd = split_passes(costs, coeffs)
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        policy = MicrobatchPolicy(method=method, dp=dp, num_microbatches=args.microbatches, seed=seed)
        start = time.perf_counter()
        plan = plan_microbatches(costs, policy, step=0)
        planning = time.perf_counter() - start
        stats = workload_stats(plan, costs, module_order(coeffs))
        makespan, bound = iteration_time(schedule, plan, fwd, bwd)
        out[method] = _figures(stats, makespan, planning)
    out["balanced"] = {"time": bound}  # the same for every method: total work per stage does not change
    out["bound"] = bound_figures(costs, module_order(coeffs), dp * args.microbatches)
    for method in (*METHODS, "bound"):
        for name in module_order(coeffs):
            base, own = out["arrival"][f"cv_{name}"], out[method][f"cv_{name}"]
            out[method][f"factor_{name}"] = base / own if own > 0 else float("inf")
    for method in (*METHODS, "balanced"):
        out[method]["gain"] = out["arrival"]["time"] / out[method]["time"]
    return out


def _figures(stats, makespan: float, planning: float) -> dict[str, float]:
    row = {"time": makespan, "plan_ms": 1e3 * planning, "deferred": float(stats.num_deferred)}
    for name, cv, mom in zip(stats.modules, stats.cv, stats.max_over_mean):
        row[f"cv_{name}"], row[f"mom_{name}"] = cv, mom
    return row


def _cell(values: list[float], worst_is_max: bool, fmt: str) -> str:
    worst = max(values) if worst_is_max else min(values)
    return f"{statistics.fmean(values):{fmt}} [{worst:{fmt}}]"


def _factor_cell(runs: list[dict[str, dict[str, float]]], method: str, module: str) -> str:
    """mean(arrival CV) / mean(method CV) over seeds, with the smallest per-seed ratio in brackets."""
    own = statistics.fmean(r[method][f"cv_{module}"] for r in runs)
    base = statistics.fmean(r["arrival"][f"cv_{module}"] for r in runs)
    worst = min(r[method][f"factor_{module}"] for r in runs)
    ratio = base / own if own > 0 else float("inf")
    return f"{ratio:.1f} [{worst:.1f}]"


COLUMNS = (  # (header, key pattern, worst is max, format)
    ("CV", "cv_{}", True, ".3f"),
    ("max/mean", "mom_{}", True, ".2f"),
    ("CV reduction, arrival CV / method CV (ratio of seed means [worst seed])", "factor_{}", False, ".1f"),
)


def print_table(runs: list[dict[str, dict[str, float]]], modules: Sequence[str], dp: int, args) -> None:
    """One block per DP degree: mean [worst] over seeds of every figure."""
    print(f"\n== dp={dp}, global batch {args.batch}, {args.microbatches} microbatches per replica, "
          f"{len(runs)} seeds: mean [worst seed] ==")
    for header, key, worst_max, fmt in COLUMNS:
        print(f"{header}:")
        print(f"  {'method':<13}" + "".join(f"{m:>18}" for m in modules))
        for method in (*METHODS, "bound"):
            cells = [_cell([r[method][key.format(m)] for r in runs], worst_max, fmt) for m in modules]
            if key.startswith("factor"):  # mean column: ratio of the mean CVs (per-seed ratios can explode)
                cells = [_factor_cell(runs, method, m) for m in modules]
            print(f"  {method:<13}" + "".join(f"{c:>18}" for c in cells))
    print("pipeline (vision 1 + audio 1 + LLM 2 stages, 1F1B): iteration time, gain over arrival, planning")
    print(f"  {'method':<13}{'iteration s':>20}{'gain':>18}{'plan ms':>20}{'deferred':>12}")
    for method in (*METHODS, "balanced"):
        time_cell = _cell([r[method]["time"] for r in runs], True, ".3f")
        gain = _cell([r[method]["gain"] for r in runs], False, ".3f")
        plan = _cell([r[method]["plan_ms"] for r in runs], True, ".1f") if method != "balanced" else "-"
        deferred = f"{statistics.fmean(r[method]['deferred'] for r in runs):.1f}" if method != "balanced" else "-"
        print(f"  {method:<13}{time_cell:>20}{gain:>18}{plan:>20}{deferred:>12}")
    worst = {m: min(r["hierarchical"][f"factor_{m}"] for r in runs) for m in modules}
    possible = {m: min(r["bound"][f"factor_{m}"] for r in runs) for m in modules}
    verdict = "PASS" if min(worst.values()) >= TARGET_FACTOR else "FAIL"
    print(f"target: hierarchical CV >= {TARGET_FACTOR:.0f}x lower than arrival for every module, worst seed: "
          + ", ".join(f"{m} {f:.1f}x" for m, f in worst.items()) + f" -> {verdict}; the bound allows at most "
          + ", ".join(f"{m} {f:.1f}x" for m, f in possible.items()) + " on its worst seed")


def print_macrobatch(args, coeffs) -> None:
    """Part 1: macro-batch statistics of a dataset of the mixture."""
    metas = make_metas(args.dataset, np.random.default_rng(1))
    start = time.perf_counter()
    order = GlobalBatchLoader(len(metas), args.batch, seed=0).epoch_order  # the trainer's loader order
    stats = macrobatch_stats(metas, args.batch, args.macro_batches, coeffs, seed=0, epoch_order=order)
    elapsed = time.perf_counter() - start
    print(stats.format_table("seconds"))
    print(f"(computed in {elapsed:.2f} s)\n")
    print(cv_by_batch_size(metas, coeffs, (1, 8, 64, 256), args.macro_batches, seed=0, epoch_order=order).format_table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=8, help="global batches (one per seed)")
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--microbatches", type=int, default=16, help="microbatches per DP replica")
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 4], help="DP degrees")
    parser.add_argument("--dataset", type=int, default=20_000, help="dataset size for part 1")
    parser.add_argument("--macro-batches", type=int, default=500, help="global batches drawn in part 1")
    args = parser.parse_args()
    coeffs = make_coeffs()
    print_macrobatch(args, coeffs)
    schedule = one_f_one_b(make_pipeline(args.microbatches))
    for dp in args.dp:
        runs = [run_seed(seed, args, coeffs, schedule, dp) for seed in range(args.seeds)]
        print_table(runs, module_order(coeffs), dp, args)


if __name__ == "__main__":
    main()
