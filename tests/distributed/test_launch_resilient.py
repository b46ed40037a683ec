"""``plait launch``: 6 workers as 2 pipelines of 3 ranks (f = 1) train a tiny MLLM; worker 4 (pipeline 1) is
SIGKILLed in the middle of step 1 and worker 0 (rank 0, pipeline 0) in the middle of step 3; the launcher restarts
worker 4, which rejoins at the start of step 5 (the job re-instantiates over 5 workers). Every step finishes,
per-step losses and final parameters equal an uninterrupted launch (1e-5), each sample id is trained exactly once
per epoch, and each reconfiguration prints its line with the recovery time. With f = 1 and three pipelines (2+2+2),
two failures in different pipelines at different steps are both survived, equal to the same uninterrupted launch
(one reference run, shared). Killing both holders of a unit at once stops the job with the lost units named (no
hang)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.train.metrics import read_metrics
from plait.train.trainer import Trainer

from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
from tests.helpers.launch import LIMIT_S, launch, worker_records
from tests.helpers.pipeline_training import to_toml

SAMPLES, BATCH, STEPS = 16, 8, 7  # 2 steps per epoch: steps 0-1 epoch 0, 2-3 epoch 1, 4-5 epoch 2, 6 epoch 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted launch (6 workers as 3+3): the run folder every fault test is compared with."""
    root = tmp_path_factory.mktemp("launch")
    ref = _launch(root, "ref", 6, "3,3")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    return root / "ref"


