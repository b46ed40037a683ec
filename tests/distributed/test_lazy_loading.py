"""Lazy loading under DP=2 (gloo, two spawned processes): batches and losses bit-identical to the eager path on
every rank; a corrupt image found only at load time is dropped by both ranks alike (no hang), counted and
reported, or stops both with its record, file and line under data.on_error = "raise".

The three jobs run in one spawn of the two processes (one interpreter start, import and process group for all,
``dp2_runs``), one after the other, each in its own folder; each test checks its own job's results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.jobs import DEMO, demo_records, tiny_config_dict, write_jsonl
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait

STEPS = int(os.environ.get("PLAIT_LAZY_STEPS", "4"))
"""Steps compared (the acceptance figure is 50: PLAIT_LAZY_STEPS=50)."""


def _build(cfg_dict: dict, rank: int, world: int):
    from plait.config.loader import config_from_dict
    from plait.parallel.process_group import DistInfo
    from plait.train.trainer import Trainer

    return Trainer.build(config_from_dict(cfg_dict), DistInfo(rank, world, rank, torch.device("cpu")))


def _equivalence_job(rank: int, world: int, cfg_dict: dict, folder: str) -> None:
    from tests.unit.data.lazy_reference import eager_run, record_batches

    lazy = _build(cfg_dict, rank, world)
    lazy_batches = record_batches(lazy)
    losses = lazy.fit()["losses"]
    eager = _build(cfg_dict, rank, world)
    eager_batches = record_batches(eager)
    eager_losses = eager_run(eager, len(losses))
    torch.save({"lazy": (losses, lazy_batches), "eager": (eager_losses, eager_batches)},
               Path(folder, f"rank{rank}.pt"))


def _corrupt_job(rank: int, world: int, cfg_dict: dict, folder: str) -> None:
    from plait.data.sources import SampleError

    trainer = _build(cfg_dict, rank, world)
    try:
        result = trainer.fit()
        out = {"losses": result["losses"], "dropped": [vars(s) for s in trainer.dropped]}
    except SampleError as exc:
        out = {"error": str(exc)}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


def _worker(rank: int, world: int, port: int, jobs: list[tuple[str, dict, str]]) -> None:
    """One DP rank: every ``(kind, job, folder)`` of ``jobs`` in order ("equivalence" or "corrupt"), in one
    gloo group (collectives time out after 60 s: a rank left waiting fails instead of hanging)."""
    run = {"equivalence": _equivalence_job, "corrupt": _corrupt_job}
    with gloo_group(rank, world, port, timeout_s=60):
        for kind, cfg_dict, folder in jobs:
            run[kind](rank, world, cfg_dict, folder)


def _job(tmp_path: Path, records: list[dict], steps: int = STEPS, **data) -> dict:
    path = write_jsonl(tmp_path / "train.jsonl", records)
    return tiny_config_dict(str(path), None, str(tmp_path / "run"),
                            data={"num_workers": 2, "metadata_cache": str(tmp_path / "cache"), **data},
                            train={"steps": steps, "global_batch_size": 4, "microbatch_size": 1, "threads": 1},
                            parallel={"timeout_s": 30})


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """The three DP=2 jobs, ``name: (folder, corrupt record or {})``, run by one spawn of two processes: lazy vs
    eager on 24 records, and 12 records with a truncated image under on_error "skip" and (last: it stops the
    trainers with an error) "raise"."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("equivalence", "skip", "raise")}
    jobs, corrupt = [("equivalence", _job(folders["equivalence"], demo_records("train", limit=24)),
                      str(folders["equivalence"]))], {}
    for name, extra in (("skip", {}), ("raise", {"shuffle": False})):
        recs, corrupt[name] = _corrupt_records(folders[name])
        jobs.append(("corrupt", _job(folders[name], recs, steps=3, on_error=name, **extra), str(folders[name])))
    spawn_and_wait(_worker, (2, free_port(), jobs), 2, 600, "DP=2 lazy vs eager, corrupt image (skip, raise)")
    return {name: (folder, corrupt.get(name, {})) for name, folder in folders.items()}


def test_dp2_lazy_batches_and_losses_equal_the_eager_path_on_every_rank(dp2_runs):
    from tests.unit.data.lazy_reference import assert_same_batches

    folder, _ = dp2_runs["equivalence"]
    losses = []
    for rank in range(2):
        got = torch.load(folder / f"rank{rank}.pt")
        assert got["lazy"][0] == got["eager"][0] and len(got["lazy"][0]) == STEPS
        assert_same_batches(got["lazy"][1], got["eager"][1])
        losses.append(got["lazy"][0])
    assert losses[0] == losses[1]


def _corrupt_records(tmp_path: Path) -> tuple[list[dict], dict]:
    data = (DEMO / "img" / "000005.png").read_bytes()
    bad = tmp_path / "truncated.png"
    bad.write_bytes(data[: len(data) // 2])  # the header reads (the metadata pass accepts it), the pixels do not
    recs = demo_records("train", limit=11)
    corrupt = {**demo_records("train", ("image_digit",), limit=12)[-1], "images": [str(bad)]}
    return recs[:5] + [corrupt] + recs[5:], corrupt


def test_dp2_drops_a_corrupt_image_found_at_load_time_on_both_ranks(dp2_runs):
    tmp_path, corrupt = dp2_runs["skip"]  # one epoch of 3 steps: the corrupt record comes once
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    where = f"{tmp_path / 'train.jsonl'}:6"
    for got in ranks:
        assert [(d["id"], d["source"]) for d in got["dropped"]] == [(corrupt["id"], where)]
        assert "cannot decode image" in got["dropped"][0]["reason"] and len(got["losses"]) == 3
    assert ranks[0]["losses"] == ranks[1]["losses"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("dropped_samples", 0) for r in rows) == 1


def test_dp2_on_error_raise_stops_both_ranks_naming_the_record(dp2_runs):
    tmp_path, corrupt = dp2_runs["raise"]
    where = f"{tmp_path / 'train.jsonl'}:6"
    for r in range(2):
        error = json.loads((tmp_path / f"rank{r}.json").read_text())["error"]
        assert error.startswith(f"step 2: record '{corrupt['id']}' ({where}): cannot decode image"), error
