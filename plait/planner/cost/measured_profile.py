"""Measured unit costs as data: the profile of one model on one device, keyed so a stale one is never reused.

A :class:`Profile` holds what ``plait.measure.unit_timing`` measured for one microbatch shape: per pipeline unit
the raw timings and bytes (:class:`UnitMeasurement`), the planner's :class:`~plait.planner.types.UnitCost`
derived from them (so ``partitioner``, ``search`` and ``simulator`` take measured costs unchanged), and per
module the *chunk overhead*: what one module chunk of a stage costs beyond the sum of its units (the glue the
runtime runs once per chunk and action: rotary embeddings and mask construction of an LLM chunk, the loss,
feature placement, the stage wrapper's Python). :func:`stage_action_costs` turns a profile into the
simulator's per-stage action costs.

The :class:`ProfileKey` names everything the numbers depend on: the model (config dicts and freezing
flags), the microbatch shapes, the dtype, the device (name and thread count), the plait version and the
torch version; :meth:`ProfileKey.digest` names its file. :func:`profile_mismatch` compares every key field of a
stored profile with the requested key and names the fields that differ, so the caller re-measures instead of
silently reusing numbers of another model or machine.

Pure data: no torch and no files here; ``plait.commands.profile.ProfileStore``
reads and writes profiles (``Profile.to_dict`` / ``from_dict``) as JSON files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait.planner.cost.types import ProfileKey
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.serialize import JsonDataclass, dataclass_from_dict
from plait.planner.types import Unit, UnitCost

__all__ = ["FORMAT_VERSION", "OVERHEAD_KINDS", "Profile", "UnitMeasurement", "profile_mismatch", "stage_action_costs"]

FORMAT_VERSION = 1
OVERHEAD_KINDS = ("F", "B", "B_split", "W_split")


def profile_mismatch(stored: ProfileKey, wanted: ProfileKey) -> str | None:
    """Why a profile measured under ``stored`` must not be used for ``wanted`` (None when every field agrees).

    Returns:
        e.g. ``"dtype differs (stored 'float32', wanted 'bfloat16'); torch_version differs (...)"``; for the
        model and shapes the first differing entry is named (``model.llm.freeze``).
    """
    reasons = []
    for field in dataclasses.fields(ProfileKey):
        a, b = getattr(stored, field.name), getattr(wanted, field.name)
        if a != b:
            where = _first_difference(a, b, field.name)
            reasons.append(f"{where} differs (stored {_short(_at(a, where))}, wanted {_short(_at(b, where))})")
    return "; ".join(reasons) or None


def _first_difference(a: Any, b: Any, path: str) -> str:
    """Dotted path of the first place where nested dicts/lists ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key, _MISSING) != b.get(key, _MISSING):
                if key in a and key in b:
                    return _first_difference(a[key], b[key], f"{path}.{key}")
                return f"{path}.{key}"
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return path


_MISSING = "<missing>"