def _job(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(to_toml(tiny_config_job(tmp_path, name)) + "\n")
    return path


def _launch(tmp_path: Path, name: str, nproc: int, pipelines: str, *faults: str) -> subprocess.CompletedProcess:
    return launch(_job(tmp_path, name), nproc, pipelines, *faults)


def _rows(run_dir: Path, kind: str = "loss") -> dict[int, dict]:
    """``metrics.jsonl``'s training rows (``kind="loss"``) or validation rows (``"val_loss"``) by step (1-based,
    as ``plait train`` writes them)."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if kind in r}


def _assert_same_validation(run_dir: Path, reference: Path) -> None:
    """Validation after steps 4 and 7 with the reference's loss per task (rel 1e-5) and answers."""
    got, ref = _rows(run_dir, "val_loss"), _rows(reference, "val_loss")
    assert sorted(got) == sorted(ref) == [4, STEPS], (sorted(got), sorted(ref))
    for s in got:
        for task, value in ref[s]["val_loss_per_task"].items():
            assert abs(got[s]["val_loss_per_task"][task] - value) <= 1e-5 * abs(value), (s, task, got[s], ref[s])
        assert got[s]["eval"] == ref[s]["eval"] and got[s]["exact_match"] == ref[s]["exact_match"], s


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for path in sorted((run_dir / "resilient").glob("final-worker*.pt")):
        merged.update(torch.load(path))
    return merged


def _assert_equals_reference(run_dir: Path, reference: Path) -> tuple[dict[int, dict], list[dict]]:
    """Every step done once, with the reference's losses (1e-5), samples and LRs; every sample id once in each
    full epoch; final parameters equal (1e-5). Returns the run's steps and events."""
    ref_steps, ref_events = worker_records(reference)
    steps, events = worker_records(run_dir)
    assert not ref_events and sorted(steps) == list(range(STEPS)) == sorted(ref_steps)
    for s in range(STEPS):
        assert abs(steps[s]["loss"] - ref_steps[s]["loss"]) < 1e-5, (s, steps[s]["loss"], ref_steps[s]["loss"])
        assert steps[s]["samples"] == ref_steps[s]["samples"] and steps[s]["lr"] == ref_steps[s]["lr"]
    for epoch in range(3):  # the full epochs: every sample id exactly once
        ids = [i for s in steps.values() if s["epoch"] == epoch for i in s["samples"]]
        assert len(ids) == SAMPLES == len(set(ids)), epoch
    final, ref_final = _final(run_dir), _final(reference)
    assert sorted(final) == sorted(ref_final)
    for name, value in ref_final.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return steps, events


def test_launch_survives_killed_workers_rank0_included_and_equals_an_uninterrupted_run(tmp_path, reference):
    run = _launch(tmp_path, "kill", 6, "3,3", "--kill", "4:1", "--kill", "0:3", "--rejoin", "4:5")
    assert run.returncode == 0, run.stdout + run.stderr
    steps, events = _assert_equals_reference(tmp_path / "kill", reference)
    assert steps[0]["pipelines"] == [[0, 1, 2], [3, 4, 5]]
    assert steps[2]["pipelines"] == [[0, 1, 2], [3, 5]] and steps[4]["pipelines"] == [[1, 2], [3, 5]]
    # worker 4 rejoined: re-instantiated over 5 workers (CPU costs: 5 ms per module chunk and action, 0.75 GB/s
    # all-reduce, favour 3 pipelines; the H100 preset the launcher used before planned 4: [[1, 2], [3], [4], [5]])
    assert steps[6]["pipelines"] == [[1, 2, 3], [4], [5]]
    failed = sorted({tuple(e["failed"]) for e in events if e["event"] == "reconfigure"})
    assert failed == [(0,), (4,)], events
    assert {tuple(e["joined"]) for e in events if e["event"] == "rejoin"} == {(4,)}
    assert all(e["bytes"] > 0 for e in events)
    rows, ref_rows = _rows(tmp_path / "kill"), _rows(reference)  # rank 0 died in step 3: worker 1 took over
    assert sorted(rows) == list(range(1, STEPS + 1)) == sorted(ref_rows)
    assert all(abs(rows[s]["loss"] - ref_rows[s]["loss"]) < 1e-5 for s in rows)
    assert sorted(p.name for p in (tmp_path / "kill/checkpoints").iterdir()) == ["step_000004", "step_000007"]
    _assert_same_validation(tmp_path / "kill", reference)  # step 4: through the pipelines re-formed without worker 0
    lines = [line for line in run.stdout.splitlines() if "reconfigured in" in line]
    assert len(lines) == 2 and "worker(s) [4] failed" in lines[0] and "worker(s) [0] failed" in lines[1]
    assert run.stdout.count("plait launch: recovered") == 2 and "worker(s) [4] rejoined" in run.stdout
    print("\n".join(line for line in run.stdout.splitlines() if "launch: re" in line or "rejoined" in line))


def test_launch_with_three_pipelines_survives_two_failures_in_different_pipelines(tmp_path, reference):
    # f = 1, pipelines 2+2+2: worker 1 (pipeline 0) dies in step 1, worker 5 (pipeline 2) in step 3
    run = _launch(tmp_path, "three", 6, "2,2,2", "--kill", "1:1", "--kill", "5:3")
    assert run.returncode == 0, run.stdout + run.stderr
    steps, events = _assert_equals_reference(tmp_path / "three", reference)
    assert steps[0]["pipelines"] == [[0, 1], [2, 3], [4, 5]]
    assert steps[2]["pipelines"] == [[0], [2, 3], [4, 5]] and steps[4]["pipelines"] == [[0], [2, 3], [4]]
    assert sorted({tuple(e["failed"]) for e in events if e["event"] == "reconfigure"}) == [(1,), (5,)], events
    assert run.stdout.count("plait launch: recovered") == 2
    print("\n".join(line for line in run.stdout.splitlines() if "launch: re" in line))


def test_a_launched_run_equals_plait_train_and_its_checkpoint_resumes_under_plait_train(tmp_path, reference, capsys):
    # the launch's metrics.jsonl equals an uninterrupted single-process plait train of the same job, and plait train
    # --resume from the launch's step-4 checkpoint (6 workers, 3+3) continues it to the same losses and parameters
    single = Trainer.build(config_from_dict(tiny_config_job(tmp_path, "single")))
    single.fit()
    ref_rows, rows = _rows(tmp_path / "single"), _rows(reference)
    assert sorted(rows) == list(range(1, STEPS + 1)) == sorted(ref_rows)
    for s in rows:
        assert abs(rows[s]["loss"] - ref_rows[s]["loss"]) <= 1e-5 * abs(ref_rows[s]["loss"]), (s, rows[s], ref_rows[s])
        assert abs(rows[s]["lr"] - ref_rows[s]["lr"]) <= 1e-12 * ref_rows[s]["lr"], s
    _assert_same_validation(reference, tmp_path / "single")  # the launch's validation through its pipelines
    predictions = reference / "predictions" / f"step_{STEPS}.jsonl"
    assert predictions.read_text() == (tmp_path / "single" / "predictions" / predictions.name).read_text()
    assert (reference / "checkpoints/step_000004/.metadata").is_file()
    capsys.readouterr()
    resumed = Trainer.build(config_from_dict(tiny_config_job(tmp_path, "resumed")))
    resumed.fit(resume=str(reference / "checkpoints/step_000004"))
    out = capsys.readouterr().out
    assert "resuming step 4 written with 6 processes (DP 2 x PP 3 x CP 1; plait launch: workers [0, 1, 2]" in out, out
    got = _rows(tmp_path / "resumed")
    assert sorted(got) == list(range(5, STEPS + 1))
    for s in got:
        assert abs(got[s]["loss"] - ref_rows[s]["loss"]) <= 1e-5 * abs(ref_rows[s]["loss"]), (s, got[s], ref_rows[s])
        assert abs(got[s]["lr"] - ref_rows[s]["lr"]) <= 1e-12 * ref_rows[s]["lr"], s
    ref_params = dict(single.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        if not name.endswith("k_proj.bias"):  # zero gradient in exact arithmetic (test_resume_reconfigure.py)
            torch.testing.assert_close(param, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)


def tiny_config_job(tmp_path: Path, name: str) -> dict:
    """The launch tests' job as a dict (run folder ``tmp_path/name``): validation of 6 samples (4 new tokens)
    and a checkpoint after steps 4 and 7."""
    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", limit=SAMPLES))
    val = write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=6))
    return tiny_config_dict(str(train), str(val), str(tmp_path / name),
                            train={"global_batch_size": BATCH, "microbatch_size": 1, "steps": STEPS, "lr": 1e-3,
                                   "threads": 1, "min_lr_ratio": 0.1, "eval_every": 4, "max_new_tokens": 4},
                            checkpoint={"every": 4})


