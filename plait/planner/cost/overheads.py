"""The runtime's fixed costs of a pipeline action, beyond its units' work: one definition (``ActionOverheads``) that
the layout search's stage costs (``search_model.fill_stages``) and the timing of a plan (``search.evaluate_plan``)
both charge. Per-message host costs are the ``simulator.P2PModel``'s send and receive overheads (LogP's ``o``).
Where the numbers come from: a device preset (``cost_model.DeviceSpec.chunk_overhead_s``) or a measured profile
(``profile.Profile.action_overhead_s`` and ``chunk_overhead_s``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plait.planner.cost.analytic import DeviceSpec
from plait.planner.serialize import JsonDataclass

__all__ = ["ActionOverheads"]


@dataclass(frozen=True)
class ActionOverheads(JsonDataclass):
    """Fixed host seconds a pipeline action costs beyond its units' work: the one definition of this term.
    The layout search's stage costs (``search_model.fill_stages``) and the timing of a plan
    (``search.evaluate_plan``) both add ``stage_s``; the per-message overheads are the ``P2PModel``'s.

    A stage action (``F``, or ``B`` when the stage runs a backward) pays ``per_action_s`` (the pipeline
    executor's bookkeeping) plus, for each module chunk of the stage (one per module it holds; ``B`` only for a
    chunk that runs a backward), that module's chunk overhead: ``modules[module]`` as ``(F, B)`` seconds, else
    ``(chunk_forward_s, chunk_backward_s)``. A one-rank plan runs no executor: ``per_action_s`` is not charged
    there (``stage_s(..., pipelined=False)``), its chunks are.

    After the flush every rank also steps its optimizer over its trainable parameters: ``update_s`` of their bytes
    (``optimizer_s_per_byte`` per byte; AdamW on a CPU core: about 5 ns per byte, 0.7 s for 33M float32
    parameters), charged by the search and ``evaluate_plan`` with the DP all-reduce (``search_model.flush_s``).

    Attributes:
        per_action_s: seconds per action of the pipeline runtime (``Profile.action_overhead_s``).
        chunk_forward_s, chunk_backward_s: seconds per module chunk and action, for modules not in ``modules``.
        modules: per module, ``(forward, backward)`` chunk seconds (``Profile.chunk_overhead_s``).
        optimizer_s_per_byte: seconds of the optimizer step per byte of a rank's trainable parameters.

    Raises:
        ValueError: on a negative value.
    """

    per_action_s: float = 0.0
    chunk_forward_s: float = 0.0
    chunk_backward_s: float = 0.0
    modules: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    optimizer_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        modules = {str(m): (float(v[0]), float(v[1])) for m, v in dict(self.modules).items()}
        object.__setattr__(self, "modules", modules)
        values = [self.per_action_s, self.chunk_forward_s, self.chunk_backward_s, self.optimizer_s_per_byte]
        values += [x for v in modules.values() for x in v]
        if any(not v >= 0 for v in values):
            raise ValueError(f"ActionOverheads must be >= 0, got {self}")

    @classmethod
    def of_device(cls, spec: DeviceSpec) -> "ActionOverheads":
        """The analytic overheads of a device preset: ``spec.chunk_overhead_s`` for every chunk and direction."""
        return cls(0.0, spec.chunk_overhead_s, spec.chunk_overhead_s)

    @property
    def zero(self) -> bool:
        """True when no action pays anything (a GPU preset): plans are timed as without overheads."""
        return not (self.per_action_s or self.chunk_forward_s or self.chunk_backward_s or self.optimizer_s_per_byte
                    or any(any(v) for v in self.modules.values()))

    def update_s(self, grad_bytes: float) -> float:
        """Seconds of one rank's optimizer step over ``grad_bytes`` bytes of trainable parameters."""
        return self.optimizer_s_per_byte * grad_bytes

    def chunk_s(self, module: str, kind: str) -> float:
        """Seconds one chunk of ``module`` costs per ``kind`` action (``"F"`` or ``"B"``).

        Raises:
            ValueError: on another kind.
        """
        if kind not in ("F", "B"):
            raise ValueError(f"action kind must be 'F' or 'B', got {kind!r}")
        pair = self.modules.get(module, (self.chunk_forward_s, self.chunk_backward_s))
        return pair[0] if kind == "F" else pair[1]

    def stage_s(self, kind: str, chunks: Sequence[tuple[str, bool]], pipelined: bool = True) -> float:
        """Seconds a stage's ``kind`` action costs beyond its units (class docstring).

        Args:
            kind: ``"F"`` or ``"B"``.
            chunks: the stage's module chunks as ``(module, runs_backward)``.
            pipelined: the plan runs on the pipeline executor (more than one rank): ``per_action_s`` is charged.

        Returns:
            0 for a ``B`` of a stage none of whose chunks runs a backward.
        """
        ran = [m for m, back in chunks if kind == "F" or back]
        if not ran:
            return 0.0
        return (self.per_action_s if pipelined else 0.0) + sum(self.chunk_s(m, kind) for m in ran)
