"""``plait plan`` searches TP, FSDP2 sharding and activation checkpointing when the memory cap requires (issue 14,
item 5) and prints the chosen degrees in the ``[parallel]`` table it emits; the pasted table loads and runs them."""

from __future__ import annotations

import dataclasses
import io
import tomllib

from plait.commands.plan.command import plan_command
from plait.config.loader import load_config
from plait.planner.cost.types import DeviceSpec
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def _plan(memory_bytes: float, tmp_path, devices: int = 4):
    device = dataclasses.replace(DeviceSpec.h100(), memory_bytes=memory_bytes)
    out = io.StringIO()
    choice = plan_command(DEMO, devices, tmp_path / "plan.json", device=device, out=out, profile_store=None)
    return choice, out.getvalue()


def test_roomy_device_keeps_the_plain_plan(tmp_path):
    choice, text = _plan(80 * 2**30, tmp_path)
    assert (choice.tp, choice.dp_shard, choice.checkpointing) == (1, 1, "none")
    assert "memory: " not in text and "dp_shard = 1\n" in text


def test_tight_device_gets_sharding_and_the_table_runs_it(tmp_path):
    plain, _ = _plan(80 * 2**30, tmp_path, devices=1)
    whole = sum(plain.stage_memory_bytes)  # the demo model whole on one device
    choice, text = _plan(0.4 * whole / 0.9, tmp_path)  # cap 0.4 x that on each of 4 devices
    assert choice.fits_memory and (choice.tp, choice.dp_shard, choice.checkpointing) != (1, 1, "none")
    assert choice.devices_used <= 4
    assert max(choice.stage_memory_bytes) + choice.shard_buffer_bytes <= choice.memory_cap
    assert "memory: " in text
    snippet = text[text.index("to run this plan, put these tables in the job file:\n"):].split("\n", 1)[1]
    snippet = snippet[:snippet.index("or run it as printed")]
    table = tomllib.loads(snippet)["parallel"]
    assert (table["dp"] * table["dp_shard"], table["dp_shard"], table["tp"]) == (choice.dp, choice.dp_shard,
                                                                                 choice.tp)
    assert table["plan"] == "manual" and ("pp" in table) == (choice.plan.num_ranks > 1)  # [parallel.pp]: pipelines
    job = tmp_path / "job.toml"
    text_job = DEMO.read_text()
    if choice.checkpointing != "none":
        text_job = text_job.replace("[train]\n", f"[train]\nactivation_checkpointing = \"{choice.checkpointing}\"\n")
    job.write_text(text_job + "\n" + snippet)
    cfg = load_config(job)
    assert (cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.tp) == (table["dp"], choice.dp_shard, choice.tp)
    assert cfg.train.activation_checkpointing == choice.checkpointing
