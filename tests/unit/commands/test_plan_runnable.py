"""``plait plan`` prints a plan that runs as printed: the complete job tables (``[parallel]``, ``[parallel.pp]`` only
with a pipeline) and the command line; ``--device cpu`` is this host's CPU; a simpler plan within
``PREFER_WITHIN`` of the fastest is preferred; ``--help`` shows the overrides."""

from __future__ import annotations

import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.config.loader import load_config, parse_overrides
from tests.helpers.cli import plait

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"


def _tables_and_command(text: str) -> tuple[str, str]:
    match = re.search(r"to run this plan, put these tables in the job file:\n(.*?)or run it as printed \(the same "
                      r"settings as overrides\):\n  (.*)\n", text, re.S)
    assert match, text
    return match.group(1), match.group(2)


def _check_runnable(text: str, config: str) -> dict:
    tables, command = _tables_and_command(text)
    parallel = tomllib.loads(tables)["parallel"]
    assert {"plan", "dp", "dp_shard", "tp", "cp"} <= set(parallel) and parallel["plan"] == "manual"
    pp = parallel.get("pp", {"degree": 1})
    pipelined = "pipeline ranks" in text
    assert ("pp" in parallel) == pipelined and (pp["degree"] > 1) == pipelined
    if not pipelined:
        assert not re.search(r"^\s*stage\s+rank\s+module", text, re.M)  # no stage table without a pipeline
    processes = parallel["dp"] * parallel["dp_shard"] * parallel["tp"] * parallel["cp"] * pp["degree"]
    args = shlex.split(command)
    head = ["plait", "train"] if processes == 1 else ["torchrun", "--nproc_per_node", str(processes), "-m",
                                                      "plait.cli", "train"]
    assert args[:len(head)] == head and args[len(head):len(head) + 2] == ["--config", config], command
    # the command's overrides give the job the printed tables, and the job file with them validates
    cfg = load_config(ROOT / config, args[len(head) + 2:])
    assert (cfg.parallel.plan, cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.cp) == \
        ("manual", parallel["dp"], parallel["dp_shard"], parallel["tp"], parallel["cp"])
    assert cfg.parallel.pp.degree == pp["degree"]
    overrides = parse_overrides(args[len(head) + 2:])
    assert all(overrides[f"parallel.pp.{k}"] == v for k, v in pp.items())
    return parallel


def test_plan_prints_complete_tables_and_the_command_on_this_hosts_cpu():
    proc = plait("plan", "--config", "configs/demo.toml", "--devices", "2", "--device", "cpu", limit_s=600)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "planning for CPU (this host, " in text and "--device cpu: this host's CPU, measured" in text
    assert "on 2 x CPU (this host, " in text and "(cap 57.60 GiB)" not in text  # not the preset
    parallel = _check_runnable(text, "configs/demo.toml")
    assert parallel["dp"] >= 1


def test_a_pipelined_plan_prints_its_pp_table_and_a_torchrun_line():
    proc = plait("plan", "--config", "configs/demo.toml", "--devices", "4", "--dp", "1", "--device", "cpu-preset",
                 limit_s=600)
    assert proc.returncode == 0, proc.stderr
    assert "on 4 x CPU, " in proc.stdout and "(cap 57.60 GiB)" in proc.stdout  # the fixed preset, by its name
    parallel = _check_runnable(proc.stdout, "configs/demo.toml")
    assert parallel["pp"]["degree"] > 1 and re.search(r"^\s*stage\s+rank\s+module", proc.stdout, re.M)


def test_a_plan_without_a_pipeline_shows_no_stage_table_and_needs_no_pp_table():
    out = io.StringIO()
    choice = plan_command(DEMO, 2, device="cpu-preset", dp_degrees=[2], out=out, profile_store=None)
    text = out.getvalue()
    if choice.plan.num_ranks > 1:
        pytest.skip("the search put a pipeline in each replica")
    assert "stage rank" not in text and "whole model on each rank (vision, audio, llm): forward" in text
    assert "pp" not in tomllib.loads(_tables_and_command(text)[0])["parallel"]
    replicas = choice.dp // choice.dp_shard  # FSDP2 over the DP ranks when it is faster (it is on the preset)
    assert f"--parallel.dp={replicas} --parallel.dp_shard={choice.dp_shard}" in _tables_and_command(text)[1]


def test_a_simpler_plan_within_the_tolerance_is_preferred_and_the_output_says_why():
    from plait.commands.plan.command import PREFER_WITHIN

    assert PREFER_WITHIN == 0.10
    fastest = plan_command(DEMO, 8, device="cpu-preset", out=io.StringIO(), profile_store=None, prefer_within=0)
    assert fastest.devices_used == 8  # on the preset TP and FSDP2 over all 8 devices are well ahead
    out = io.StringIO()
    simple = plan_command(DEMO, 8, device="cpu-preset", out=out, profile_store=None, prefer_within=10.0)
    assert simple.plan.num_ranks == 1 and simple.devices_used < fastest.devices_used
    assert re.search(rf"recommending DP {simple.dp} without a pipeline on {simple.devices_used} of 8 devices .*the "
                     r"fastest plan, DP \d+[^(]* on \d+ devices .* is predicted only [\d.]+% faster, "
                     r"within the 1000% tolerance", out.getvalue())
    kept = plan_command(DEMO, 8, device="cpu-preset", out=io.StringIO(), profile_store=None)
    assert kept == fastest  # far more than 10% faster: kept


def test_plan_help_shows_the_overrides():
    proc = plait("plan", "--help", limit_s=600)
    assert proc.returncode == 0 and "overrides:" in proc.stdout and "--train.lr=1e-3" in proc.stdout
    assert "cpu-preset" in proc.stdout


def test_plan_setup_takes_keywords():
    with pytest.raises(TypeError):
        plan_setup(DEMO, 2, (), "cpu-preset")  # positional arguments after devices are refused
    setup = plan_setup(DEMO, 2, device="cpu-preset")
    assert setup.spec.name == "CPU" and setup.inputs.microbatches == 2
