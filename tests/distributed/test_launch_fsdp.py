"""``plait launch`` with FSDP2 inside its pipelines (``parallel.dp_shard = 2``): 6 workers as 3 shard groups of 2,
pipelines of 2 + 1 groups (4 + 2 workers: each plan rank's trainable units sharded over its group's 2 workers, each
worker running its own copy of the pipeline on its own microbatches), against the same launch without sharding (3
workers as pipelines of 2 + 1 ranks), through a failure: the sharded launch equals the unsharded one (per-step
losses, samples and LRs, final parameters (shards gathered) and validation losses; fp32 on CPU: 1e-5), its checkpoint
holding each trained weight and AdamW moment in 2 shards. Step 0 runs on the planned sharded pipelines; worker 3
(shard 1 of pipeline 0's second plan rank) is SIGKILLed in the middle of step 1: its partner, worker 2, leaves the
job (its shards belong to a copy that is gone), the survivors reconfigure over groups 0 and 2 (pipeline 0 shrinks
to one group and receives the second rank's units shard by shard from pipeline 1's group) and the job ends equal to
the unsharded launch. The LLM's embedding is tied to its head (one plan rank holds both in every pipeline here, so it
is sharded with them): its copy moves whole, gathered over the sending group and sharded where it lands."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from plait.train.metrics import read_metrics
from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.launch import launch, worker_records
from tests.helpers.pipeline_training import to_toml

SAMPLES, BATCH, STEPS = 16, 8, 4  # 2 steps per epoch
TOL = 1e-5  # fp32 on CPU: sums in another order


def _job(tmp_path: Path, name: str, dp_shard: int) -> Path:
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", limit=SAMPLES))
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=4))
    cfg = tiny_config_dict(str(train), str(val), str(tmp_path / name),
                           train={"global_batch_size": BATCH, "microbatch_size": 1, "steps": STEPS, "lr": 1e-3,
                                  "threads": 1, "min_lr_ratio": 0.1, "eval_every": STEPS, "max_new_tokens": 2},
                           parallel={"dp_shard": dp_shard})
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = True  # its unit copies move whole
    path = tmp_path / f"{name}.toml"
    path.write_text(to_toml(cfg) + "\n")
    return path


def _launch(tmp_path: Path, name: str, nproc: int, pipelines: str, dp_shard: int,
            *faults: str) -> subprocess.CompletedProcess:
    return launch(_job(tmp_path, name, dp_shard), nproc, pipelines, *faults)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The launch without sharding: 3 workers as pipelines of 2 + 1 ranks."""
    root = tmp_path_factory.mktemp("launch_fsdp")
    ref = _launch(root, "ref", 3, "2,1", 1)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    return root / "ref"


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted((run_dir / "resilient").glob("final-worker*.pt")):
        for name, value in torch.load(path).items():
            if name in merged:  # the copies of another shard row or pipeline: equal
                torch.testing.assert_close(value, merged[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
            merged[name] = value
    return merged


def _assert_equals_reference(run_dir: Path, reference: Path) -> tuple[dict[int, dict], list[dict]]:
    """Every step once with the reference's losses (1e-5), samples and LRs, each sample once per epoch, the final
    parameters (1e-5) and the validation loss per task (rel 1e-5). Returns the run's steps and events."""
    ref_steps, ref_events = worker_records(reference)
    steps, events = worker_records(run_dir)
    assert not ref_events and sorted(steps) == list(range(STEPS)) == sorted(ref_steps)
    for s in range(STEPS):
        assert abs(steps[s]["loss"] - ref_steps[s]["loss"]) < TOL, (s, steps[s]["loss"], ref_steps[s]["loss"])
        assert steps[s]["samples"] == ref_steps[s]["samples"] and steps[s]["lr"] == ref_steps[s]["lr"]
    for epoch in range(STEPS * BATCH // SAMPLES):
        ids = [i for s in steps.values() if s["epoch"] == epoch for i in s["samples"]]
        assert len(ids) == SAMPLES == len(set(ids)), epoch
    final, ref_final = _final(run_dir), _final(reference)
    assert sorted(final) == sorted(ref_final)
    for name, value in ref_final.items():
        torch.testing.assert_close(final[name], value, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
    got, ref = ([r for r in read_metrics(d / "metrics.jsonl") if "val_loss" in r] for d in (run_dir, reference))
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [STEPS]
    for task, value in ref[0]["val_loss_per_task"].items():
        assert abs(got[0]["val_loss_per_task"][task] - value) <= TOL * abs(value), (task, got[0], ref[0])
    return steps, events


def test_a_killed_worker_of_a_sharded_launch_takes_its_shard_group_out_and_the_job_equals_the_unsharded_one(
        tmp_path, reference):
    run = _launch(tmp_path, "kill", 6, "4,2", 2, "--kill", "3:1")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout + run.stderr
    assert "worker 2 leaves the job: its shard group lost worker(s) [3]" in out, out
    steps, events = _assert_equals_reference(tmp_path / "kill", reference)
    assert steps[0]["pipelines"] == [[0, 1, 2, 3], [4, 5]] and steps[1]["pipelines"] == [[0, 1], [4, 5]]
    reconfigured = [e for e in events if e["event"] == "reconfigure"]
    assert reconfigured and all(e["failed"] == [3] for e in reconfigured), events
    # pipeline 0 (now group 0: workers 0, 1) receives the second plan rank's units (the LLM, its tied embedding and
    # head included) shard by shard from group 2
    assert {(src, dst) for e in reconfigured for _, src, dst in e["copies"]} == {(2, 0)}, reconfigured
    assert "6 workers in shard groups of 2 workers (FSDP2), f = " in run.stdout, run.stdout
    assert ": 2 pipelines: 2 shard groups (" in run.stdout, run.stdout
    assert " per shard row of 2 workers)" in run.stdout and "pipelines now 1+1 shard groups" in out, out
    plan = json.loads((tmp_path / "kill" / "resilient" / "launch.json").read_text())
    assert plan["templates"]["dp_shard"] == 2
    # really sharded: the checkpoint (DCP) holds each trained LLM weight and its AdamW moments in 2 row shards
    for run_dir, chunks in ((tmp_path / "kill", [(0, 32), (32, 32)]), (reference, [(0, 64)])):
        meta = FileSystemReader(str(run_dir / "checkpoints" / f"step_{STEPS:06d}")).read_metadata().state_dict_metadata
        for key in ("model.language_model.model.layers.0.mlp.up_proj.weight",
                    "optim.state.language_model.model.layers.0.mlp.up_proj.weight.exp_avg"):
            assert [(c.offsets[0], c.sizes[0]) for c in meta[key].chunks] == chunks, (run_dir, key)
    assert {"language_model.model.embed_tokens", "language_model.lm_head"} <= {u for e in reconfigured
                                                                                for u, _, _ in e["copies"]}
