"""What ``plait plan`` charges on the machine it plans for: the host's device by default, and on a CPU the measured
profile of the job when one is stored, else the analytic costs plus the CPU preset's measured overheads.

- :func:`host_device`: the device preset of this host (the preset matching the GPU's name, ``"cpu"`` without a
  GPU) and a sentence saying so.
- :func:`stored_profile`: the job's profile from a ``plait profile`` store when its key matches this machine,
  model, microbatch shape and versions (``plait.commands.profile.ProfileStore.load``), else None and why.
- :func:`runtime_costs`: the link, DP link and ``ActionOverheads`` a plan is searched with, from a preset or a
  profile: per module chunk and action (``DeviceSpec.chunk_overhead_s`` or ``Profile.chunk_overhead_s``), per
  action of the pipeline executor (``Profile.action_overhead_s``) and per message (``DeviceSpec.message_overhead_s``,
  LogP's ``o`` at each end, ``P2PModel`` send / receive overheads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plait.planner.cost_model import DeviceSpec
from plait.planner.overheads import ActionOverheads
from plait.planner.profile import Profile
from plait.planner.simulator import P2PModel

__all__ = ["RuntimeCosts", "host_device", "runtime_costs", "stored_profile"]


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
    from plait.commands.profile import ProfileStore, build_profile_inputs

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


def runtime_costs(spec: DeviceSpec, profile: Profile | None = None, dp_link_Bps: float | None = None) -> RuntimeCosts:
    """The link, DP link and overheads of ``spec`` (and ``profile``'s measured overheads when given).

    The stage link is ``spec``'s latency and bandwidth with ``spec.message_overhead_s`` at each end. The DP link
    is ``dp_link_Bps`` when given, else ``spec``'s link on a device with host overheads (a CPU: gloo all-reduces
    cost as much as its messages), else none (GPU presets, as before). Overheads: the profile's per-action and
    per-module chunk overheads (a negative chunk overhead, a measurement that ran faster as one chunk, is
    taken as 0), else ``ActionOverheads.of_device(spec)``.
    """
    o = spec.message_overhead_s
    p2p = P2PModel(spec.link_latency, spec.link_bandwidth, send_overhead_s=o, recv_overhead_s=o)
    host = bool(o or spec.chunk_overhead_s)
    dp_link = P2PModel(spec.link_latency, dp_link_Bps) if dp_link_Bps is not None else (
        P2PModel(spec.link_latency, spec.link_bandwidth) if host else None)
    if profile is not None:
        modules = {m: (max(0.0, d.get("F", 0.0)), max(0.0, d.get("B", 0.0))) for m, d in profile.chunk_overhead_s.items()}
        overheads = ActionOverheads(max(0.0, profile.action_overhead_s), modules=modules)
        chunks = ", ".join(f"{m} {1e3 * f:.1f}/{1e3 * b:.1f}" for m, (f, b) in modules.items())
        source = (f"measured profile ({profile.key.device}): runtime {1e3 * overheads.per_action_s:.2f} ms per action, "
                  f"chunk overheads F/B ms {chunks}; {1e3 * o:.2f} ms per message and end")
    else:
        overheads = ActionOverheads.of_device(spec)
        source = (f"analytic costs ({spec.name} preset): {1e3 * spec.chunk_overhead_s:.2f} ms per module chunk and "
                  f"action, {1e3 * o:.2f} ms per message and end")
    return RuntimeCosts(p2p, dp_link, overheads, source)
