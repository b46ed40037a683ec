"""``plait train`` beyond one host: two torchrun agents on this machine acting as two nodes (static rendezvous, gloo)
train exactly as one process (DP over 2 x 1 processes; PP 2 x DP 2 over 2 x 2, numbered pipeline outermost so each
node holds one pipeline rank), and a job that ``torchrun --max-restarts 1`` restarts after a worker is killed resumes
from its newest complete checkpoint by itself (no ``--resume``) and ends with the uninterrupted run's losses and final
parameters."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from plait.models.multimodal import MultimodalModel
from tests.helpers.cli import plait
from tests.helpers.demo_runs import PYTHON_M_TORCHRUN, job, losses, small, start, wait_for_step
from tests.distributed.spawning import free_port

STEPS = 6
PP2 = ["--parallel.pp.degree=2", "--parallel.pp.layout=encoders_colocated", "--parallel.pp.stages.llm=1"]


def two_nodes(config: Path, per_node: int, *extra: str) -> list:
    """Both agents of a 2-node job (``per_node`` processes each) on this machine, started; their finished
    processes."""
    port = free_port()
    procs = [start([*PYTHON_M_TORCHRUN, "--nnodes=2", f"--node_rank={n}", f"--nproc_per_node={per_node}",
                    "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "plait.cli", "train", "--config",
                    str(config), *small(STEPS), *extra]) for n in (0, 1)]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        done.append((proc.returncode, out, err))
    return done


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return dict(MultimodalModel.from_pretrained(run_dir / "final", "eager").named_parameters())


def assert_same_run(run_dir: Path, ref_dir: Path) -> None:
    """Every step's loss (rel 1e-5) and every final parameter (rel 1e-4, abs 1e-5) of ``ref_dir``."""
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), step
    ref = final_params(ref_dir)
    for name, value in final_params(run_dir).items():
        torch.testing.assert_close(value, ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The one-process run every layout is compared with."""
    tmp = tmp_path_factory.mktemp("single")
    done = plait("train", "--config", str(job(tmp, "single")), *small(STEPS), limit_s=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "single"


@pytest.mark.slow
def test_dp_over_two_nodes_equals_one_process(tmp_path, single):
    done = two_nodes(job(tmp_path, "nodes"), 1)
    assert all(rc == 0 for rc, _, _ in done), done[0][2][-3000:] + done[1][2][-3000:]
    assert "world size 2 on 2 nodes x 1 process" in done[0][1]
    assert_same_run(tmp_path / "nodes", single)


@pytest.mark.slow
def test_pp2_x_dp2_over_two_nodes_equals_one_process(tmp_path, single):
    """4 processes, 2 per node: ``rank_order = auto`` numbers the pipeline outermost, so the DP pair of each
    pipeline rank is one node and the pipeline's activations cross between the nodes."""
    done = two_nodes(job(tmp_path, "pp"), 2, *PP2)
    assert all(rc == 0 for rc, _, _ in done), done[0][2][-3000:] + done[1][2][-3000:]
    assert "world size 4 on 2 nodes x 2 processes, ranks numbered pp_outer" in done[0][1]
    assert_same_run(tmp_path / "pp", single)


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``), ascending."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(found)


def _kill_one_worker(agent: int) -> int:
    """SIGKILL the torchrun agent's newest worker process (pids ascend; a worker's own helpers, e.g. data loader
    processes, are its children, not the agent's); returns its pid."""
    victim = _children(agent)[-1]
    os.kill(victim, signal.SIGKILL)
    return victim


@pytest.mark.slow
def test_a_restarted_job_resumes_from_its_newest_checkpoint_by_itself(tmp_path, single):
    """``torchrun --max-restarts 1``, a checkpoint every step, a worker killed after step 2: torchrun restarts both
    workers, which resume from the newest complete checkpoint (the steps after it replayed) without ``--resume``,
    and finish with the losses and final parameters of a run that was never interrupted (the one-process run, which
    DP over 2 processes equals: the tests above)."""
    def command(config: Path, *extra: str) -> list[str]:
        return [*PYTHON_M_TORCHRUN, "--nproc_per_node=2", *extra, "-m", "plait.cli", "train", "--config", str(config),
                *small(STEPS), "--checkpoint.every=1"]

    # c10d rendezvous, as on a cluster
    elastic = ["--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--rdzv-id=plait-elastic-test", "--nnodes=1"]
    proc = start(command(job(tmp_path, "elastic"), *elastic))
    try:
        assert wait_for_step(proc, tmp_path / "elastic", 2, time.monotonic() + 240), "the run ended before step 2"
        _kill_one_worker(proc.pid)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    assert "plait: torchrun restart 1: resuming from" in out, out[-3000:]
    assert_same_run(tmp_path / "elastic", single)
