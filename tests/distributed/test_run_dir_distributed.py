"""A new DP=2 run (gloo, two spawned processes) into a run folder holding an earlier run: both ranks refuse alike
(no rank left waiting), and with overwrite both train after rank 0 removed the earlier checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait


def _worker(rank: int, world: int, port: int, cfg_dict: dict, folder: str) -> None:
    import torch

    from plait.config.loader import config_from_dict
    from plait.parallel.process_group import DistInfo
    from plait.train.trainer import Trainer

    out = {}
    with gloo_group(rank, world, port, timeout_s=30):
        for overwrite in (False, True):
            trainer = Trainer.build(config_from_dict(cfg_dict), DistInfo(rank, world, rank, torch.device("cpu")))
            try:
                out[str(overwrite)] = {"steps": trainer.fit(overwrite=overwrite)["steps"]}
            except ValueError as exc:
                out[str(overwrite)] = {"error": str(exc)}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


def test_dp2_ranks_refuse_an_earlier_run_alike_and_overwrite_it_together(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000009").mkdir(parents=True)
    (run / "checkpoints" / "step_000009" / ".metadata").write_text("earlier run")
    data = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("text",), limit=4))
    cfg = tiny_config_dict(str(data), None, str(run), data={"num_workers": 0},
                           train={"steps": 1, "global_batch_size": 4, "microbatch_size": 1, "threads": 1},
                           parallel={"timeout_s": 30})
    spawn_and_wait(_worker, (2, free_port(), cfg, str(tmp_path)), 2, 240, "DP=2 earlier-run refusal")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["False"]["error"].startswith(f"{run} holds an earlier run (1 checkpoint(s), newest step_000009)")
        assert got["True"] == {"steps": 1}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
