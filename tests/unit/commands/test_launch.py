"""``plait launch`` argument parsing, planning and the launcher's watch over its workers (no training process)."""

from __future__ import annotations

import datetime
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.commands.launch import (NodeRole, _wait, check_launch, launch_command, launch_device, launch_plan,
                                   parse_kills, worker_command)
from plait.train.launch_plan import LaunchPlan
from tests.distributed.spawning import free_port
from plait.planner.cost.types import DeviceSpec
from plait.config.loader import config_from_dict
from plait.train.run_start import clear_earlier_run, launch_logs
from tests.helpers.jobs import tiny_config_dict
from tests.helpers.pipeline_training import to_toml


def test_parse_kills_reads_worker_step_pairs_and_names_a_bad_value():
    assert parse_kills(["4:1", "0:3"]) == ((4, 1), (0, 3))
    assert parse_kills([]) == ()
    with pytest.raises(ValueError, match=r"'4-1': expected WORKER:STEP"):
        parse_kills(["4-1"])


def test_worker_command_passes_the_config_overrides_and_joining_flag():
    cmd = worker_command("job.toml", ["--train.lr=1e-3"], 2, 6, "127.0.0.1:1234", joining=True)
    assert cmd[1:] == ["-m", "plait.cli", "launch", "--config", "job.toml", "--nproc", "6", "--worker", "2",
                       "--store", "127.0.0.1:1234", "--joining", "--train.lr=1e-3"]


def _cfg(**sections):
    return config_from_dict(tiny_config_dict("train.jsonl", None, "runs/x", **sections))


def test_check_launch_refuses_layout_settings_and_unknown_workers():
    check_launch(_cfg(train={"steps": 6}), 6, ((4, 1), (0, 3)), ((4, 5),))  # a plain job passes
    for name, what in (("tp", "tensor"), ("cp", "context")):
        with pytest.raises(ValueError, match=rf"parallel.{name} = 2: plait launch plans its own pipelines .* runs "
                                             rf"no {what} parallelism inside them: a failure would have to re-split"):
            check_launch(_cfg(parallel={name: 2}), 6)
    check_launch(_cfg(parallel={"dp_shard": 2}), 6, ((4, 1),))  # FSDP2 inside the pipelines: shard groups of 2
    with pytest.raises(ValueError, match=r"parallel.dp_shard = 4 must divide the 6 workers"):
        check_launch(_cfg(parallel={"dp_shard": 4}), 6)
    with pytest.raises(ValueError, match=r"--rejoin with parallel.dp_shard = 2: when a worker of a shard group fails "
                                         r"its partners leave the job with it"):
        check_launch(_cfg(parallel={"dp_shard": 2}, train={"steps": 6}), 6, ((4, 1),), ((4, 3),))
    with pytest.raises(ValueError, match=r"--nnodes above 1 with parallel.dp_shard = 2"):
        check_launch(_cfg(parallel={"dp_shard": 2}), 8, nnodes=2)
    check_launch(_cfg(data={"val": "val.jsonl"}), 6)  # validated through the pipelines
    with pytest.raises(ValueError, match=r"--kill: no worker 5, 9 \(the workers are 0..3\)"):
        check_launch(_cfg(), 4, ((9, 1), (5, 1), (1, 2)))
    with pytest.raises(ValueError, match=r"--rejoin: no worker 6 \(the workers are 0..5\)"):
        check_launch(_cfg(), 6, (), ((6, 2),))


def test_check_launch_refuses_a_kill_or_rejoin_past_the_last_step():
    check_launch(_cfg(train={"steps": 6}), 4, ((1, 5), (2, 0)), ((2, 5),))  # steps 0..5
    with pytest.raises(ValueError, match=r"--kill: step 6, 99 is past the job's last step \(train.steps = 6: the "
                                         r"steps are 0..5, 0-based\)"):
        check_launch(_cfg(train={"steps": 6}), 4, ((1, 99), (2, 6), (3, 2)))
    with pytest.raises(ValueError, match=r"--rejoin: step 7 is past the job's last step \(train.steps = 6"):
        check_launch(_cfg(train={"steps": 6}), 4, (), ((1, 7),))
    check_launch(_cfg(train={"steps": 0, "epochs": 1.0}), 4, ((1, 99),))  # epochs: the count depends on the data