def test_launch_stops_naming_the_lost_units_when_every_copy_dies(tmp_path):
    # both pipelines' first ranks die in the same step: every copy of the vision encoder
    run = _launch(tmp_path, "lost", 4, "2,2", "--kill", "0:1", "--kill", "2:1")
    assert run.returncode == 3, run.stdout + run.stderr
    assert "held every copy of" in run.stderr and "encoders.vision" in run.stderr, run.stderr
    assert "resume from the last checkpoint" in run.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_survive_a_hung_worker_and_the_loss_of_a_node_which_rejoins(tmp_path, reference):
    # two launchers as two nodes of 3 workers (node 0: workers 0-2, node 1: 3-5), f = 1 counting nodes: pipelines
    # 3+3, one per node. Worker 1 hangs (SIGSTOP) in step 1: its launcher kills it after 5 s without a heartbeat. Node
    # 1 (its launcher and workers 3-5 at once) dies in step 3; the test starts its launcher again, which joins the
    # running job; at step 5 workers 1 and 3-5 rejoin. Losses, samples and final parameters equal the reference.
    job, store = _job(tmp_path, "nodes"), f"127.0.0.1:{_free_port()}"

    def agent(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "plait.cli", "launch", "--config", str(job), "--nproc", "3", "--nnodes", "2",
               "--node-rank", str(rank), "--store", store, "--pipelines", "3,3", "--timeout", "10", "--device", "cpu",
               "--hang-timeout", "5", "--stop", "1:1", "--kill-node", "1:3",
               *(a for w in (1, 3, 4, 5) for a in ("--rejoin", f"{w}:5"))]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    lead, node1 = agent(0), agent(1)
    try:
        first_out, _ = node1.communicate(timeout=LIMIT_S)  # killed with its workers in step 3
        assert node1.returncode == -signal.SIGKILL, first_out
        again = agent(1)
        again_out, _ = again.communicate(timeout=LIMIT_S)
        lead_out, _ = lead.communicate(timeout=LIMIT_S)
    finally:
        for proc in (lead, node1, *([again] if "again" in locals() else [])):
            proc.kill()
    assert lead.returncode == 0 and again.returncode == 0, lead_out + again_out
    assert "node 1 of 2: workers 3..5, joining the running job" in again_out, again_out
    assert "worker 1 sent no heartbeat for" in lead_out and "killed as hung" in lead_out, lead_out
    steps, events = _assert_equals_reference(tmp_path / "nodes", reference)
    assert steps[0]["pipelines"] == [[0, 1, 2], [3, 4, 5]]
    assert sorted({tuple(e["failed"]) for e in events if e["event"] == "reconfigure"}) == [(1,), (3, 4, 5)], events
    assert sorted({w for e in events if e["event"] == "rejoin" for w in e["joined"]}) == [1, 3, 4, 5]
    assert sorted(w for p in steps[STEPS - 1]["pipelines"] for w in p) == list(range(6))
    print("\n".join(line for line in lead_out.splitlines() if "launch: " in line))
