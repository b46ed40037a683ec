"""MARS rank search vs a full grid on the demo fine-tuning task (digit_pair, configs/demo_match.toml).

Candidates: the same ranks for the vision encoder and the LLM (default 2, 8, 32). Every run keeps the job's adapter
scale ``alpha / r`` (:func:`plait.planner.ranks.rank_law.lora_at_rank`). Three sides, one run:

- **grid**: every (vision rank, LLM rank) pair fine-tuned with the job's own settings (``train.steps`` steps on the
  whole ``match_train.jsonl``), validation loss and exact match on ``match_val.jsonl`` (train/evaluation.py);
  its best pair by accuracy (ties: lower loss).
- **uniform**: the same rank for both modules, the common default ``r = 8`` (peft's default), read from the grid;
  the best diagonal pair is printed too.
- **MARS**: ``plait tune-ranks`` on the job (calibration runs on three subset sizes, Law-C, pruning, Law-P), its
  chosen pair's full fine-tune read from the grid (same candidates, so the grid holds it).

Compute: train steps, training samples and CPU seconds (this process and its children, all threads) of MARS's
calibration against the whole grid's. Targets (issue 15): MARS within 1 point of the grid's best accuracy at >= 5x
less search compute, and >= the uniform default.

Needs the demo's trained model ``runs/demo/final`` (``make demo``). Runs are kept under ``--out`` (default
``runs/bench_mars``) and found again by a later run of the bench (delete the folder to measure afresh; the compute
figures of runs found on disk are the ones recorded when they ran). Run from the repository root:
``.venv/bin/python bench/mars.py`` (``--help``: ranks, sizes, steps, out folder). About 400 CPU seconds, one core
(9 fine-tunes of 100 steps of 8 on 800 training records, 18 calibration runs of 8-32 steps of 4); ``grid.png`` draws
the grid's accuracy and loss. Runs found on disk are not run again, so grid pairs may be run ahead by other processes
with :func:`grid_run` on the same ``--out`` (the figures are the same).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plait.commands.tune_ranks import (  # noqa: E402
    SearchSettings, cpu_seconds, subset_records, train_job, tune_ranks_command, write_job_toml)
from plait.config.loader import config_to_dict, load_config  # noqa: E402
from plait.planner.ranks.rank_law import lora_at_rank  # noqa: E402
from plait.train.metrics import read_metrics  # noqa: E402
from plait.train.plots import new_figure, save_figure  # noqa: E402


def grid_run(cfg, r_vision: int, r_llm: int, out: Path) -> dict:
    """Fine-tune one pair with the job's settings (or read its ``result.json``): val loss, exact match, compute."""
    run_dir = out / "grid" / f"vision{r_vision}_llm{r_llm}"
    job = config_to_dict(cfg)
    vision, llm = job["model"]["encoders"]["vision"], job["model"]["llm"]
    vision["lora"], llm["lora"] = lora_at_rank(vision["lora"], r_vision), lora_at_rank(llm["lora"], r_llm)
    job["metrics"].update(run_dir=str(run_dir.resolve()), progress=False, tensorboard=False)
    done = run_dir / "result.json"
    if done.is_file() and json.loads(done.read_text()).get("job") == job:
        return json.loads(done.read_text())
    path = write_job_toml(job, run_dir / "job.toml")
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    train_job(path, run_dir / "train.log", 1)
    rows = read_metrics(run_dir / "metrics.jsonl")
    last = [r for r in rows if "val_loss" in r][-1]
    result = {"job": job, "r_vision": r_vision, "r_llm": r_llm, "val_loss": last["val_loss"],
              "accuracy": last["exact_match"], "steps": cfg.train.steps,
              "samples": cfg.train.steps * cfg.train.global_batch_size,
              "cpu_s": cpu_seconds() - cpu0, "wall_s": time.perf_counter() - wall0}
    done.write_text(json.dumps(result, indent=1))
    return result


def _smaller_job(cfg, records: int, batch: int, out: Path) -> Path:
    """The job (``cfg``) written to ``out/job.toml``; with ``records`` > 0 on the first ``records`` training records
    (``subset_records``' shuffle) for one epoch of ``batch`` samples per step (default: the job's)."""
    job = config_to_dict(cfg)
    if records:
        batch = batch or cfg.train.global_batch_size
        data = out / f"train_{records}.jsonl"
        text = "".join(json.dumps(r) + "\n" for r in subset_records(cfg.data.train, cfg.train.seed)[:records])
        if not data.is_file() or data.read_text() != text:  # unchanged: left alone for runs that read it now
            data.parent.mkdir(parents=True, exist_ok=True)
            data.write_text(text)
        job["data"]["train"] = str(data.resolve())
        job["train"].update(steps=math.ceil(records / batch), global_batch_size=batch,
                            microbatch_size=min(batch, job["train"]["microbatch_size"]))
    return write_job_toml(job, out / "job.toml")


def plot_grid(grid: dict, ranks: tuple[int, ...], path: Path) -> Path:
    """``grid.png``: exact match (%) and validation loss of every (vision rank, LLM rank) pair as two heat maps."""
    fig, axes = new_figure(4.5, 7, nrows=2, sharex=False)
    for ax, key, scale, fmt in ((axes[0], "accuracy", 100, "{:.1f}%"), (axes[1], "val_loss", 1, "{:.4f}")):
        values = [[scale * grid[(rv, rl)][key] for rl in ranks] for rv in ranks]
        ax.imshow(values, cmap="YlGn" if key == "accuracy" else "YlGn_r")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
        ax.set_xlabel("LLM rank")
        ax.set_ylabel("vision rank")
        ax.set_title("exact match" if key == "accuracy" else "validation loss", fontsize=9)
    return save_figure(fig, path)


