"""How plait's data path scales with the number of records (issue 13).

For each size (``--sizes``, default 10k records; the issue's figures are for 10k, 100k and 1M) and each format
(``--formats``) a synthetic dataset is written: the demo set's conversations cycled with fresh ids, with a few
hundred of the demo's real image and audio files (``--media``): referenced by path in JSONL, embedded as bytes
in Parquet (``plait.data.formats.arrow.write_parquet``, row groups of 256 rows). Then, each in a fresh process:

* the metadata pass cold (cache emptied) with ``--workers`` worker processes, and warm (from the cache), on the
  demo job's processor (``configs/demo.toml``);
* a training process on the demo model (warm cache): its peak RSS after building and during the first
  ``--steps`` steps, and per step the loader wait (``data_wait_s`` in metrics.jsonl) against the step time.

Targets (2 cores): 1M records' cold pass under 10 minutes with 2 workers, warm start under 30 s, peak RSS growth
from 10k to 1M records under 300 MB, loader wait under 5% of the step time.

    python bench/data_scale.py --sizes 10000 100000 1000000 --out runs/bench_data_scale

``--loader-sweep`` measures instead the loader wait of the demo job itself (``data/demo/train.jsonl``) over
``--steps`` steps for each ``data.num_workers`` x ``data.prefetch`` pair (``--sweep-workers``, ``--sweep-prefetch``),
with the wait split into the first ``--warmup`` steps, the steps right after an epoch boundary and the rest:

    python bench/data_scale.py --loader-sweep --steps 80 --out runs/bench_loader_wait
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


def write_parquet_dataset(path: Path, size: int, media: int, chunk: int = 5_000) -> None:
    """The records of :func:`write_dataset` as one Parquet file with the media bytes embedded, written ``chunk``
    records at a time (each chunk through ``write_parquet``, then appended; row groups of 256 rows)."""
    import pyarrow.parquet as pq

    from plait.data.formats.arrow import write_parquet

    jsonl = path.with_suffix(".jsonl")
    write_dataset(jsonl, size, media)
    part = path.with_suffix(".part.parquet")
    writer = None
    with jsonl.open() as f:
        while True:
            records = [json.loads(line) for _, line in zip(range(chunk), f)]
            if not records:
                break
            table = pq.read_table(write_parquet(records, part, base_dir="/"))
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=256)
    writer.close()
    part.unlink()
    jsonl.unlink()


def job_dict(train: Path, run_dir: Path, cache: Path, workers: int, steps: int, prefetch: int | None = None) -> dict:
    """The demo job on ``train``, without validation, training ``steps`` steps."""
    from plait.config.loader import read_config_data

    data = read_config_data(JOB)
    data["data"].update(train=str(train), val=None, tokenizer=str(DEMO / "tokenizer"), num_workers=workers,
                        metadata_cache=str(cache))
    if prefetch is not None:
        data["data"]["prefetch"] = prefetch
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
    from plait.parallel.process_group import DistInfo
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
            "wait_s": [r["data_wait_s"] for r in rows], "step_s": step_s, "epoch": [r["epoch"] for r in rows]}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(kind: str, job: dict, out: Path, one_thread: bool = True) -> dict:
    """Run ``child_<kind>`` in a fresh process (its own peak RSS), with one intra-op thread or (``one_thread``
    False) torch's default, as ``plait train`` runs; its JSON result."""
    job_path = out / f"{kind}_job.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(job_path)], env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def wait_summary(res: dict, warmup: int) -> dict:
    """The loader wait of a training child's steps: median and mean over the steps after the first ``warmup``
    (``warmup`` >= 1), and the mean (ms) of the first ``warmup`` steps and of the steps opening an epoch."""
    waits, steps = res["wait_s"], res["step_s"]
    late = waits[warmup:] or waits[1:] or waits
    late_steps = steps[warmup:] or steps
    epoch = res["epoch"]  # after each step's batch was drawn: it changes on an epoch's last step
    opening = [w for k, w in enumerate(waits) if k >= max(warmup, 2) and epoch[k - 1] != epoch[k - 2]]
    return {"median_over_step": statistics.median(late) / statistics.median(late_steps),
            "mean_over_step": statistics.mean(late) / statistics.mean(late_steps),
            "median_wait_ms": statistics.median(late) * 1e3, "mean_wait_ms": statistics.mean(late) * 1e3,
            "max_wait_ms": max(late) * 1e3, "step_ms": statistics.mean(late_steps) * 1e3,
            "warmup_wait_ms": statistics.mean(waits[:warmup] or [0.0]) * 1e3,
            "epoch_open_wait_ms": statistics.mean(opening) * 1e3 if opening else None}


