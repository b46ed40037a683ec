"""``plait plan`` on the machine it runs on: the host's device by default (said in the output), CPU costs with the
runtime's overheads, and a report that explains idle devices, prints no layout for a one-stage plan and never
pairs ``layout = "encoder_parallel"`` with ``attach_encoders = true``."""

from __future__ import annotations

import io
import re
import tomllib
from pathlib import Path

import pytest
import torch

import plait.measure.host_costs as plan_costs
from plait.commands.plan.command import plan_command
from plait.commands.plan.compare import considered_plans, plan_label
from plait.measure.host_costs import CPU_OPTIMIZER_S_PER_BYTE, host_cpu, host_device, runtime_costs
from plait.planner.cost.types import ActionOverheads, DeviceSpec
from plait.planner.pipeline.plan import plan_pipeline, stage_ranks
from plait.planner.report import format_plan, idle_devices_note, pp_toml
from plait.planner.search.layout import evaluate_plan
from plait.planner.types import Unit, UnitCost
from plait.planner.search.types import Machine

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"


def test_host_device_is_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert host_device() == ("cpu", "this host has no GPU")


@pytest.mark.parametrize("name, preset", [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                          ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA L4", "h100")])
def test_host_device_is_the_gpus_preset(monkeypatch, name, preset):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    assert host_device() == (preset, f"this host's GPU is {name}")


def test_plan_defaults_to_the_host_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = io.StringIO()
    choice = plan_command(DEMO, 2, out=out, profile_store=None)
    text = out.getvalue()
    head = re.search(r"plait plan: planning for CPU \(this host, 1 thread: (\d+) GFLOP/s, [\d.]+ GB/s\) \(this host "
                     r"has no GPU; --device to plan for another\)", text)
    assert head and int(head.group(1)) > 0  # the demo's train.threads = 1
    assert "on 2 x CPU (this host" in text and "5.00 ms per module chunk and action, 0.10 ms per message" in text
    assert "ms per MB of trainable parameters" in text and "+ optimizer step" in text
    assert choice.p2p == P2P_CPU and choice.update_s > 0


def test_host_cpu_measures_this_host():
    spec = host_cpu(1, 4)
    assert spec.peak_flops > 1e9 and spec.hbm_bandwidth > 1e8 and spec.name.startswith("CPU (this host, 1 thread: ")
    assert spec.chunk_overhead_s == DeviceSpec.cpu().chunk_overhead_s and spec.efficiency == 0.3
    from plait.train.job_file import load_config_for_planning
    from plait.models.plan_inputs import build_plan_inputs

    cfg, _ = load_config_for_planning(DEMO)  # train.dtype auto: float32 on a CPU, as the trainer runs it
    assert build_plan_inputs(cfg, spec).dtype == "float32" and build_plan_inputs(cfg, "h100").dtype == "bfloat16"
    with pytest.raises(ValueError, match="threads and processes"):
        host_cpu(0, 1)


P2P_CPU = runtime_costs(DeviceSpec.cpu()).p2p


def test_runtime_costs_of_presets_and_profiles():
    cpu = runtime_costs(DeviceSpec.cpu())
    assert (cpu.p2p.latency_s, cpu.p2p.bandwidth_Bps, cpu.p2p.send_overhead_s, cpu.p2p.recv_overhead_s) == \
        (5e-5, 5e9, 1e-4, 1e-4)
    assert cpu.dp_link.bandwidth_Bps == 0.75e9 and cpu.dp_link.latency_s == 5e-5
    assert cpu.overheads == ActionOverheads(0.0, 5e-3, 5e-3, optimizer_s_per_byte=CPU_OPTIMIZER_S_PER_BYTE)
    gpu = runtime_costs(DeviceSpec.h100())  # as before: no overheads, no DP link unless asked
    assert gpu.dp_link is None and gpu.overheads.zero and gpu.p2p.send_overhead_s == 0.0
    assert runtime_costs(DeviceSpec.h100(), dp_link_Bps=1e9).dp_link.bandwidth_Bps == 1e9


def test_a_gpu_plan_ignores_stored_profiles(monkeypatch):
    def forbidden(*args):
        raise AssertionError("a GPU plan must not look for a CPU profile")

    monkeypatch.setattr(plan_costs, "stored_profile", forbidden)
    monkeypatch.setattr("plait.commands.plan.command.stored_profile", forbidden)
    out = io.StringIO()
    plan_command(DEMO, 8, device="h100", out=out)
    assert "planning for" not in out.getvalue() and "costs:" not in out.getvalue()


def _units():
    return [Unit("vision.0", "vision", "layer", True, False), Unit("vision.1", "vision", "projector", True, True),
            Unit("llm.0", "llm", "embed", True, True), Unit("llm.1", "llm", "layer", True, True),
            Unit("llm.2", "llm", "layer", True, True), Unit("llm.3", "llm", "head", True, True)]


def _costs(n):
    return [UnitCost(1e-3, 1e-3, 1e-3, 1000, 100, 10) for _ in range(n)]


def test_one_stage_plan_prints_no_layout_and_explains_idle_devices():
    units = _units()
    single = plan_pipeline(units, "encoders_colocated", ranks=[0, 0])
    choice = evaluate_plan(single, units, _costs(6), dp=2, microbatches=2, devices=8, machine=Machine(dtype="float32"))
    text = format_plan(choice)
    assert "layout" not in text
    assert ("no pipeline (the whole model on each rank), DP 2 = 2 of 8 devices; 6 devices idle: 2 microbatches per "
            "step: at most 2 pipelines, and pipelining the model was predicted no faster") in text
    assert plan_label(choice) == "DP 2, no pipeline"


def test_idle_devices_note_for_pipelines():
    units = _units()
    plan = plan_pipeline(units, "encoders_colocated")  # 2 ranks
    full = evaluate_plan(plan, units, _costs(6), dp=1, microbatches=4, devices=2, machine=Machine(dtype="float32"))
    assert idle_devices_note(full) == ""
    one_mb = evaluate_plan(plan, units, _costs(6), dp=1, microbatches=1, devices=3, machine=Machine(dtype="float32"))
    assert idle_devices_note(one_mb) == ("; 1 device idle: 1 microbatch per step: at most 1 pipeline, and a "
                                         "pipeline of more stages was predicted no faster")
    spare = evaluate_plan(plan, units, _costs(6), dp=1, microbatches=4, devices=3, machine=Machine(dtype="float32"))
    assert idle_devices_note(spare).startswith("; 1 device idle: no plan using them was predicted faster")
    assert "layout encoders_colocated, DP 1 x 2 pipeline ranks = 2 of 3 devices; stages: vision 1, llm 1; 1 device" \
        in format_plan(spare)


def test_a_table_never_pairs_encoder_parallel_with_attached_encoders():
    fields = {"degree": 2, "layout": "encoder_parallel", "stages": {"vision": 1, "audio": 1, "llm": 2},
              "attach_encoders": True, "schedule": "interleaved_1f1b"}
    text = pp_toml(fields, 1)
    table = tomllib.loads(text)["parallel"]["pp"]
    assert "layout" not in table and table["attach_encoders"] is True
    assert "# attach_encoders: every encoder is its own stage, all on the first LLM rank" in text
    colocated = pp_toml({**fields, "layout": "encoders_colocated"}, 1)
    assert tomllib.loads(colocated)["parallel"]["pp"]["layout"] == "encoders_colocated"


def test_an_attached_one_encoder_plan_is_written_colocated():
    from plait.planner.search.auto_layout import layout_pp_fields

    units = _units()
    plan = plan_pipeline(units, "encoder_parallel", stages_per_module={"llm": 2}, ranks=stage_ranks(1, 2, 1, True))
    choice = evaluate_plan(plan, units, _costs(6), dp=1, microbatches=4, schedule="interleaved_1f1b",
                           machine=Machine(dtype="float32"))
    fields = layout_pp_fields(choice, units)
    assert fields["layout"] == "encoders_colocated" and fields["attach_encoders"] is True
    assert plan_label(choice) == "DP 1 x 1F1B, encoders attached, 3 stages"


def test_considered_plans_are_distinct_and_runnable():
    recommended, plans = considered_plans(DEMO, 2, device="cpu-preset", profile_store=None)
    assert recommended == plan_command(DEMO, 2, device="cpu-preset", profile_store=None, out=io.StringIO())
    same = [c for _, c, _ in plans if (c.dp, c.schedule, c.plan, c.tp, c.dp_shard, c.fsdp_reshard) == (
        recommended.dp, recommended.schedule, recommended.plan, recommended.tp, recommended.dp_shard,
        recommended.fsdp_reshard)]
    assert len(same) == 1 and same[0].iteration_s == recommended.iteration_s
    labels = [label for label, _, _ in plans]
    assert "DP 2, no pipeline" in labels and len(set(labels)) == len(labels)
    assert all(recommended.iteration_s <= choice.iteration_s for _, choice, _ in plans)
    assert all(choice.devices_used == 2 for _, choice, _ in plans)