def _row(name: str, res: dict) -> str:
    return (f"{name:<26} vision r={res['r_vision']:<3} llm r={res['r_llm']:<3} accuracy {100 * res['accuracy']:5.1f}%  "
            f"val loss {res['val_loss']:.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo_match.toml"))
    p.add_argument("--ranks", default="2,8,32")
    p.add_argument("--sizes", default="32,64,128", help="MARS calibration subset sizes (samples)")
    p.add_argument("--calib-batch", type=int, default=4, help="global batch of the calibration runs")
    p.add_argument("--val-samples", type=int, default=48, help="validation records per calibration run")
    p.add_argument("--uniform", type=int, default=8, help="the uniform default rank")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_mars"))
    p.add_argument("--train-records", type=int, default=800,
                   help="fine-tune on the first N records of the job's training set (the fixed shuffle tune-ranks "
                        "draws its subsets from), one epoch (800: 100 steps of 8, where accuracy still rises); 0: the "
                        "job as it is")
    p.add_argument("--batch", type=int, default=8, help="with --train-records: global batch of the fine-tunes")
    p.add_argument("--pretrained", default="", help="the trained demo to fine-tune (default: the job's, runs/demo/final)")
    a = p.parse_args(argv)
    ranks = tuple(int(x) for x in a.ranks.split(","))
    out = Path(a.out)
    if a.uniform not in ranks:
        print(f"--uniform {a.uniform} is not one of --ranks {a.ranks}", file=sys.stderr)
        return 2
    if a.train_records or a.pretrained:
        overrides = [f"--model.pretrained={a.pretrained}"] if a.pretrained else []
        a.config = str(_smaller_job(load_config(a.config, overrides), a.train_records, a.batch, out))
    cfg = load_config(a.config)
    if not (Path(cfg.model.pretrained) / "plait_config.json").is_file():
        print(f"bench/mars.py needs {cfg.model.pretrained} (run `make demo` first)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    settings = SearchSettings(ranks=ranks, sizes=tuple(int(x) for x in a.sizes.split(",")), batch=a.calib_batch,
                              val_samples=a.val_samples)
    search = tune_ranks_command(a.config, (), settings, out / "mars")
    t_mars = time.perf_counter() - t0
    pairs = [(rv, rl) for rv in ranks for rl in ranks]
    grid = {(rv, rl): grid_run(cfg, rv, rl, out) for rv, rl in tqdm(pairs, desc="grid runs", unit="run", file=sys.stderr)}
    best = max(grid.values(), key=lambda r: (r["accuracy"], -r["val_loss"]))
    uniform = grid[(a.uniform, a.uniform)]
    best_uniform = max((grid[(r, r)] for r in ranks), key=lambda r: (r["accuracy"], -r["val_loss"]))
    mars = grid[(search["chosen"]["vision"], search["chosen"]["llm"])]
    calib, gsteps = search["compute"], sum(r["steps"] for r in grid.values())
    gsamples, gcpu = sum(r["samples"] for r in grid.values()), sum(r["cpu_s"] for r in grid.values())
    plot_grid(grid, ranks, out / "grid.png")
    print(f"\n== MARS vs grid on {Path(cfg.data.train).name} (exact match and loss on {Path(cfg.data.val).name}, "
          f"{cfg.data.val_max_samples or 'all'} records) ==")
    print(f"grid of {len(grid)} pairs: accuracy by (vision r, llm r):")
    print("vision\\llm " + "".join(f"{r:>8}" for r in ranks))
    for rv in ranks:
        print(f"{rv:>10} " + "".join(f"{100 * grid[(rv, rl)]['accuracy']:7.1f}%" for rl in ranks))
    print("val loss by (vision r, llm r):")
    for rv in ranks:
        print(f"{rv:>10} " + "".join(f"{grid[(rv, rl)]['val_loss']:8.4f}" for rl in ranks))
    print(_row("MARS (chosen pair)", mars))
    print(_row("grid best", best))
    print(_row(f"uniform default r={a.uniform}", uniform))
    print(_row("best uniform (diagonal)", best_uniform))
    print(f"search compute: MARS calibration {calib['runs']} runs, {calib['steps']} steps, {calib['samples']} samples, "
          f"{calib['cpu_s']:.0f} CPU s | grid {len(grid)} runs, {gsteps} steps, {gsamples} samples, {gcpu:.0f} CPU s "
          f"| grid / MARS: {gsamples / calib['samples']:.1f}x samples, {gcpu / max(calib['cpu_s'], 1e-9):.1f}x CPU s")
    print(f"MARS including its one fine-tune of the chosen pair: {calib['samples'] + mars['samples']} samples, "
          f"{calib['cpu_s'] + mars['cpu_s']:.0f} CPU s ({gcpu / (calib['cpu_s'] + mars['cpu_s']):.1f}x less CPU than the grid)")
    gap = 100 * (best["accuracy"] - mars["accuracy"])
    print(f"targets: MARS within 1 point of grid best: {'yes' if gap <= 1 else 'no'} ({gap:+.1f} points behind); "
          f">= 5x less compute: {'yes' if gsamples >= 5 * calib['samples'] and gcpu >= 5 * calib['cpu_s'] else 'no'}; "
          f">= uniform r={a.uniform}: {'yes' if mars['accuracy'] >= uniform['accuracy'] else 'no'}")
    print(f"bench wall time {time.perf_counter() - t0:.0f} s (MARS search {t_mars:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
