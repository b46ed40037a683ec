"""What ``plait plan`` charges on the machine it plans for: the host's device by default, and on a CPU the measured
profile of the job when one is stored, else the analytic costs plus the CPU preset's measured overheads.

- :func:`host_device`: the device preset of this host (the preset matching the GPU's name, ``"cpu"`` without a
  GPU) and a sentence saying so; :func:`host_cpu`: this host's CPU measured (a fraction of a second): matmul
  FLOP/s and memory bandwidth of one process with the job's threads.
- :func:`stored_profile`: the job's profile from a ``plait profile`` store when its key matches this machine,
  model, microbatch shape and versions (``plait.measure.job_profile.ProfileStore.load``), else None and why.
- :func:`runtime_costs`: the link, DP link and ``ActionOverheads`` a plan is searched with, from a preset or a
  profile: per module chunk and action (``DeviceSpec.chunk_overhead_s`` or ``Profile.chunk_overhead_s``), per
  action of the pipeline executor (``Profile.action_overhead_s``) and per message (``DeviceSpec.message_overhead_s``,
  LogP's ``o`` at each end, ``P2PModel`` send / receive overheads).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.planner.cost.types import ActionOverheads, DeviceSpec
from plait.planner.cost.measured_profile import Profile
from plait.planner.pipeline.types import P2PModel

__all__ = ["CPU_ALLREDUCE_BPS", "CPU_OPTIMIZER_S_PER_BYTE", "RuntimeCosts", "host_cpu", "host_device",
           "measured_overheads", "runtime_costs", "stored_profile"]

CPU_ALLREDUCE_BPS = 0.75e9
"""Bandwidth (B/s) of the DP gradient all-reduce between CPU processes (``search_model.allreduce_s``'s link): gloo's
all-reduce of 4-132 MB float32 buffers between 2 processes on a 2-core CPU took 0.75-1.06 GB/s (132 MB: 174 ms),
far below the stage link's point-to-point copy."""

CPU_OPTIMIZER_S_PER_BYTE = 5e-9
"""AdamW step seconds per byte of float32 trainable parameters on one CPU core, charged on every CPU plan: measured
on a 2-core CPU, 4.7-5.3 ns per byte for 4M-33M parameters (0.7 s for 33M) in a quiet process. Timing it while
planning was tried and dropped: on a shared machine it read 1-10 ns per byte from one run to the next."""


def host_cpu(threads: int, processes: int) -> DeviceSpec:
    """This host's CPU as one process of a job sees it, measured with ``threads`` intra-op threads (restored
    after): the best of 5 products of two 512 x 512 float32 matrices (peak FLOP/s; a model's layers reach the CPU
    preset's efficiency of it) and the best of 3 ``x * 2`` over 8M floats (bytes read and written per second);
    memory: physical RAM divided by ``processes``; the CPU preset's link and overheads. A fraction of a second.

    Raises:
        ValueError: on ``threads`` or ``processes`` < 1.
    """
    if threads < 1 or processes < 1:
        raise ValueError(f"threads and processes must be >= 1, got {threads} and {processes}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        flops = 2 * 512**3 / _best(lambda: a @ b, 5)
        x = torch.randn(1 << 23)
        bandwidth = 2 * x.numel() * 4 / _best(lambda: x * 2.0, 3)
    finally:
        torch.set_num_threads(before)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    preset = DeviceSpec.cpu()
    name = (f"CPU (this host, {threads} thread{'s' if threads > 1 else ''}: {flops / 1e9:.0f} GFLOP/s, "
            f"{bandwidth / 1e9:.1f} GB/s)")
    return dataclasses.replace(preset, name=name, peak_flops=flops, hbm_bandwidth=bandwidth,
                               memory_bytes=ram / processes)


def _best(fn: Any, repeats: int) -> float:
    """Shortest of ``repeats`` timed calls of ``fn`` after one warm-up (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def host_device() -> tuple[str, str]:
    """This host's device preset and a sentence saying why: the H200 / H100 / A100 preset whose name is in the
    first CUDA device's name (others: H100), or ``"cpu"`` when ``torch.cuda.is_available()`` is False."""
    if not torch.cuda.is_available():
        return "cpu", "this host has no GPU"
    name = torch.cuda.get_device_name(0)
    preset = next((p for p in ("h200", "h100", "a100") if p.upper() in name.upper()), "h100")
    return preset, f"this host's GPU is {name}"


def stored_profile(cfg: Any, store: str | Path) -> tuple[Profile | None, str]:
    """The stored ``plait profile`` of the job ``cfg`` on this machine, or None and why not (no training data,
    the data or model cannot be built, no stored profile for the key, a stale one: ``ProfileStore.load``'s
    reasons). Building the key builds the job's model and first microbatch on the CPU, as ``plait profile``
    does (``build_profile_inputs``, default ``--microbatches 1`` and ``--microbatch-size``)."""
    from plait.measure.job_profile import ProfileStore, build_profile_inputs

    if not cfg.data.train:
        return None, "the job has no data.train to key a profile"
    try:
        inputs = build_profile_inputs(cfg, device="cpu")
    except (ValueError, FileNotFoundError, OSError) as exc:
        return None, f"the job's profile key cannot be built ({exc})"
    return ProfileStore(store).load(inputs.key)


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's costs a plan is searched and timed with.

    Attributes:
        p2p: stage-to-stage link with its per-message host overheads.
        dp_link: link of the DP gradient all-reduce (None: not charged).
        overheads: fixed seconds per action and module chunk (``ActionOverheads``).
        source: one line saying where the numbers come from.
    """

    p2p: P2PModel
    dp_link: P2PModel | None
    overheads: ActionOverheads
    source: str


def measured_overheads(profile: Profile, optimizer_s_per_byte: float = 0.0) -> ActionOverheads:
    """The runtime's fixed costs measured in ``profile``: seconds per action and per module chunk (F, B; a negative
    chunk overhead, a measurement that ran faster as one chunk, is taken as 0), with ``optimizer_s_per_byte``
    seconds of optimizer step per trainable byte. The one reading of a profile's overheads (``plait plan`` and
    ``parallel.plan = "auto"``)."""
    modules = {m: (max(0.0, d.get("F", 0.0)), max(0.0, d.get("B", 0.0))) for m, d in profile.chunk_overhead_s.items()}
    return ActionOverheads(max(0.0, profile.action_overhead_s), modules=modules,
                           optimizer_s_per_byte=optimizer_s_per_byte)


def runtime_costs(spec: DeviceSpec, profile: Profile | None = None, dp_link_Bps: float | None = None) -> RuntimeCosts:
    """The link, DP link and overheads of ``spec`` (and ``profile``'s measured overheads when given).

    The stage link is ``spec``'s latency and bandwidth with ``spec.message_overhead_s`` at each end. The DP link
    is ``dp_link_Bps`` when given, else on a device with host overheads (a CPU) ``spec``'s latency with
    ``CPU_ALLREDUCE_BPS``, else none (GPU presets, as before). Overheads: the profile's per-action and
    per-module chunk overheads (a negative chunk overhead, a measurement that ran faster as one chunk, is
    taken as 0), else ``ActionOverheads.of_device(spec)``. The optimizer step per trainable byte is
    ``CPU_OPTIMIZER_S_PER_BYTE`` on a device with host overheads, else 0 (GPU presets).
    """
    o = spec.message_overhead_s
    p2p = P2PModel(spec.link_latency, spec.link_bandwidth, send_overhead_s=o, recv_overhead_s=o)
    host = bool(o or spec.chunk_overhead_s)
    dp_link = P2PModel(spec.link_latency, dp_link_Bps) if dp_link_Bps is not None else (
        P2PModel(spec.link_latency, CPU_ALLREDUCE_BPS) if host else None)
    optimizer_s_per_byte = CPU_OPTIMIZER_S_PER_BYTE if host else 0.0
    if profile is not None:
        overheads = measured_overheads(profile, optimizer_s_per_byte)
        chunks = ", ".join(f"{m} {1e3 * f:.1f}/{1e3 * b:.1f}" for m, (f, b) in overheads.modules.items())
        source = (f"measured profile ({profile.key.device}): runtime {1e3 * overheads.per_action_s:.2f} ms per action, "
                  f"chunk overheads F/B ms {chunks}; {1e3 * o:.2f} ms per message and end")
    else:
        overheads = dataclasses.replace(ActionOverheads.of_device(spec), optimizer_s_per_byte=optimizer_s_per_byte)
        source = (f"analytic costs ({spec.name}): {1e3 * spec.chunk_overhead_s:.2f} ms per module chunk and "
                  f"action, {1e3 * o:.2f} ms per message and end")
    if optimizer_s_per_byte:
        source += f"; optimizer step {1e9 * optimizer_s_per_byte:.1f} ms per MB of trainable parameters"
    return RuntimeCosts(p2p, dp_link, overheads, source)