def test_check_launch_refuses_a_rejoin_that_cannot_happen():
    cfg = _cfg(train={"steps": 6})
    check_launch(cfg, 4, ((1, 2),), ((1, 3),))  # the step after the kill
    check_launch(cfg, 4, ((1, 2), (1, 5)), ((1, 4),))  # rejoins after its first death, killed again later
    with pytest.raises(ValueError, match=r"--rejoin 1:50: step|--rejoin: step 50 is past the job's last step"):
        check_launch(cfg, 3, ((1, 2),), ((1, 50),))
    with pytest.raises(ValueError, match=r"^--rejoin 1:2 must come after --kill 1:4: worker 1 rejoins at the start "
                                         r"of a step after the one it dies in \(step 5 or later\)$"):
        check_launch(cfg, 3, ((1, 4),), ((1, 2),))
    with pytest.raises(ValueError, match=r"^--rejoin 1:2 must come after --kill 1:2: .*\(step 3 or later\)$"):
        check_launch(cfg, 3, ((1, 2),), ((1, 2),))
    with pytest.raises(ValueError, match=r"^--rejoin 1:3 needs a --kill or --stop of worker 1 \(or --kill-node of its node\) at an earlier step"):
        check_launch(cfg, 3, (), ((1, 3),))
    with pytest.raises(ValueError, match=r"^--rejoin 2:3 needs a --kill or --stop of worker 2"):
        check_launch(cfg, 3, ((1, 2),), ((2, 3),))
    with pytest.raises(ValueError, match=r"^--rejoin 1:3 and --rejoin 1:5: worker 1 rejoins at most once"):
        check_launch(cfg, 3, ((1, 2), (1, 4)), ((1, 3), (1, 5)))


