"""``plait plan`` with no fitting plan says so in one short sentence a user can act on (the cap and the least need in
GiB/MiB, what to change), not the search's internal cases; ``least_need`` is a lower bound of every option."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.planner.search.fit import least_need
from plait.planner.cost.types import DeviceSpec, HostSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.search.parallel import degree_options
from plait.planner.cost.sharding import rank_memory
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def _setup(memory_bytes: float, devices: int):
    device = dataclasses.replace(DeviceSpec.h100(), memory_bytes=memory_bytes)
    return plan_setup(DEMO, devices, device=device, stream=io.StringIO()), device


def test_least_need_of_a_sharded_option_is_its_whole_rank_memory():
    setup, _ = _setup(80 * 2**30, 4)
    units, costs = consistent_units(setup.inputs.units), setup.inputs.costs
    option = ParallelDegrees(1, 4, "full")
    need, best = least_need(units, costs, 4, [option], dtype=setup.machine.dtype)
    assert best == option
    assert need == pytest.approx(rank_memory(units, costs, option, dtype=setup.machine.dtype).total)
    plain, _ = least_need(units, costs, 4, [ParallelDegrees()], dtype=setup.machine.dtype)
    whole = rank_memory(units, costs, ParallelDegrees(), dtype=setup.machine.dtype).total
    assert whole / 4 <= plain <= whole


def test_no_plan_fits_is_one_readable_sentence(tmp_path):
    setup, _ = _setup(80 * 2**30, 2)
    need, best = least_need(setup.inputs.units, setup.inputs.costs, 2, degree_options(2),
                            dtype=setup.machine.dtype, host=HostSpec())  # plait plan searches CPU offload too
    _, device = _setup(0.5 * need / 0.9, 2)  # a cap of half the least need
    with pytest.raises(ValueError) as info:
        plan_command(DEMO, 2, tmp_path / "plan.json", device=device, out=io.StringIO(), profile_store=None)
    text = str(info.value)
    assert ";" in text and text.count(";") == 1 and "memory_cap=" not in text and "bytes" not in text
    assert len(text) < 420 and "\n" not in text
    shown = float(re.search(r"needs is about ([\d.]+) MiB", text).group(1))
    assert shown == pytest.approx(need / 2**20, abs=0.05)
    assert f"tp {best.tp}, dp_shard {best.dp_shard}, activation checkpointing {best.checkpointing}" in text
    for hint in ("--devices", "--memory-fraction", "--device"):
        assert hint in text
    with pytest.raises(ValueError):  # the bound holds: just under it nothing fits either
        _, device = _setup(0.99 * need / 0.9, 2)
        plan_command(DEMO, 2, None, device=device, out=io.StringIO(), profile_store=None)


def test_auto_plan_with_no_fitting_plan_says_so_in_one_sentence(tmp_path, monkeypatch, capsys):
    """``parallel.plan = "auto"`` on a machine whose (patched) memory cap is 1 KiB: the error is the same readable
    sentence, naming where the cap came from and what to change."""
    from plait.cli import main
    from plait.measure.machine import AutoPlanInputs
    from plait.planner.pipeline.types import P2PModel
    from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl
    from tests.helpers.pipeline_training import to_toml

    train = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("image_audio",), limit=2))
    job = tiny_config_dict(str(train), None, str(tmp_path / "run"),
                           train={"steps": 1, "global_batch_size": 2, "microbatch_size": 2, "threads": 1})
    (tmp_path / "job.toml").write_text(to_toml(job) + "\n")
    tiny = AutoPlanInputs(1024.0, P2PModel(), "1 KiB (patched)", "none")
    monkeypatch.setattr("plait.commands.train.auto_plan_inputs", lambda *args, **kwargs: tiny)
    assert main(["train", "--config", str(tmp_path / "job.toml"), "--parallel.plan=auto", "--profile-store",
                 str(tmp_path / "profiles"), "--metrics.progress=false", "--metrics.tensorboard=false"]) != 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "parallel.plan=auto: no plan fits" in x)
    assert "no plan fits in 0.0 MiB per device (1 KiB (patched))" in line
    assert re.search(r"the least any option searched needs is about [\d.]+ MiB per device \(tp \d", line)
    assert "more processes" in line and "memory_cap=" not in line and line.count(";") == 1
