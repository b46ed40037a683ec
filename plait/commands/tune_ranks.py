"""``plait tune-ranks``: choose a LoRA rank per module with MARS (``plait.planner.ranks.rank_law``; README "LoRA rank search").

:func:`tune_ranks_command` reads the job, finds the modules with LoRA (``[model.llm.lora]`` and every
``[model.encoders.<name>.lora]`` with ``r > 0``), plans the calibration runs (:func:`~plait.planner.ranks.rank_law.
plan_calibration`: every module x candidate rank x subset size, only that module's adapters training), runs each
with plait's own trainer (in this process, or under ``torchrun --nproc_per_node N`` with ``--nproc N`` for the
job's parallel layout), fits Law-C and Law-P, prunes and chooses, and writes into ``--out-dir`` (default
``<metrics.run_dir>/tune_ranks``):

- ``data/subset_<D>.jsonl``: the first ``D`` training records of a fixed shuffle (seed ``train.seed``), media paths
  made absolute; ``runs/<module>_r<rank>_d<D>/``: each run's job (``job.toml``), log, metrics and ``result.json``
  (what it measured, with its CPU seconds). A run whose ``result.json`` holds the same job is not run again, so an
  interrupted search resumes where it stopped.
- ``search.json`` (observations, laws with R^2 and residuals, kept combinations with their Law-P scores, the choice,
  the compute spent), ``laws.png`` (each law against its observations) and ``ranks.toml`` (the chosen
  ``[model.*.lora]`` tables, to replace the job's).

Every candidate rank keeps the job's adapter scale ``alpha / r`` (:func:`~plait.planner.ranks.rank_law.lora_at_rank`), in
the calibration runs and in ``ranks.toml``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from plait.data.progress import Progress
from plait.config.loader import config_to_dict, load_config
from plait.config.schema import JobConfig
from plait.planner.ranks.rank_law import (
    choose_ranks, convergence_samples, fit_power_law, lora_at_rank, lora_toml, plan_calibration,
)
from plait.planner.ranks.types import CalibrationRun, Observation, PowerLaw, RankChoice
from plait.planner.toml_text import toml_text
from plait.planner.types import LLM_MODULE
from plait.train.metrics import read_metrics
from plait.train.plots import new_figure, save_figure

__all__ = ["RunResult", "SearchSettings", "TrainVerb", "cpu_seconds", "lora_modules", "plot_laws", "run_calibration",
           "subset_records", "train_job", "tune_ranks_command", "write_job_toml"]


TrainVerb = Callable[..., Any]
"""``plait train``'s function (``train_command(job, overrides, overwrite=True)``), which trains a calibration run
in this process; the command line passes it in (a verb imports no other verb)."""


@dataclass(frozen=True)
class SearchSettings:
    """Knobs of one search (CLI flags): candidate ``ranks``, subset ``sizes`` (samples; empty: 1/8 and 1/4 of the
    training set), ``epochs`` over each subset, ``batch`` (global batch of the calibration runs; 0: the job's),
    ``val_samples`` (validation records each run scores), ``tolerance`` (largest accepted encoder/LLM convergence
    time ratio), ``fraction`` (share of the loss gap that counts as converged), ``budget`` (most training samples
    all calibration runs together may process; None: no cap), ``nproc`` (processes per run; > 1 runs torchrun)."""

    ranks: tuple[int, ...] = (2, 4, 8, 16)
    sizes: tuple[int, ...] = ()
    epochs: float = 1.0
    batch: int = 0
    val_samples: int = 64
    tolerance: float = 1.5
    fraction: float = 0.8
    budget: int | None = None
    nproc: int = 1


@dataclass(frozen=True)
class RunResult:
    """A finished calibration run: its observation, the steps and samples it trained, its CPU seconds (this process
    or its torchrun children, all threads) and wall seconds, and whether it was found on disk (resumed)."""

    observation: Observation
    steps: int
    samples: int
    cpu_s: float
    wall_s: float
    resumed: bool


def lora_modules(cfg: JobConfig) -> list[str]:
    """The modules with LoRA in the job: encoder names (job order) then ``"llm"``; each with ``lora.r > 0``."""
    mods = [name for name, enc in cfg.model.encoders.items() if enc.lora.r > 0]
    return mods + ([LLM_MODULE] if cfg.model.llm.lora.r > 0 else [])


def subset_records(train_path: str | Path, seed: int) -> list[dict]:
    """The job's training records in a fixed shuffle (seed ``seed``), media paths absolute (they were relative to
    the file), so that the first ``D`` of them form nested subsets.

    Raises:
        ValueError: when the training file is not plait JSONL (``.jsonl``), naming it and the line of a bad record.
    """
    path = Path(train_path)
    if path.suffix != ".jsonl":
        raise ValueError(f"plait tune-ranks draws subsets from a JSONL data.train, got {path} (convert it first)")
    records = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {line_no}: not JSON ({exc.msg})") from None
        for key in ("images", "audios"):
            r[key] = [str((path.parent / p).resolve()) if isinstance(p, str) else p for p in r.get(key, [])]
        records.append(r)
    order = np.random.default_rng(seed).permutation(len(records))
    return [records[i] for i in order]


def write_job_toml(job: dict[str, Any], path: Path) -> Path:
    """Write a job dict (``config_to_dict``'s form) as a TOML job file that ``load_config`` reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(job))
    return path


def _run_job(cfg: JobConfig, run: CalibrationRun, subset: Path, run_dir: Path, val_samples: int) -> dict[str, Any]:
    """The job of one calibration run: only ``run.module``'s adapters (at ``run.rank``, the job's ``alpha / r``
    kept: :func:`~plait.planner.ranks.rank_law.lora_at_rank`) train, the other modules
    with adapters frozen without them; ``run.steps`` steps of ``run.batch`` samples on ``subset``, validation on
    ``val_samples`` records at the end, no intermediate checkpoints, no progress bars."""
    job = config_to_dict(cfg)
    parts = {LLM_MODULE: job["model"]["llm"], **job["model"]["encoders"]}
    for name in lora_modules(cfg):
        parts[name]["lora"] = lora_at_rank(parts[name]["lora"], run.rank) if name == run.module else \
            dict(parts[name]["lora"], r=0)
        parts[name]["freeze"] = name != run.module or parts[name].get("freeze", False)
    job["data"].update(train=str(subset.resolve()), val_max_samples=val_samples, sources=[])
    micro = min(job["train"]["microbatch_size"], run.batch)
    job["train"].update(steps=run.steps, global_batch_size=run.batch, microbatch_size=micro, eval_every=0,
                        warmup_steps=min(job["train"]["warmup_steps"], max(0, run.steps // 4)))
    job["checkpoint"].update(every=0, keep=1)
    job["metrics"].update(run_dir=str(run_dir.resolve()), progress=False, tensorboard=False, wandb=False,
                          log_every=1)
    return job


def _observe(run: CalibrationRun, run_dir: Path, fraction: float) -> Observation:
    """Read a finished run's ``metrics.jsonl``: per-step losses -> convergence time; last ``val_loss``.

    Raises:
        ValueError: naming the file when it lacks the steps or the validation loss.
    """
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    if len(losses) < run.steps or not vals:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: {len(losses)} of {run.steps} steps and "
                         f"{len(vals)} validation losses logged (needs data.val in the job)")
    series = [losses[s] for s in sorted(losses)]
    return Observation(run.module, run.rank, run.samples, convergence_samples(series, run.batch, fraction),
                       float(vals[-1]), float(series[0]))


def run_calibration(cfg: JobConfig, run: CalibrationRun, records: list[dict], out: Path,
                    settings: SearchSettings, train: TrainVerb | None = None) -> RunResult:
    """Run (or find on disk) one calibration run under ``out/runs/<run.name>`` (``train``: as :func:`train_job`);
    returns what it measured.

    A ``result.json`` whose recorded job and subset (SHA-256 of its text) equal this run's means the run finished
    before: it is read, not run.

    Raises:
        RuntimeError: when a torchrun run fails (its log named).
    """
    subset = out / "data" / f"subset_{run.samples}.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in records[: run.samples])
    if not subset.is_file() or subset.read_text() != text:
        subset.parent.mkdir(parents=True, exist_ok=True)
        subset.write_text(text)
    run_dir = out / "runs" / run.name
    job = _run_job(cfg, run, subset, run_dir, settings.val_samples)
    data_sha = hashlib.sha256(text.encode()).hexdigest()
    done = run_dir / "result.json"
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved.get("job") == job and saved.get("data_sha256") == data_sha:
            return RunResult(Observation.from_dict(saved["observation"]), run.steps, run.steps * run.batch,
                             saved["cpu_s"], saved["wall_s"], True)
    path = write_job_toml(job, run_dir / "job.toml")
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    train_job(path, run_dir / "train.log", settings.nproc, train)
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    obs = _observe(run, run_dir, settings.fraction)
    done.write_text(json.dumps({"job": job, "data_sha256": data_sha, "observation": obs.to_dict(), "cpu_s": cpu,
                                "wall_s": wall}, indent=1))
    return RunResult(obs, run.steps, run.steps * run.batch, cpu, wall, False)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its waited-for children, all threads."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def train_job(job: Path, log: Path, nproc: int, train: TrainVerb | None = None) -> None:
    """Train the job file ``job`` with ``plait train --overwrite``: here (``nproc`` 1, by ``train``, output to
    ``log``) or under torchrun with ``nproc`` processes.

    Raises:
        RuntimeError: naming ``log`` when torchrun fails; ValueError when ``nproc`` is 1 and ``train`` is None.
    """
    if nproc == 1:
        if train is None:
            raise ValueError("a calibration run in this process needs plait train's function (train=...)")
        with log.open("w") as f, contextlib.redirect_stdout(f):
            train(job, [], overwrite=True)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "plait.cli", "train", "--config", str(job), "--overwrite"]  # --standalone: a free local rendezvous port
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"calibration run {job.parent.name} failed (exit {proc.returncode}); see {log}")


def _fit(observations: Sequence[Observation], modules: Sequence[str]) -> tuple[dict[str, PowerLaw], dict[str, PowerLaw]]:
    """Law-C (convergence samples; rank exponent varying with the data size) and Law-P (validation loss) of every
    module from its observations."""
    conv, perf = {}, {}
    for m in modules:
        obs = [o for o in observations if o.module == m]
        d, r = [o.samples for o in obs], [o.rank for o in obs]
        conv[m] = fit_power_law(d, r, [o.convergence for o in obs], rank_by_data=True)
        perf[m] = fit_power_law(d, r, [o.val_loss for o in obs])
    return conv, perf


def plot_laws(observations: Sequence[Observation], conv: dict[str, PowerLaw], perf: dict[str, PowerLaw],
              full: int, path: Path) -> Path:
    """``laws.png``: per module, Law-C and Law-P against rank (log-log), the observations as dots per subset size
    and the fitted law as lines, plus the law's prediction at the full data size (dashed)."""
    modules = list(conv)
    fig, axes = new_figure(10, 2.8 * 2 * len(modules), nrows=2 * len(modules), sharex=False)
    ranks = sorted({o.rank for o in observations})
    grid = np.geomspace(min(ranks), max(ranks), 50)
    for k, m in enumerate(modules):
        for ax, law, key, label in ((axes[2 * k], conv[m], "convergence", "convergence (samples)"),
                                    (axes[2 * k + 1], perf[m], "val_loss", "final val loss")):
            sizes = sorted({o.samples for o in observations if o.module == m})
            for d in sizes:
                pts = [(o.rank, getattr(o, key)) for o in observations if o.module == m and o.samples == d]
                line = ax.plot(grid, [law.predict(d, r) for r in grid], lw=1)[0]
                ax.scatter(*zip(*pts), color=line.get_color(), label=f"D={d}")
            ax.plot(grid, [law.predict(full, r) for r in grid], "k--", lw=1, label=f"D={full} (predicted)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("LoRA rank")
            ax.set_ylabel(label)
            ax.set_title(f"{m}: {law.describe('t' if key == 'convergence' else 'v')}", fontsize=8)
            ax.legend(fontsize=7)
    return save_figure(fig, path)


def _report(conv: dict[str, PowerLaw], perf: dict[str, PowerLaw], choice: RankChoice, results: Sequence[RunResult],
            full: int, base: float) -> str:
    """The lines printed for people: laws with fit quality, kept combinations with their Law-P scores (``base``: the
    untuned model's loss), the measured calibration losses, compute, the choice."""
    lines = [f"plait tune-ranks: laws (D = training samples, r = rank; full data D = {full})"]
    for m in conv:
        lines.append(f"  {m:>8} Law-C {conv[m].describe('t')}")
        lines.append(f"  {m:>8} Law-P {perf[m].describe('v')}")
        lines.append(f"  {m:>8} residuals t: " + " ".join(f"{x:+.3g}" for x in conv[m].residuals)
                     + " | v: " + " ".join(f"{x:+.3g}" for x in perf[m].residuals))
    if len({o.samples for r in results for o in [r.observation]}) < 3:
        lines.append("  note: with 2 subset sizes each law's offset, scale and data exponent are fitted to 2 data sizes, so "
                     "an R^2 near 1 says little and the extrapolation to the full data is uncertain; give 3 or more "
                     "--sizes")
    lines.append(f"kept rank combinations (aligned convergence; Law-P score: each module's fitted validation loss at "
                 f"D = {full} over the untuned loss {base:.4f}, multiplied, times {base:.4f}; lower is better; it ranks "
                 "the combinations and is not a forecast of the fine-tune's validation loss):")
    for combo, loss in zip(choice.combos, choice.predicted_loss):
        ranks = ", ".join(f"{m}={r}" for m, r in combo.ranks.items())
        times = ", ".join(f"{m} {t:.0f}" for m, t in combo.times.items())
        lines.append(f"  {ranks}: times {times} samples (mismatch x{combo.mismatch:.2f}), Law-P score {loss:.4f}")
    measured = [r.observation.val_loss for r in results]
    lines.append(f"measured: the calibration runs' final validation losses (one module training, D <= "
                 f"{max(r.observation.samples for r in results)}) range {min(measured):.4f} to {max(measured):.4f}")
    ran = [r for r in results if not r.resumed]
    lines.append(f"calibration: {len(results)} runs ({len(results) - len(ran)} found on disk), "
                 f"{sum(r.steps for r in results)} steps, {sum(r.samples for r in results)} samples, "
                 f"{sum(r.cpu_s for r in results):.0f} CPU s")
    lines.append("chosen: " + ", ".join(f"{m}={r}" for m, r in choice.chosen.items()))
    return "\n".join(lines)


def tune_ranks_command(config: str | Path, overrides: Sequence[str] = (), settings: SearchSettings = SearchSettings(),
                       out_dir: str | Path | None = None, train: TrainVerb | None = None) -> dict[str, Any]:
    """``plait tune-ranks``: calibrate, fit, prune, choose; print and write the results (module docstring). Runs
    of one process train in this process by ``train`` (:data:`TrainVerb`).

    Returns:
        The content of ``search.json`` (``chosen``: module -> rank; ``toml``: the tables; ``observations``,
        ``laws``, ``combos``, ``predicted_loss``, ``compute``).

    Raises:
        ValueError: on a job without LoRA on the LLM and an encoder, without ``data.val``, with a non-JSONL
            ``data.train``, or on bad settings (as :func:`~plait.planner.ranks.rank_law.plan_calibration`).
    """
    cfg = load_config(config, list(overrides))
    modules = lora_modules(cfg)
    if not cfg.data.val:
        raise ValueError("plait tune-ranks needs data.val in the job: Law-P predicts the validation loss")
    if cfg.data.sources:
        raise ValueError("plait tune-ranks draws subsets from data.train; a [[data.sources]] mixture is not supported")
    out = Path(out_dir) if out_dir else Path(cfg.metrics.run_dir) / "tune_ranks"
    records = subset_records(cfg.data.train, cfg.train.seed)
    full = len(records)
    sizes = settings.sizes or (max(1, full // 8), max(2, full // 4))
    batch = settings.batch or cfg.train.global_batch_size
    runs = plan_calibration(modules, settings.ranks, sizes, settings.epochs, batch, full, settings.budget)
    bar = Progress(len(runs), "calibration runs", "run")
    results = []
    for run in runs:
        results.append(run_calibration(cfg, run, records, out, settings, train))
        bar.update(1)
    bar.close()
    observations = [r.observation for r in results]
    conv, perf = _fit(observations, modules)
    base = float(np.mean([o.first_loss for o in observations]))
    choice = choose_ranks(conv, perf, settings.ranks, full, base, settings.tolerance)
    job = config_to_dict(cfg)["model"]
    lora = {m: lora_at_rank((job["llm"] if m == LLM_MODULE else job["encoders"][m])["lora"], r)
            for m, r in choice.chosen.items()}
    toml = lora_toml(choice.chosen, lora)
    png = plot_laws(observations, conv, perf, full, out / "laws.png")
    (out / "ranks.toml").write_text(toml)
    compute = {"runs": len(results), "steps": sum(r.steps for r in results),
               "samples": sum(r.samples for r in results), "cpu_s": sum(r.cpu_s for r in results),
               "wall_s": sum(r.wall_s for r in results), "resumed": sum(r.resumed for r in results)}
    search = {"chosen": choice.chosen, "toml": toml, "full_samples": full, "base_loss": base,
              "observations": [o.to_dict() for o in observations],
              "laws": {m: {"convergence": conv[m].to_dict(), "performance": perf[m].to_dict()} for m in modules},
              "combos": [c.to_dict() for c in choice.combos], "predicted_loss": list(choice.predicted_loss),
              "compute": compute}
    (out / "search.json").write_text(json.dumps(search, indent=1))
    print(_report(conv, perf, choice, results, full, base))
    print(f"plait: laws plotted to {png}; search written to {out / 'search.json'}")
    print(f"plait: chosen LoRA ranks (also in {out / 'ranks.toml'}); replace the job's tables with:\n\n{toml}")
    return search
