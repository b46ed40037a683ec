"""MARS: per-module LoRA rank search from short calibration runs (pure).

A LoRA rank sets how fast a module's adapters converge. MARS picks one rank per module (each encoder with adapters,
and the LLM) so that the encoders and the LLM converge together, then picks, among such aligned combinations, the
one a performance law predicts to reach the lowest validation loss. Everything here is pure: the calibration runs
themselves are ``plait.commands.tune_ranks``'s.

**Calibration** (:func:`plan_calibration`): for every module ``m`` with adapters, every candidate rank ``r`` and
every data-subset size ``D`` (samples), one short training run in which only ``m``'s adapters train (the other
modules' adapters are off and their bases frozen; projectors as the job says), ``epochs`` passes over the first
``D`` samples of a fixed shuffle of the training set (nested subsets).

**Convergence time** (:func:`convergence_samples`), the quantity Law-C models, measured per run from the per-step
training ``loss`` the trainer logs to ``metrics.jsonl``: smooth the losses with an exponential moving average
(``s_1 = l_1``, ``s_k = beta s_{k-1} + (1 - beta) l_k``, beta = 0.5); the run's gap is ``s_1 - s_K`` (first minus
last smoothed value); the convergence time is the number of training samples seen (steps x global batch) at the
first step ``k`` whose ``s_k <= s_K + (1 - fraction) (s_1 - s_K)``, i.e. that has closed ``fraction`` (0.8) of the
gap. A run whose loss does not fall (gap <= 0) has not converged: its time is all of its samples. Because only
``m`` trains, the time is ``m``'s own.

**Law-C** (convergence): ``t_m(r, D) = t0_m + K_m D^g_m r^(a_m + e_m ln(D / D_ref))`` per module, fitted in log
space (:func:`fit_power_law`: ``log(t - t0) = log K + g log D + a log r + e log r log(D / D_ref)`` by least squares,
``t0`` by a search over ``[0, min t)`` minimising the relative residuals of ``t`` itself; ``D_ref`` the geometric
mean of the subset sizes). The rank exponent may change with the data size (``e``, fitted with 3 or more sizes):
on the demo task the LLM's ranks converged alike in 8-step runs (20-24 samples) and 2x apart in 32-step runs
(r = 2: 84, r = 32: 40), so a single exponent (-0.09 there) averaged the separation away and the alignment kept
only the extreme pair (vision 32 / LLM 2, 4 points behind the grid's best); the varying one extrapolates it to the
full data size and aligns vision 2 / LLM 2 (0.5 points behind; README "LoRA rank search", bench/mars.py).

**Alignment and pruning** (:func:`align_ranks`): for each candidate LLM rank, the LLM's time at the full data size
``t_llm``; for each encoder the rank that solves ``t_e(r, D) = t_llm`` (``r = ((t_llm - t0) / (K D^g))^(1/a)``;
None when there is no real positive solution) and the candidate rank whose predicted time is nearest to ``t_llm``
in log space (the fallback when there is no solution). A combination is kept when every encoder's time is within
``tolerance`` (a factor, 1.5) of the LLM's; when none is, the best-aligned combination of each LLM rank is kept.

**Law-P** (performance): ``v_m(r, D) = v0_m + A_m D^b_m r^c_m``, the final validation loss of the run in which only
``m`` trains, fitted the same way (a single rank exponent: a varying one did not change the demo's ranking). A combination's loss is predicted by multiplying the modules' loss ratios to the
untuned model (their gains add in log space): ``v(r_1..r_M) = v_base * prod_m (v_m(r_m, D) / v_base)`` (``v_base``:
the untuned model's loss, measured as the mean first-step training loss of the calibration runs, before any update).
Adding the gains themselves (``v_base - sum_m (v_base - v_m)``) went negative on the demo task, where either module
alone (with the projectors) learns most of the answer format, so the gains overlap; the product stays positive. The
product is a score that ranks combinations, not a forecast of a fine-tune's validation loss: each factor extrapolates
a law fitted to short one-module runs, and multiplying ratios compounds them (on the demo task a score of 0.005 beside
a real validation loss of 0.12). :func:`choose_ranks` picks the kept
combination of lowest score (ties: the smaller total rank) and :func:`lora_toml` writes it as the
``[model.*.lora]`` tables to paste into the job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from plait.planner.ranks.types import CalibrationRun, PowerLaw, RankChoice, RankCombo
from plait.planner.toml_text import toml_text
from plait.planner.types import LLM_MODULE

__all__ = [
    "align_ranks",
    "choose_ranks",
    "convergence_samples",
    "fit_power_law",
    "lora_at_rank",
    "lora_toml",
    "plan_calibration",
    "predict_combo_loss",
]


def plan_calibration(modules: Sequence[str], ranks: Sequence[int], sizes: Sequence[int], epochs: float, batch: int,
                     train_samples: int, budget: int | None = None) -> tuple[CalibrationRun, ...]:
    """The calibration runs: every module x rank x size, ``ceil(epochs * size / batch)`` steps each (at least 2).

    Args:
        modules: modules with adapters (encoder names and ``"llm"``).
        ranks: candidate ranks (>= 1, at least 2 distinct).
        sizes: data-subset sizes in samples (at least 2 distinct, each <= ``train_samples``).
        epochs: passes over each subset (> 0).
        batch: samples per optimizer step.
        train_samples: samples of the job's training set.
        budget: the most training samples all runs together may process; the largest sizes are dropped until the
            plan fits (at least two sizes must remain).

    Raises:
        ValueError: on an empty or bad list, a size above ``train_samples``, or a budget two sizes do not fit.
    """
    _check_candidates(modules, ranks, sizes, epochs, batch)
    if max(sizes) > train_samples:
        raise ValueError(f"subset size {max(sizes)} exceeds the {train_samples} training samples")
    kept = sorted(set(sizes))

    def plan(szs: Sequence[int]) -> tuple[CalibrationRun, ...]:
        return tuple(CalibrationRun(m, r, d, max(2, math.ceil(epochs * d / batch)), batch)
                     for m in modules for r in sorted(set(ranks)) for d in szs)

    runs = plan(kept)
    while budget is not None and sum(r.steps * r.batch for r in runs) > budget:
        if len(kept) <= 2:
            need = sum(r.steps * r.batch for r in runs)
            raise ValueError(f"--budget {budget} samples is below the {need} that the two smallest subset sizes "
                             f"{kept} need ({len(modules)} modules x {len(set(ranks))} ranks); lower --sizes, "
                             "--epochs or the candidate ranks")
        kept = kept[:-1]
        runs = plan(kept)
    return runs


def _check_candidates(modules: Sequence[str], ranks: Sequence[int], sizes: Sequence[int], epochs: float,
                      batch: int) -> None:
    if not modules or LLM_MODULE not in modules or len(modules) < 2:
        raise ValueError(f"rank search needs LoRA on the LLM and on at least one encoder, got modules {list(modules)}")
    if len(set(ranks)) < 2 or min(ranks) < 1:
        raise ValueError(f"candidate ranks must hold at least 2 distinct values >= 1, got {list(ranks)}")
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ValueError(f"subset sizes must hold at least 2 distinct values >= 1, got {list(sizes)}")
    if not epochs > 0 or batch < 1:
        raise ValueError(f"epochs must be > 0 and batch >= 1, got {epochs} and {batch}")


def convergence_samples(losses: Sequence[float], batch: int, fraction: float = 0.8, beta: float = 0.5) -> float:
    """Training samples seen until the smoothed loss closes ``fraction`` of its gap (module docstring).

    Args:
        losses: per-step training losses of one run, step 1 first (at least 2).
        batch: samples per step.
        fraction: share of the first-to-last gap to close, in (0, 1).
        beta: EMA factor in [0, 1).

    Raises:
        ValueError: on fewer than 2 losses, a non-finite loss or parameters out of range.
    """
    if len(losses) < 2 or not all(math.isfinite(x) for x in losses):
        raise ValueError(f"need at least 2 finite losses, got {list(losses)[:8]}")
    if not 0 < fraction < 1 or not 0 <= beta < 1 or batch < 1:
        raise ValueError(f"fraction must be in (0, 1), beta in [0, 1), batch >= 1; got {fraction}, {beta}, {batch}")
    smooth = [float(losses[0])]
    for x in losses[1:]:
        smooth.append(beta * smooth[-1] + (1 - beta) * float(x))
    gap = smooth[0] - smooth[-1]
    if gap <= 0:
        return float(len(losses) * batch)
    level = smooth[-1] + (1 - fraction) * gap
    step = next(k for k, s in enumerate(smooth, start=1) if s <= level)
    return float(step * batch)


def fit_power_law(samples: Sequence[float], ranks: Sequence[float], values: Sequence[float],
                  offset_grid: int = 200, rank_by_data: bool = False) -> PowerLaw:
    """Fit ``y = y0 + K D^g r^a`` in log space (least squares of ``log(y - y0)`` on ``1, log D, log r``); with
    ``rank_by_data`` and at least 3 distinct data sizes, the rank exponent may change with the data size:
    ``r^(a + e ln(D / D_ref))`` (one more column, ``log r * log(D / D_ref)``; ``D_ref`` the geometric mean of ``D``).

    ``y0`` is searched over ``offset_grid`` points of ``[0, min y)`` (and, for a law whose values may be negative,
    nothing below 0 is tried), keeping the one whose predictions have the smallest relative squared residuals
    ``sum((y - pred) / y)^2``. An exponent whose variable takes one value only is not identifiable: it is fixed
    at 0 (the law then does not depend on it).

    Raises:
        ValueError: on lengths that differ, fewer than 3 observations, or a non-positive ``D``, ``r`` or ``y``.
    """
    d, r, y = (np.asarray(v, dtype=np.float64) for v in (samples, ranks, values))
    if not len(d) == len(r) == len(y) or len(y) < 3:
        raise ValueError(f"need >= 3 observations of equal length, got {len(d)}, {len(r)}, {len(y)}")
    if (d <= 0).any() or (r <= 0).any() or (y <= 0).any() or not np.isfinite(y).all():
        raise ValueError("samples, ranks and values must be positive and finite")
    ref = float(np.exp(np.log(d).mean()))
    varying = rank_by_data and len(set(d.tolist())) >= 3 and np.ptp(r) > 0
    columns = [np.ones_like(y)] + [np.log(v) for v in (d, r) if np.ptp(v) > 0]
    if varying:
        columns.append(np.log(r) * np.log(d / ref))
    design = np.stack(columns, axis=1)
    best = None
    for y0 in np.linspace(0.0, float(y.min()), offset_grid, endpoint=False):
        target = np.log(y - y0)
        coef, *_ = np.linalg.lstsq(design, target, rcond=None)
        pred = y0 + np.exp(design @ coef)
        err = float(np.sum(((y - pred) / y) ** 2))
        if best is None or err < best[0]:
            best = (err, y0, coef, target, pred)
    _, y0, coef, target, pred = best
    exps = iter(coef[1:])
    g = float(next(exps)) if np.ptp(d) > 0 else 0.0
    a = float(next(exps)) if np.ptp(r) > 0 else 0.0
    e = float(next(exps)) if varying else 0.0
    fitted = design @ coef
    total = float(np.sum((target - target.mean()) ** 2))
    r2 = 1.0 - float(np.sum((target - fitted) ** 2)) / total if total > 0 else 1.0
    return PowerLaw(float(y0), float(np.exp(coef[0])), g, a, r2, tuple(float(x) for x in y - pred), e,
                    ref if varying else 1.0)


def align_ranks(laws: Mapping[str, PowerLaw], candidates: Sequence[int], samples: int,
                tolerance: float = 1.5) -> tuple[RankCombo, ...]:
    """The combinations whose encoders converge with the LLM (module docstring, "Alignment and pruning").

    Args:
        laws: Law-C per module (``"llm"`` and each encoder).
        candidates: the candidate ranks (every module's).
        samples: the data size to align at (the full training set, in samples).
        tolerance: the largest accepted ratio between an encoder's time and the LLM's (>= 1).

    Raises:
        ValueError: without an ``"llm"`` law or an encoder law, or on ``tolerance < 1``.
    """
    if LLM_MODULE not in laws or len(laws) < 2 or tolerance < 1:
        raise ValueError(f"need Law-C of the LLM and an encoder and tolerance >= 1, got {sorted(laws)}, {tolerance}")
    combos = []
    for r_llm in sorted(set(candidates)):
        t_llm = laws[LLM_MODULE].predict(samples, r_llm)
        ranks, times, solved = {LLM_MODULE: r_llm}, {LLM_MODULE: t_llm}, {}
        for name, law in laws.items():
            if name == LLM_MODULE:
                continue
            solved[name] = law.solve_rank(t_llm, samples)
            ranks[name] = min(sorted(set(candidates)), key=lambda r: abs(math.log(_pos(law.predict(samples, r))
                                                                                   / _pos(t_llm))))
            times[name] = law.predict(samples, ranks[name])
        mismatch = max(max(_pos(t), _pos(t_llm)) / min(_pos(t), _pos(t_llm)) for t in times.values())
        combos.append(RankCombo(ranks, times, mismatch, solved))
    kept = [c for c in combos if c.mismatch <= tolerance]
    unique: dict[tuple, RankCombo] = {}
    for c in kept or combos:
        unique.setdefault(tuple(sorted(c.ranks.items())), c)
    return tuple(unique.values())


def _pos(x: float) -> float:
    return max(float(x), 1e-9)


def predict_combo_loss(laws: Mapping[str, PowerLaw], ranks: Mapping[str, int], samples: int, base: float) -> float:
    """Law-P of a combination: ``base * prod_m (v_m(r_m, samples) / base)`` (module docstring).

    Raises:
        ValueError: when a module of ``ranks`` has no law, or on ``base <= 0``.
    """
    missing = sorted(set(ranks) - set(laws))
    if missing:
        raise ValueError(f"no performance law for module(s) {missing}")
    if base <= 0:
        raise ValueError(f"the untuned model's loss must be > 0, got {base}")
    return base * math.prod(laws[m].predict(samples, r) / base for m, r in ranks.items())


def choose_ranks(convergence: Mapping[str, PowerLaw], performance: Mapping[str, PowerLaw], candidates: Sequence[int],
                 samples: int, base: float, tolerance: float = 1.5) -> RankChoice:
    """Prune with Law-C (:func:`align_ranks`), predict each kept combination's loss with Law-P, pick the lowest
    (ties: smaller total rank).

    Raises:
        ValueError: as :func:`align_ranks` and :func:`predict_combo_loss`.
    """
    combos = align_ranks(convergence, candidates, samples, tolerance)
    losses = tuple(predict_combo_loss(performance, c.ranks, samples, base) for c in combos)
    best = min(range(len(combos)), key=lambda k: (losses[k], sum(combos[k].ranks.values())))
    return RankChoice(combos, losses, dict(combos[best].ranks))


def lora_at_rank(settings: Mapping[str, object], rank: int) -> dict[str, object]:
    """A part's LoRA settings (``[model.*.lora]`` as a dict: ``r``, ``alpha``, ...) moved to ``rank``, keeping the
    adapter's scale ``alpha / r`` (peft multiplies the adapter's output by ``lora_alpha / r``).

    peft's own default holds ``lora_alpha`` fixed when ``r`` changes (scale ``alpha / r`` shrinks as the rank grows);
    the rank search instead keeps the job's scale, the one its ``lr`` was chosen with (the common "alpha = 2 r"
    practice): every candidate rank, calibration run and chosen table gets ``alpha = job_alpha * rank / job_r``.
    Then a rank changes the adapter's capacity, not its step size. Settings without ``alpha`` or with ``r`` < 1 (no
    adapter in the job) only get the new ``r``.

    Raises:
        ValueError: on ``rank < 1``.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    out = dict(settings)
    old = int(settings.get("r", 0) or 0)
    if "alpha" in settings and old >= 1:
        out["alpha"] = float(settings["alpha"]) * rank / old
    out["r"] = int(rank)
    return out


def lora_toml(ranks: Mapping[str, int], settings: Mapping[str, Mapping[str, object]] | None = None) -> str:
    """The ``[model.llm.lora]`` / ``[model.encoders.<name>.lora]`` tables for ``ranks`` (module -> r), each with
    the other fields of ``settings[module]`` written as given (e.g. ``alpha``, ``dropout``, ``target_modules``;
    pass :func:`lora_at_rank`'s settings to keep the job's ``alpha / r``), to replace the job's own tables.

    Raises:
        ValueError: on a rank < 1.
    """
    out = []
    for module in sorted(ranks, key=lambda m: (m == LLM_MODULE, m)):
        if ranks[module] < 1:
            raise ValueError(f"rank of {module!r} must be >= 1, got {ranks[module]}")
        table = "model.llm.lora" if module == LLM_MODULE else f"model.encoders.{module}.lora"
        fields = {"r": int(ranks[module])}
        fields.update((k, v) for k, v in (settings or {}).get(module, {}).items() if k != "r")
        out.append(toml_text(fields, table=table).rstrip("\n"))
    return "\n\n".join(out) + "\n"