def scale_run(fmt: str, size: int, args: argparse.Namespace, out: Path) -> dict:
    """Write the ``fmt`` dataset of ``size`` records; its metadata pass (cold, warm) and training children."""
    folder = out / f"{fmt}_n{size}"
    folder.mkdir(exist_ok=True)
    data = folder / f"train.{fmt}"
    start = time.perf_counter()
    (write_dataset if fmt == "jsonl" else write_parquet_dataset)(data, size, args.media)
    print(f"{fmt}: {size} records written in {time.perf_counter() - start:.1f} s "
          f"({data.stat().st_size / 1e6:.0f} MB)", flush=True)
    job = job_dict(data, folder / "run", folder / "cache", args.workers, args.steps)
    res = run_child("pass", job, folder)
    print(f"  metadata pass ({args.workers} workers): cold {res['cold_s']:.1f} s "
          f"({res['records'] / res['cold_s']:.0f} records/s), warm {res['warm_s']:.2f} s", flush=True)
    res.update(run_child("train", job, folder))
    res.update(wait_summary(res, 1))  # the first step also waits for the workers to start
    print(f"  training: build {res['build_s']:.1f} s (warm cache), peak RSS {res['rss_built_mb']:.0f} MB built, "
          f"{res['rss_peak_mb']:.0f} MB after {args.steps} steps; loader wait per step: median "
          f"{res['median_wait_ms']:.1f} ms of {res['step_ms']:.0f} ms ({res['median_over_step']:.1%}), "
          f"mean {res['mean_over_step']:.1%}", flush=True)
    return res


def loader_sweep(args: argparse.Namespace, out: Path) -> dict:
    """The demo job's loader wait for each (workers, prefetch) of the sweep (module docstring)."""
    results = {}
    for workers in args.sweep_workers:
        for prefetch in args.sweep_prefetch:
            folder = out / f"w{workers}_p{prefetch}"
            folder.mkdir(exist_ok=True)
            job = job_dict(DEMO / "train.jsonl", folder / "run", out / "cache", workers, args.steps, prefetch)
            res = run_child("train", job, folder, one_thread=False)  # as plait train runs the demo
            res.update(wait_summary(res, args.warmup))
            opening = res["epoch_open_wait_ms"]
            print(f"workers {workers} prefetch {prefetch}: wait after {args.warmup} steps median "
                  f"{res['median_wait_ms']:.1f} ms, mean {res['mean_wait_ms']:.1f} ms, max {res['max_wait_ms']:.0f} "
                  f"ms of {res['step_ms']:.0f} ms a step (median {res['median_over_step']:.1%}, mean "
                  f"{res['mean_over_step']:.1%}); first {args.warmup} steps {res['warmup_wait_ms']:.0f} ms; "
                  f"epoch openings {'-' if opening is None else f'{opening:.0f} ms'}", flush=True)
            results[f"w{workers}_p{prefetch}"] = res
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000])
    ap.add_argument("--formats", nargs="+", default=["jsonl", "parquet"], choices=["jsonl", "parquet"])
    ap.add_argument("--media", type=int, default=300, help="distinct image and audio files referenced")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="runs/bench_data_scale")
    ap.add_argument("--loader-sweep", action="store_true", help="the demo job's loader wait per workers x prefetch")
    ap.add_argument("--sweep-workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sweep-prefetch", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the sweep's wait figures")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path = args.child
        result = {"pass": child_pass, "train": child_train}[kind](json.loads(Path(path).read_text()))
        print(json.dumps(result))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.loader_sweep:
        (out / "results.json").write_text(json.dumps(loader_sweep(args, out), indent=2))
        return
    results = {fmt: {size: scale_run(fmt, size, args, out) for size in args.sizes} for fmt in args.formats}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    for fmt, by_size in results.items():
        sizes = sorted(by_size)
        if len(sizes) > 1:
            growth = by_size[sizes[-1]]["rss_peak_mb"] - by_size[sizes[0]]["rss_peak_mb"]
            print(f"{fmt}: peak RSS growth {sizes[0]} -> {sizes[-1]} records: {growth:.0f} MB (target < 300 MB)")


if __name__ == "__main__":
    main()