def test_launch_refuses_a_run_folder_holding_an_earlier_run_before_starting_anything(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(to_toml(tiny_config_dict(str(tmp_path / "train.jsonl"), None, str(tmp_path / "run"))) + "\n")
    logs = tmp_path / "run" / "resilient"
    logs.mkdir(parents=True)
    (logs / "worker0.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"holds an earlier launch's logs \(1 files\).*--overwrite"):
        launch_command(job, 4, 1)
    (logs / "worker0.jsonl").unlink()
    (tmp_path / "run" / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_000004" / ".metadata").write_text("")
    with pytest.raises(ValueError, match=r"holds an earlier run \(1 checkpoint\(s\), newest step_000004\).*"
                                         r"`plait launch --config JOB --nproc N --overwrite`"):
        launch_command(job, 4, 1)


def _earlier_launched_run(run: Path) -> dict[str, str]:
    """A finished launch's folder: two checkpoints, a final model, the launch's logs and plan. Returns the files."""
    for step in ("step_000003", "step_000006"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / ".metadata").write_text(step)
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_text("weights")
    (run / "resilient").mkdir()
    for name in ("worker0.jsonl", "worker1.jsonl", "final-worker0.pt", "launch.json"):
        (run / "resilient" / name).write_text(name)
    return {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()}


def test_a_refused_launch_with_overwrite_leaves_the_earlier_run_untouched(tmp_path):
    run = tmp_path / "run"
    job = tmp_path / "job.toml"
    job.write_text(to_toml(tiny_config_dict(str(tmp_path / "train.jsonl"), None, str(run))) + "\n")
    before = _earlier_launched_run(run)
    with pytest.raises(ValueError, match=r"--pipelines \[3, 3\] use 6 workers, the job has 4"):
        launch_command(job, 4, 1, pipelines=[3, 3], overwrite=True)
    with pytest.raises(ValueError, match=r"cannot hold failures \+ 1 = 6 pipelines"):
        launch_command(job, 4, 5, overwrite=True)
    with pytest.raises(ValueError, match=r"--kill: step 9 is past the job's last step"):
        launch_command(job, 4, 1, kills=["1:9"], overwrite=True)
    assert {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()} == before


def test_a_refused_launch_creates_no_run_folder(tmp_path):
    run = tmp_path / "new-run"
    job = tmp_path / "job.toml"
    job.write_text(to_toml(tiny_config_dict(str(tmp_path / "train.jsonl"), None, str(run))) + "\n")
    with pytest.raises(ValueError, match=r"--pipelines \[3, 3\] use 6 workers, the job has 4"):
        launch_command(job, 4, 1, pipelines=[3, 3])
    assert not run.exists()  # refused while planning: the run folder's lock was never taken


def test_overwrite_removes_the_checkpoints_final_model_and_launch_logs_together(tmp_path, caplog):
    run = tmp_path / "run"
    _earlier_launched_run(run)
    (run / "metrics.jsonl").write_text("{}\n")
    with caplog.at_level("WARNING", logger="plait.train.trainer"):
        clear_earlier_run(run, True, 1, overwrite=True)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == ["metrics.jsonl"]
    assert launch_logs(run) == []
    assert ("removed its 2 checkpoint(s) (newest step_000006) and its final model and its 3 launch log file(s) "
            "(resilient/)") in caplog.text
    _earlier_launched_run(tmp_path / "only-logs")
    for path in ("checkpoints", "final"):
        shutil.rmtree(tmp_path / "only-logs" / path)
    with caplog.at_level("WARNING", logger="plait.train.trainer"):
        clear_earlier_run(tmp_path / "only-logs", True, 1, overwrite=True)
    assert "already holds an earlier launch's logs: removed its 0 checkpoint(s) and its 3 launch log" in caplog.text
    assert not any(p.is_file() for p in (tmp_path / "only-logs").rglob("*"))


def test_launch_plans_for_this_hosts_cpu_with_its_runtime_costs_as_plait_plan_does(tmp_path, capsys):
    cfg = _cfg()
    spec, costs = launch_device(cfg, 4)
    assert spec.name.startswith("CPU (this host, 1 thread: ")  # train.threads = 1
    assert spec.chunk_overhead_s == DeviceSpec.cpu().chunk_overhead_s > 0 and spec.memory_bytes > 0
    assert costs.source.startswith(f"analytic costs ({spec.name}): 5.00 ms per module chunk and action")
    assert costs.dp_link is not None and not costs.overheads.zero
    plan = launch_plan(cfg, 4, 1, device=(spec, costs))
    # one microbatch per pipeline pays a forward and a backward of at least one module chunk: milliseconds
    assert plan.instantiation.iteration_s >= 2 * spec.chunk_overhead_s
    assert "us per iteration" not in plan.instantiation.describe()
    preset, preset_costs = launch_device(cfg, 4, "cpu")  # --device: a preset, as plait plan --device
    assert preset == DeviceSpec.cpu() and preset_costs.source.startswith(f"analytic costs ({preset.name}): 5.00 ms")
    h100 = launch_device(cfg, 4, "h100")  # the tiny model on H100s: one rank beats any split over NVLink
    with pytest.raises(ValueError, match=r"a pipeline of 2 workers: the fastest plan for H100.* runs on 1 of them and "
                                         r"plait launch cannot leave a worker idle as a spare"):
        launch_plan(cfg, 4, 1, [2, 2], device=h100)
    with pytest.raises(ValueError, match=r"^unknown device 'tpu'; choose one of h100, h200, a100, cpu \(Python"):
        launch_device(cfg, 4, "tpu")
    job = tmp_path / "job.toml"
    job.write_text(to_toml(tiny_config_dict(str(tmp_path / "train.jsonl"), None, str(tmp_path / "run"))) + "\n")
    with pytest.raises(ValueError, match=r"--pipelines \[3, 3\] use 6 workers"):
        launch_command(job, 4, 1, pipelines=[3, 3])
    assert capsys.readouterr().out.startswith("plait launch: planning for CPU (this host, 1 thread: ")
    with pytest.raises(ValueError, match=r"--pipelines \[3, 3\] use 6 workers"):
        launch_command(job, 4, 1, pipelines=[3, 3], device="h100")
    assert capsys.readouterr().out.startswith("plait launch: planning for H100")


def test_node_role_checks_its_rank_and_store():
    assert NodeRole().address() == ("127.0.0.1", 0)
    assert NodeRole(2, 1, "node0:29400").address() == ("node0", 29400)
    with pytest.raises(ValueError, match=r"--node-rank 2 outside 0..1 \(--nnodes 2\)"):
        NodeRole(2, 2, "node0:29400")
    with pytest.raises(ValueError, match=r"--nnodes above 1 needs --store HOST:PORT"):
        NodeRole(2, 0)
    with pytest.raises(ValueError, match=r"--store 'node0': expected HOST:PORT"):
        NodeRole(2, 0, "node0")
    for bad in ("node0:99999", "node0:0", "127.0.0.1:29604:5", "[::1]:29603"):
        with pytest.raises(ValueError, match=r"expected HOST:PORT with a host name or IPv4 address and a port in "):
            NodeRole(2, 0, bad)
    with pytest.raises(ValueError, match=r"--nnodes must be >= 1, got 0"):
        NodeRole(0, 0)


def test_check_launch_counts_a_killed_node_as_the_death_of_its_workers():
    cfg = _cfg(train={"steps": 6})
    check_launch(cfg, 6, (), ((4, 3), (5, 3)), (), ((1, 2),), nnodes=2)  # node 1 = workers 3-5
    check_launch(cfg, 6, (), ((1, 3),), ((1, 1),), (), nnodes=2)  # a stopped worker rejoins
    with pytest.raises(ValueError, match=r"^--rejoin 2:3 needs a --kill or --stop of worker 2"):
        check_launch(cfg, 6, (), ((2, 3),), (), ((1, 2),), nnodes=2)  # worker 2 is on node 0
    with pytest.raises(ValueError, match=r"^--kill-node: no node 2 \(the nodes are 0..1\)"):
        check_launch(cfg, 6, (), (), (), ((2, 1),), nnodes=2)
    with pytest.raises(ValueError, match=r"^--stop: no worker 6 \(the workers are 0..5\)"):
        check_launch(cfg, 6, (), (), ((6, 1),), (), nnodes=2)
    with pytest.raises(ValueError, match=r"^--kill-node 0: node 0's launcher hosts the membership store"):
        check_launch(cfg, 6, (), (), (), ((0, 1),), nnodes=2)
    with pytest.raises(ValueError, match=r"'1:-1': expected NODE:STEP"):
        parse_kills(["1:-1"], "NODE")


def test_on_several_nodes_f_counts_nodes_and_pipelines_keep_a_copy_off_each_node(tmp_path):
    cfg = _cfg()
    cpu = launch_device(cfg, 3, "cpu")
    plan = launch_plan(cfg, 6, 1, device=cpu, nodes=2)
    domains = plan.domains()
    assert domains == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1} and plan.per_node == 3
    for unit in plan.templates.units:  # losing either node leaves a copy
        assert {domains[h] for h in plan.instantiation.holders(unit.name)} == {0, 1}, unit.name
    assert LaunchPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match=r"--pipelines \[2, 4\]: every copy of .* lies on fewer than 2 nodes"):
        launch_plan(cfg, 6, 1, [2, 4], device=cpu, nodes=2)  # pipeline 1 (workers 2-5) spans both nodes
    with pytest.raises(ValueError, match=r"--f 2 counts nodes on a job of several: 2 nodes cannot hold 3 copies"):
        launch_plan(cfg, 6, 2, device=cpu, nodes=2)


def test_a_silent_worker_is_killed_as_hung_and_a_closed_one_is_not(capsys):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    procs = {3: subprocess.Popen(sleeper), 4: subprocess.Popen([sys.executable, "-c", "pass"]),
             5: subprocess.Popen(sleeper)}
    store.set("hb/3", repr(time.time() - 100))  # silent for 100 s: hung
    store.set("hb/4", repr(time.time() - 100))  # silent too, but it closed its membership and exits 0
    store.set("closed/4", "1")
    # worker 5 never beat (still starting): not judged; the limit stops it
    codes = _wait(procs, store, 4.0, lambda w: None, hang_s=1.0)
    assert codes == {3: -signal.SIGKILL, 4: 0, 5: -signal.SIGKILL}
    out = capsys.readouterr()
    assert "worker 3 sent no heartbeat for 100." in out.out and "killed as hung" in out.out
    assert "worker 5 sent no" not in out.out and "stopped workers still running after 4.0 s" in out.err
    assert store.get("dead/3") == b"-9"


def test_a_launch_whose_workers_all_died_or_left_is_not_done(tmp_path):
    """Workers killed by a signal (negative status) or gone (0) with no final parameters written: not finished."""
    import time
    from plait.commands.launch import unfinished_message
    start = time.time() - 1
    message = unfinished_message({0: -9, 1: 0}, tmp_path, start)
    assert message == (f"plait launch: the job did not finish: no worker of this node reached the end and wrote its "
                       f"final parameters (worker 0 killed by signal 9, worker 1 left the job); logs and the last "
                       f"checkpoint are in {tmp_path} (plait train --resume continues it)")
    (tmp_path / "final-worker3.pt").write_bytes(b"")  # another worker's: not this node's
    assert unfinished_message({0: -9, 1: 0}, tmp_path, start) is not None
    (tmp_path / "final-worker1.pt").write_bytes(b"")
    assert unfinished_message({0: -9, 1: 0}, tmp_path, start) is None
    assert unfinished_message({0: -9, 1: 0}, tmp_path, time.time() + 60) is not None  # an earlier run's file
