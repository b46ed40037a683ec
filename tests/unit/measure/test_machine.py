"""Auto-plan machine facts without processes: the per-device memory cap and the NCCL link preset."""

from __future__ import annotations

import os

import pytest

import plait.measure.machine as machine
from plait.measure.link import describe_link, job_link, preset_link
from plait.measure.machine import MEMORY_FRACTION, auto_plan_inputs, device_memory_bytes, memory_cap
from plait.planner.cost.types import DeviceSpec
from plait.planner.pipeline.types import P2PModel

PAGE, PAGES = 4096, 3_000_001  # an odd page count: the division by processes rounds down


@pytest.fixture
def fake_ram(monkeypatch):
    """Physical RAM of ``PAGE * PAGES`` bytes as ``os.sysconf`` reports it."""
    values = {"SC_PAGE_SIZE": PAGE, "SC_PHYS_PAGES": PAGES}
    monkeypatch.setattr(machine.os, "sysconf", lambda name: values[name])
    return PAGE * PAGES


@pytest.mark.parametrize("local", [None, "1", "4", "7"])
def test_cpu_memory_is_ram_shared_by_the_processes_of_the_host(fake_ram, monkeypatch, local):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    n = int(local or 1)
    total, source = device_memory_bytes("cpu")
    assert total == fake_ram // n and f"/ {n} process(es)" in source
    cap, text = memory_cap("cpu")
    assert cap == pytest.approx(0.9 * (fake_ram // n)) and MEMORY_FRACTION == 0.9
    assert text.startswith(f"{cap / 2**30:.1f} GiB (90% of RAM {fake_ram / 2**30:.1f} GiB")
    assert memory_cap("cpu", 0.5)[0] == pytest.approx(0.5 * (fake_ram // n))


@pytest.mark.parametrize("bad", ["0", "-2", "two", ""])
def test_a_bad_local_world_size_is_named(fake_ram, monkeypatch, bad):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer >= 1"):
        device_memory_bytes("cpu")


def test_bad_fraction_and_unknown_device_are_errors(fake_ram):
    for fraction in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"memory fraction must be in \(0, 1\]"):
            memory_cap("cpu", fraction)
    with pytest.raises(ValueError, match="'meta' device is not known"):
        device_memory_bytes("meta")


def test_single_process_inputs_have_the_cap_and_no_link(fake_ram, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    inputs = auto_plan_inputs("cpu", 1 << 20)
    assert inputs.memory_cap_bytes == pytest.approx(0.9 * (fake_ram // 2))
    assert inputs.p2p == P2PModel() and inputs.link_source == "none (1 process)"
    assert inputs.describe() == f"memory cap {inputs.memory_source} per rank; link none (1 process)"
    assert job_link("cpu", 1 << 20) == (P2PModel(), "none (1 process)")


def test_the_real_host_has_some_ram():
    if "LOCAL_WORLD_SIZE" in os.environ:
        pytest.skip("running under a launcher")
    assert device_memory_bytes("cpu")[0] > 2**28


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H200", DeviceSpec.h200()), ("NVIDIA H100 80GB HBM3", DeviceSpec.h100()),
    ("NVIDIA A100-SXM4-80GB", DeviceSpec.a100()), ("Tesla V100", DeviceSpec.h100()),
])
def test_nccl_preset_is_the_device_specs_link(name, preset):
    model, label = preset_link(name)
    assert model == P2PModel(preset.link_latency, preset.link_bandwidth) and label == preset.name


def test_describe_link():
    assert describe_link(P2PModel(45e-6, 1.2e9, 20e-6, 15e-6)) == "45 us + 1.20 GB/s, overhead send 20 us / recv 15 us"
    assert describe_link(P2PModel()) == "0 us + unlimited, overhead send 0 us / recv 0 us"