def _at(value: Any, path: str) -> Any:
    """The entry of ``value`` at dotted ``path`` (its first component names the field itself)."""
    parts = path.replace("[", ".[").split(".")[1:]
    for part in parts:
        if part.startswith("["):
            index = int(part[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else _MISSING
        else:
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
    return value


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class UnitMeasurement(JsonDataclass):
    """Raw measurements of one unit for one microbatch (mean over the profiled microbatches of the median
    over repetitions after warm-up). Times in seconds, memory in bytes.

    Attributes:
        name: the unit's name (``Unit.name``).
        forward_s: forward time (graph recorded, as in training).
        input_grad_s: backward w.r.t. the unit's input only (dX); 0 when the input is raw data (pixels, ids).
        weight_grad_s: backward w.r.t. the unit's parameters only (dW); measured with the parameters made
            trainable for the measurement, so frozen units have one too (for frozen-unaware planning).
        fused_backward_s: one backward computing both (what an unsplit backward runs).
        param_bytes: parameter bytes; grad_bytes: gradient bytes of its trainable parameters;
        optimizer_bytes: AdamW state bytes of its trainable parameters (measured after one step);
        activation_bytes: bytes of the tensors its forward saves for backward (parameters excluded) under
            the real freezing flags; output_bytes: bytes of its output.
        split_input_grad_s, split_weight_grad_s: the pipeline runtime's own split backward of zero-bubble
            schedules (``plait.parallel.pipeline.split_backward``; Qi et al., ICLR 2024, section 2), every
            parameter trainable: ``B`` (``input_gradients``: dX, keeping the gradients at the weights'
            intermediates) and ``W`` (``weight_gradients`` from those kept gradients, a backward of its own);
            0 when the unit's input is raw data. None in profiles measured before they existed: split
            schedules are then charged by the fused rule (:meth:`to_cost`).
    """

    name: str
    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    fused_backward_s: float
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    split_input_grad_s: float | None = None
    split_weight_grad_s: float | None = None

    @property
    def has_split(self) -> bool:
        """Whether the runtime's split backward was measured (both split fields set)."""
        return self.split_input_grad_s is not None and self.split_weight_grad_s is not None

    def to_cost(self, unit: Unit) -> UnitCost:
        """The planner's cost of ``unit`` (real flags), chosen so the simulator charges the backward the runtime
        runs: ``input_grad_s`` = dX; ``weight_grad_s`` = fused - dX when the unit needs an input gradient (the
        extra cost of also producing weight gradients), else dW alone; so ``UnitCost.backward_s(unit)`` is the
        fused backward. The split fields carry the measured split ``B`` and ``W`` (``UnitCost.split_backward_s``
        charges them to a trainable unit needing an input gradient under a split-backward schedule)."""
        if unit.needs_input_grad:
            weight = max(0.0, self.fused_backward_s - self.input_grad_s)
        else:
            weight = self.weight_grad_s
        split = (self.split_input_grad_s, self.split_weight_grad_s) if self.has_split else (None, None)
        return UnitCost(self.forward_s, self.input_grad_s, weight, self.param_bytes, self.activation_bytes,
                        self.output_bytes, 0.0, 0, *split)


@dataclass(frozen=True)
class Profile:
    """A measured profile (module docstring).

    Attributes:
        key: what it was measured for.
        units: the pipeline units (real freezing flags), in model order.
        measurements: one :class:`UnitMeasurement` per unit, same order.
        chunk_overhead_s: per module, seconds one chunk of that module costs per action beyond its units:
            ``{"F": forward, "B": backward}`` (the backward the runtime runs unsplit; may be negative where
            units measured alone are slower than inside a chunk); a chunk whose input needs a gradient also
            ``"B_split"`` and ``"W_split"``: its glue in the runtime's split backward beyond the units' split
            ``B`` and ``W`` (absent in older profiles: split schedules then put ``"B"`` on ``B``).
        repeats, warmup: repetitions timed and discarded per measurement.
        action_overhead_s: seconds the pipeline runtime spends per action beyond the stage's own work
            (bookkeeping of the executor; measured in one process, so without P2P transfers).
        router_load: per MoE layer unit, the router's measured share of the routed tokens per expert (any
            non-negative counts; ``cost.experts.expert_layers`` takes it as ``ExpertLayer.load``, the expert load
            imbalance under EP); empty: uniform routing assumed.

    Raises:
        ValueError: when ``units`` and ``measurements`` do not match one to one, or a ``router_load`` entry names
            no unit or has a negative or all-zero load.
    """

    key: ProfileKey
    units: tuple[Unit, ...]
    measurements: tuple[UnitMeasurement, ...]
    chunk_overhead_s: Mapping[str, Mapping[str, float]]
    repeats: int = 0
    warmup: int = 0
    action_overhead_s: float = 0.0
    router_load: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.key, ProfileKey):
            object.__setattr__(self, "key", ProfileKey.from_dict(self.key))
        object.__setattr__(self, "units", tuple(u if isinstance(u, Unit) else Unit.from_dict(u) for u in self.units))
        object.__setattr__(self, "measurements", tuple(
            m if isinstance(m, UnitMeasurement) else UnitMeasurement.from_dict(m) for m in self.measurements))
        object.__setattr__(self, "chunk_overhead_s",
                           {str(m): {str(k): float(v) for k, v in d.items()} for m, d in self.chunk_overhead_s.items()})
        names = [u.name for u in self.units]
        if names != [m.name for m in self.measurements]:
            raise ValueError(f"Profile: measurements {[m.name for m in self.measurements][:3]}... do not match "
                             f"units {names[:3]}...")
        loads = {str(n): tuple(float(x) for x in v) for n, v in self.router_load.items()}
        object.__setattr__(self, "router_load", loads)
        for name, load in loads.items():
            if name not in names:
                raise ValueError(f"Profile.router_load[{name!r}]: no such unit")
            if not load or min(load) < 0 or not sum(load) > 0:
                raise ValueError(f"Profile.router_load[{name!r}]: loads must be >= 0 and not all 0, got {load[:4]}")
        for module, kinds in self.chunk_overhead_s.items():
            unknown = set(kinds) - set(OVERHEAD_KINDS)
            if unknown:
                raise ValueError(f"Profile.chunk_overhead_s[{module!r}]: unknown kind(s) {sorted(unknown)}")

    @property
    def costs(self) -> tuple[UnitCost, ...]:
        """The planner's per-unit costs (``UnitMeasurement.to_cost``), same order as ``units``."""
        return tuple(m.to_cost(u) for u, m in zip(self.units, self.measurements))

    def cost_map(self) -> dict[str, UnitCost]:
        """``{unit name: UnitCost}``."""
        return {u.name: c for u, c in zip(self.units, self.costs)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (with the file format version)."""
        return {"format": FORMAT_VERSION, "key": self.key.to_dict(), "units": [u.to_dict() for u in self.units],
                "measurements": [m.to_dict() for m in self.measurements],
                "chunk_overhead_s": {m: dict(d) for m, d in self.chunk_overhead_s.items()},
                "repeats": self.repeats, "warmup": self.warmup, "action_overhead_s": self.action_overhead_s,
                "router_load": {n: list(v) for n, v in self.router_load.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: on another file format version or unknown/missing fields.
        """
        data = dict(data)
        version = data.pop("format", None)
        if version != FORMAT_VERSION:
            raise ValueError(f"profile format {version!r} is not {FORMAT_VERSION}")
        return dataclass_from_dict(cls, data)


def stage_action_costs(plan: PipelinePlan, profile: Profile, *,
                       split_backward: bool = False) -> dict[tuple[int, str], float]:
    """Per-stage action seconds ``{(stage, kind): s}`` for ``simulator.simulate`` from a measured profile.

    ``F`` = the stage's unit forwards plus, per module chunk of the stage, that module's forward chunk
    overhead. Unsplit, ``B`` = the units' ``UnitCost.backward_s`` plus each chunk's backward overhead (none
    for a chunk that runs no backward).

    Split, on a stage whose input needs a gradient: ``B`` and ``W`` = the units' ``UnitCost.split_backward_s``
    (the runtime's split backward measured per unit where the profile has it, else dX of the units needing one
    and ``weight_grad_s`` of the trainable ones). A module's split glue ``B_split`` / ``W_split`` (measured on a
    chunk holding the whole module) goes to ``B`` / ``W``, each chunk its share of the module's units' split
    ``B`` / ``W``: unlike the forward's glue (rotary embeddings, masks: once per chunk) it scales with the work
    split (the demo LLM in 4 chunks ran the split ``B`` and ``W`` of one chunk, within noise, in sum, while its
    forwards paid their glue 4 times). Without split glue (older profiles) a chunk's backward overhead goes to
    ``B`` when the chunk needs an input gradient, else to ``W``. On a stage whose input needs no gradient ``B`` has nothing to do and ``W`` is one unsplit backward (the
    runtime's split backward): the fused costs and backward overhead, all on ``W``.

    A sum below 0 is clipped to 0. Every action the stage runs (``F``; ``B`` and ``W`` when it runs a backward)
    also pays the runtime's ``action_overhead_s``.

    Raises:
        ValueError: when a unit of the plan is not in the profile.
    """
    by_name = {u.name: (u, c) for u, c in zip(profile.units, profile.costs)}
    whole: dict[str, list[float]] = {}  # per module, the split B and W of all its units (the glue's measure)
    for u, c in by_name.values():
        sums = whole.setdefault(u.module, [0.0, 0.0])
        sums[0], sums[1] = (a + b for a, b in zip(sums, c.split_backward_s(u)))
    out: dict[tuple[int, str], float] = {}
    for stage in plan.stages:
        split_stage = split_backward and stage.needs_input_grad  # no input gradient: W is one unsplit backward
        f = dx = dw = 0.0
        for module in stage.modules:
            names = stage.module_units(module)
            missing = [n for n in names if n not in by_name]
            if missing:
                raise ValueError(f"stage {stage.index}: unit(s) {missing[:3]} are not in the profile")
            pairs = [by_name[n] for n in names]
            over = profile.chunk_overhead_s.get(module, {})
            f += sum(c.forward_s for _, c in pairs) + over.get("F", 0.0)
            needs_dx = any(u.needs_input_grad for u, _ in pairs)
            trains = any(u.trainable for u, _ in pairs)
            if split_stage:
                chunk_dx, chunk_dw = (sum(x) for x in zip((0.0, 0.0), *(c.split_backward_s(u) for u, c in pairs)))
            else:
                chunk_dx = sum(c.input_grad_s for u, c in pairs if u.needs_input_grad)
                chunk_dw = sum(c.weight_grad_s for u, c in pairs if u.trainable)
            dx, dw = dx + chunk_dx, dw + chunk_dw
            back = over.get("B", 0.0) if (needs_dx or trains) else 0.0
            if split_stage and needs_dx and "B_split" in over and "W_split" in over:
                # the module's glue in the runtime's split backward, this chunk's share of its units' split work
                total_dx, total_dw = whole[module]
                dx += over["B_split"] * (chunk_dx / total_dx if total_dx > 0 else 1.0)
                dw += over["W_split"] * (chunk_dw / total_dw if total_dw > 0 else 1.0) if trains else 0.0
            elif needs_dx:
                dx += back
            else:
                dw += back
        f, dx, dw = max(0.0, f), max(0.0, dx), max(0.0, dw)
        act = profile.action_overhead_s
        runs = stage.runs_backward
        if split_backward and not stage.needs_input_grad:  # B has nothing to send: W runs the whole backward
            dx, dw = 0.0, dx + dw
        out[(stage.index, "F")] = f + act
        out[(stage.index, "B")] = (dx if split_backward else dx + dw) + (act if runs else 0.0)
        out[(stage.index, "W")] = dw + (act if runs and split_backward else 0.0)
    return out
