"""``plait train`` with ``parallel.plan = "auto"`` on two processes: rank 0 alone builds the profile's model and
data (its metadata pass takes no part in the process group) while rank 1 waits for the profile, then both train
the layout one-process ``plait plan`` chooses from the same stored profile."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from plait.commands.plan.command import plan_command
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.distributed.spawning import run_main
from tests.helpers.pipeline_training import to_toml

LIMIT_S = 150
"""The whole two-process run (profile, plan, two steps); a rank waiting on a collective the other never enters
fails after ``parallel.timeout_s`` (20 s) instead."""


def test_auto_plan_on_two_processes_trains_the_layout_plait_plan_chooses(tmp_path):
    records = demo_records("train", ("image_audio",), limit=2) + demo_records("train", ("text",), limit=2)
    train = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(train), None, str(tmp_path / "run"),
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           parallel={"timeout_s": 20})
    path, store, logs = tmp_path / "job.toml", tmp_path / "profiles", tmp_path / "auto.rank"
    path.write_text(to_toml(job) + "\n")
    argv = ["train", "--config", str(path), "--parallel.plan=auto", "--profile-store", str(store)]
    run_main("tests.helpers.cli", [str(logs), *argv], 2, LIMIT_S,
             "plait train parallel.plan=auto on 2 processes", function="cli_rank")
    rc = [Path(f"{logs}.{r}.rc").read_text() for r in range(2)]
    out, err = (Path(f"{logs}.0.{kind}").read_text() for kind in ("out", "err"))
    assert rc == ["0", "0"], out[-2000:] + err[-4000:] + Path(f"{logs}.1.err").read_text()[-4000:]
    assert "trained 2 steps (model at step 2)" in out
    assert len(list(store.glob("profile-*.json"))) == 1  # measured once, by rank 0
    assert Path(f"{logs}.1.out").read_text() == ""  # rank 1 printed nothing: it only waited for the profile

    planned = plan_command(path, 2, profile_store=store, out=io.StringIO())  # the same stored profile
    line = next(x for x in out.splitlines() if x.startswith("plait: parallel.plan=auto for 2 process(es)"))
    pp = "no pipeline parallelism" if planned.plan.num_ranks == 1 else f"layout {planned.layout}"
    # parallel.dp is the replicate degree: the plan's dp data-parallel ranks over its FSDP2 shard degree. The run
    # times the DP link live (auto_plan_inputs) where plait plan takes the host's, so DDP and FSDP2 over the same 2
    # data-parallel ranks (a tie within a few percent on this tiny model) fell either way in repeated runs: the
    # data-parallel width and the pipeline must agree, DDP against FSDP2 is not compared.
    got = re.match(r"plait: parallel\.plan=auto for 2 process\(es\): DP (\d+) x PP (\d+)(?:, FSDP2 dp_shard (\d+))?",
                   line)
    assert got is not None, line
    replicate, stages, shard = int(got[1]), int(got[2]), int(got[3] or 1)
    assert (replicate * shard, stages) == (planned.dp, planned.plan.num_ranks) and pp in line, (line, planned)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_a_profiling_error_of_rank_0_ends_every_rank_with_one_message(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("text",), limit=1))
    job = tiny_config_dict(str(train), None, str(tmp_path / "run"),
                           train={"steps": 1, "global_batch_size": 2, "microbatch_size": 2, "threads": 1},
                           parallel={"timeout_s": 20})
    path, logs = tmp_path / "job.toml", tmp_path / "auto.rank"
    path.write_text(to_toml(job) + "\n")
    argv = ["train", "--config", str(path), "--parallel.plan=auto", "--profile-store", str(tmp_path / "profiles")]
    run_main("tests.helpers.cli", [str(logs), *argv], 2, LIMIT_S,
             "plait train parallel.plan=auto on too little data", function="cli_rank")
    rc, err = ([Path(f"{logs}.{r}.{kind}").read_text() for r in range(2)] for kind in ("rc", "err"))
    assert rc == ["2", "2"], err
    assert err[0].endswith("plait: error: data.train has 1 usable samples; profiling needs 2\n"), err[0]
    assert "plait: error" not in err[1] and "Traceback" not in err[0] + err[1], err
