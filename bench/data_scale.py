"""How plait's data path scales with the number of records (issue 13).

For each size (``--sizes``, default 10k, 100k and 1M records) a synthetic JSONL dataset is written: the demo
set's conversations cycled with fresh ids, referencing a few hundred of the demo's real image and audio files
(``--media``). Then, each in a fresh process:

* the metadata pass cold (cache emptied) with ``--workers`` worker processes, and warm (from the cache), on the
  demo job's processor (``configs/demo.toml``);
* a training process on the demo model (warm cache): its peak RSS after building and during the first
  ``--steps`` steps, and per step the loader wait (``data_wait_s`` in metrics.jsonl) against the step time.

Targets (2 cores): 1M records' cold pass under 10 minutes with 2 workers, warm start under 30 s, peak RSS growth
from 10k to 1M records under 300 MB, loader wait under 5% of the step time.

    python bench/data_scale.py --sizes 10000 100000 1000000 --out runs/bench_data_scale
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
JOB = ROOT / "configs" / "demo.toml"


def write_dataset(path: Path, size: int, media: int) -> None:
    """``size`` records: the demo's train records cycled, ids made unique, media remapped onto the first
    ``media`` image and ``media`` audio files the demo set references (absolute paths)."""
    base = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    images = sorted({p for r in base for p in r["images"]})[:media]
    audios = sorted({p for r in base for p in r["audios"]})[:media]
    with path.open("w") as f:
        for i in range(size):
            rec = dict(base[i % len(base)])
            rec["id"] = f"r{i}"
            rec["images"] = [str(DEMO / images[(i + k) % len(images)]) for k, _ in enumerate(rec["images"])]
            rec["audios"] = [str(DEMO / audios[(i + k) % len(audios)]) for k, _ in enumerate(rec["audios"])]
            f.write(json.dumps(rec) + "\n")


def job_dict(train: Path, run_dir: Path, cache: Path, workers: int, steps: int) -> dict:
    """The demo job on ``train``, without validation, training ``steps`` steps."""
    from plait.config.loader import read_config_data

    data = read_config_data(JOB)
    data["data"].update(train=str(train), val=None, tokenizer=str(DEMO / "tokenizer"), num_workers=workers,
                        metadata_cache=str(cache))
    data["train"].update(steps=steps, eval_every=0)
    data["checkpoint"] = {"every": 0, "keep": 1}
    data["metrics"] = {"run_dir": str(run_dir), "log_every": 1, "progress": False, "tensorboard": False}
    return data


def child_pass(job: dict) -> dict:
    """Metadata pass cold then warm in this process: seconds each, records and skipped."""
    from plait.config.loader import config_from_dict
    from plait.data.chat_template import tokenizer_dir
    from plait.data.formats import open_source
    from plait.data.metadata import metadata_pass
    from plait.models.registry import build_model, build_processor, load_tokenizer

    cfg = config_from_dict(job)
    tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
    model = build_model(cfg.model, tokenizer, device="meta")
    processor = build_processor(cfg.model, model, tokenizer, cfg.data.max_length)
    source = open_source(cfg.data.train)
    shutil.rmtree(cfg.data.metadata_cache, ignore_errors=True)
    start = time.perf_counter()
    table = metadata_pass(source, processor, workers=cfg.data.num_workers, cache_dir=cfg.data.metadata_cache)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    metadata_pass(open_source(cfg.data.train), processor, workers=cfg.data.num_workers,
                  cache_dir=cfg.data.metadata_cache)
    warm = time.perf_counter() - start
    return {"records": len(source), "usable": len(table), "skipped": len(table.skipped), "cold_s": cold,
            "warm_s": warm}


def child_train(job: dict) -> dict:
    """Build the demo trainer (warm cache) and train; peak RSS (MB) after the build and after the steps, the
    build time, and per step the loader wait and the step time (s)."""
    from plait.config.loader import config_from_dict
    from plait.parallel.mesh import DistInfo
    from plait.train.trainer import Trainer

    import torch

    start = time.perf_counter()
    trainer = Trainer.build(config_from_dict(job), DistInfo(0, 1, 0, torch.device("cpu")))
    build_s = time.perf_counter() - start
    rss_built = _peak_rss_mb()
    trainer.fit(overwrite=True)
    rows = [json.loads(line) for line in (Path(job["metrics"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    elapsed = [r["elapsed_s"] for r in rows]
    step_s = [b - a for a, b in zip(elapsed, elapsed[1:])]
    return {"build_s": build_s, "rss_built_mb": rss_built, "rss_peak_mb": _peak_rss_mb(),
            "wait_s": [r["data_wait_s"] for r in rows], "step_s": step_s}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(kind: str, job: dict, out: Path) -> dict:
    """Run ``child_<kind>`` in a fresh process (its own peak RSS); its JSON result."""
    job_path = out / f"{kind}_job.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(job_path)], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--media", type=int, default=300, help="distinct image and audio files referenced")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="runs/bench_data_scale")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path = args.child
        result = {"pass": child_pass, "train": child_train}[kind](json.loads(Path(path).read_text()))
        print(json.dumps(result))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for size in args.sizes:
        folder = out / f"n{size}"
        folder.mkdir(exist_ok=True)
        data = folder / "train.jsonl"
        start = time.perf_counter()
        write_dataset(data, size, args.media)
        print(f"{size} records written in {time.perf_counter() - start:.1f} s ({data.stat().st_size / 1e6:.0f} MB)",
              flush=True)
        job = job_dict(data, folder / "run", folder / "cache", args.workers, args.steps)
        res = run_child("pass", job, folder)
        print(f"  metadata pass ({args.workers} workers): cold {res['cold_s']:.1f} s "
              f"({res['records'] / res['cold_s']:.0f} records/s), warm {res['warm_s']:.2f} s", flush=True)
        res.update(run_child("train", job, folder))
        waits = res["wait_s"][1:] or res["wait_s"]  # the first step also waits for the workers to start
        wait, step = statistics.median(waits), statistics.median(res["step_s"])
        res["wait_over_step"] = wait / step
        res["mean_wait_over_step"] = statistics.mean(waits) / statistics.mean(res["step_s"])
        print(f"  training: build {res['build_s']:.1f} s (warm cache), peak RSS {res['rss_built_mb']:.0f} MB built, "
              f"{res['rss_peak_mb']:.0f} MB after {args.steps} steps; loader wait per step: median {wait * 1e3:.1f} "
              f"ms of {step * 1e3:.0f} ms ({res['wait_over_step']:.1%}), mean {res['mean_wait_over_step']:.1%}",
              flush=True)
        results[size] = res
    (out / "results.json").write_text(json.dumps(results, indent=2))
    sizes = sorted(results)
    if len(sizes) > 1:
        growth = results[sizes[-1]]["rss_peak_mb"] - results[sizes[0]]["rss_peak_mb"]
        print(f"peak RSS growth {sizes[0]} -> {sizes[-1]} records: {growth:.0f} MB (target < 300 MB)")


if __name__ == "__main__":
    main()
