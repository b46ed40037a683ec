"""The pipeline room's value types: a pipeline plan (its stages, layout and ranks), the stage-to-stage link
model, and what simulating a plan returns (per-stage memory, timeline events, the result).

Frozen dataclasses that round-trip through JSON (``serialize.JsonDataclass``). A :class:`PipelinePlan` checks
itself on construction (stages, module order, ranks, gradient flow); building plans is ``plan``'s job, timing
them ``simulator``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from plait.planner.serialize import JsonDataclass
from plait.planner.types import LLM_MODULE

__all__ = [
    "LAYOUTS",
    "P2PModel",
    "PipelinePlan",
    "SimResult",
    "Stage",
    "StageMemory",
    "TimelineEvent",
]

LAYOUTS = ("encoder_parallel", "encoders_colocated")


@dataclass(frozen=True)
class Stage(JsonDataclass):
    """One pipeline stage: an ordered run of units, on one pipeline rank.

    Attributes:
        index: position of the stage in the plan (a topological order of the stage DAG).
        modules: the model part(s) the stage serves, in unit order: ``("llm",)``, ``("vision",)`` or,
            for a colocated encoder stage, every encoder (``("vision", "audio")``).
        units: the stage's unit names, in execution order; for a multi-module stage the units come module
            by module, in the order of ``modules``.
        rank: the pipeline rank (coordinate on the PP axis) that runs the stage. A rank may hold several
            stages when the plan says so.
        trainable: any unit of the stage trains (its backward computes weight gradients, dW).
        needs_input_grad: the first unit of any of the stage's module chunks needs an input gradient, so
            the stage's backward must produce the gradient of its input(s) (dX) for its predecessors.
        module_unit_counts: how many of ``units`` belong to each entry of ``modules`` (defaults to
            ``(len(units),)`` for a single-module stage).
        replica: which copy of a replicated encoder stage this is (``0..replicas-1``).
        replicas: how many copies of the stage run side by side (an encoder branch's own data-parallel
            degree): ``replicas`` stages with identical units and flags, consecutive indices, each on its own
            rank, each taking an equal share of every microbatch's rows of its branch. 1: not replicated.
        tensor_parallel: the ``replicas`` copies are one tensor-parallel group instead (an encoder branch's own
            TP degree, ``[parallel.pp] encoder_tp``): each holds ``1/replicas`` of the stage's split weights (the
            family's encoder TP plan) and runs every row of the branch; copy 0 (the leader) sends the features
            into the first LLM stage, the others send an empty payload there and receive the leader's gradient
            (Megatron-LM's tensor parallelism, Shoeybi et al. 2019, section 3, inside one encoder stage).

    Raises:
        ValueError: on a negative index or rank, empty/duplicate modules, no units, unit counts that do
            not match ``modules`` and ``units``, ``replicas`` below 1, ``replica`` outside ``0..replicas-1``,
            a replicated LLM stage, or ``tensor_parallel`` on a stage with one copy.
    """

    index: int
    modules: tuple[str, ...]
    units: tuple[str, ...]
    rank: int
    trainable: bool
    needs_input_grad: bool
    module_unit_counts: tuple[int, ...] = ()
    replica: int = 0
    replicas: int = 1
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "units", tuple(self.units))
        counts = tuple(self.module_unit_counts) or ((len(self.units),) if len(self.modules) == 1 else ())
        object.__setattr__(self, "module_unit_counts", counts)
        where = f"Stage {self.index}"
        if self.index < 0 or self.rank < 0:
            raise ValueError(f"{where}: index and rank must be >= 0, got {self.index}/{self.rank}")
        if not self.modules or len(set(self.modules)) != len(self.modules):
            raise ValueError(f"{where}: modules must be non-empty and distinct, got {self.modules}")
        if not self.units:
            raise ValueError(f"{where}: a stage needs at least one unit")
        if len(counts) != len(self.modules) or min(counts) < 1 or sum(counts) != len(self.units):
            raise ValueError(
                f"{where}: module_unit_counts {counts} must give >= 1 unit to each of {self.modules} "
                f"and sum to {len(self.units)} units"
            )
        if self.replicas < 1 or not 0 <= self.replica < self.replicas:
            raise ValueError(f"{where}: replicas must be >= 1 and replica in 0..replicas-1, got "
                             f"replica={self.replica}, replicas={self.replicas}")
        if self.replicas > 1 and LLM_MODULE in self.modules:
            raise ValueError(f"{where}: replicas={self.replicas}, but only encoder stages may be replicated")
        if self.tensor_parallel and self.replicas < 2:
            raise ValueError(f"{where}: tensor_parallel needs a group of replicas >= 2 copies, got {self.replicas}")

    @property
    def tp_follower(self) -> bool:
        """True for a copy other than the leader (copy 0) of a tensor-parallel encoder stage: it sends no
        features into the LLM (``tensor_parallel``)."""
        return self.tensor_parallel and self.replica > 0

    @property
    def row_share(self) -> int:
        """Into how many shares the stage's rows of every microbatch are cut: ``replicas`` for data-parallel
        replicas, 1 for a tensor-parallel group (every copy runs every row)."""
        return 1 if self.tensor_parallel else self.replicas

    @property
    def runs_backward(self) -> bool:
        """True when the stage has any backward work (dX, dW or both); False means forward-only."""
        return self.trainable or self.needs_input_grad

    @property
    def first_replica(self) -> int:
        """Index of replica 0 of this stage (``index`` itself when the stage is not replicated)."""
        return self.index - self.replica

    @property
    def is_llm(self) -> bool:
        """True for a stage of the language model."""
        return self.modules == (LLM_MODULE,)

    def module_units(self, module: str) -> tuple[str, ...]:
        """The unit names of ``module``'s chunk in this stage.

        Raises:
            ValueError: when the stage does not serve ``module``.
        """
        if module not in self.modules:
            raise ValueError(f"Stage {self.index} serves {self.modules}, not {module!r}")
        pos = self.modules.index(module)
        start = sum(self.module_unit_counts[:pos])
        return self.units[start : start + self.module_unit_counts[pos]]


@dataclass(frozen=True)
class PipelinePlan(JsonDataclass):
    """A validated pipeline: stages, their DAG and the microbatch count.

    Attributes:
        layout: ``"encoder_parallel"`` or ``"encoders_colocated"`` (module docstring).
        stages: the stages; ``stages[i].index == i`` and index order is a topological order.
        edges: ``(src, dst)`` stage pairs, activations flow ``src -> dst`` (gradients flow back). Left
            empty, they are derived from ``layout`` and ``stages``; given, they must equal that derivation.
        num_microbatches: microbatches per iteration (per pipeline); schedules default to it.

    Raises:
        ValueError: on an unknown layout, misnumbered stages, a unit in two stages (other than replicas of one
            stage: consecutive, identical but for ``replica``, on distinct ranks, every stage of their branch
            with the same ``replicas``, and only in ``encoder_parallel``), an encoder stage mixing
            with LLM units, a module whose stages are not contiguous, a colocated encoder stage that does not
            serve every encoder, edges that differ from the layout's, unused ranks, or gradient flags that
            contradict each other along an edge (a stage runs backward but its successor does not need an
            input gradient, or the reverse).
    """

    layout: str
    stages: tuple[Stage, ...]
    edges: tuple[tuple[int, int], ...] = ()
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        stages = tuple(s if isinstance(s, Stage) else Stage.from_dict(s) for s in self.stages)
        object.__setattr__(self, "stages", stages)
        if self.layout not in LAYOUTS:
            raise ValueError(f"PipelinePlan.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.num_microbatches < 1:
            raise ValueError(f"PipelinePlan.num_microbatches must be >= 1, got {self.num_microbatches}")
        _validate_stages(self.layout, stages)
        derived = _derive_edges(self.layout, stages)
        edges = tuple((int(a), int(b)) for a, b in self.edges) if self.edges else derived
        if edges != derived:
            raise ValueError(f"PipelinePlan.edges {list(edges)} differ from the {self.layout} edges {list(derived)}")
        object.__setattr__(self, "edges", edges)
        _validate_ranks(stages)
        _validate_grad_flow(stages, edges)

    # ----- graph queries -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks (every rank ``0..num_ranks-1`` holds at least one stage)."""
        return 1 + max(s.rank for s in self.stages)

    @property
    def modules(self) -> tuple[str, ...]:
        """Model parts in stage order: encoders first, ``"llm"`` last."""
        seen: dict[str, None] = {}
        for stage in self.stages:
            seen.update(dict.fromkeys(stage.modules))
        return tuple(seen)

    @property
    def encoder_modules(self) -> tuple[str, ...]:
        """Encoder names, in stage order."""
        return tuple(m for m in self.modules if m != LLM_MODULE)

    @property
    def llm_stages(self) -> tuple[int, ...]:
        """Indices of the LLM stages (a chain ending at the last stage)."""
        return tuple(s.index for s in self.stages if s.is_llm)

    @cached_property
    def _successors(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.stages]
        for a, b in self.edges:
            out[a].append(b)
        return tuple(tuple(x) for x in out)

    @cached_property
    def _predecessors(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.stages]
        for a, b in self.edges:
            out[b].append(a)
        return tuple(tuple(x) for x in out)

    def successors(self, stage: int) -> tuple[int, ...]:
        """Stages that receive ``stage``'s output (one, or none for the last stage)."""
        return self._successors[stage]

    def predecessors(self, stage: int) -> tuple[int, ...]:
        """Stages whose outputs ``stage`` receives (one per encoder branch at the first LLM stage)."""
        return self._predecessors[stage]

    def depth(self, stage: int) -> int:
        """Number of stages on the path from ``stage`` to the last stage, both included.

        This is the warm-up depth of multimodal 1F1B: encoder stage ``i`` of a branch with ``S_enc`` stages
        has depth ``S_enc + S_llm - i``, LLM stage ``j`` has depth ``S_llm - j`` (Cornstarch).
        """
        depth = 1
        while self._successors[stage]:
            stage = self._successors[stage][0]
            depth += 1
        return depth

    @property
    def virtual_stages(self) -> int:
        """Most LLM stages (model chunks) one rank holds: ``v`` of an interleaved plan, 1 otherwise."""
        counts: dict[int, int] = {}
        for s in self.llm_stages:
            counts[self.stages[s].rank] = counts.get(self.stages[s].rank, 0) + 1
        return max(counts.values())

    def stages_on_rank(self, rank: int) -> tuple[int, ...]:
        """Indices of the stages ``rank`` runs, in index order."""
        return tuple(s.index for s in self.stages if s.rank == rank)

    def module_stages(self, module: str) -> tuple[int, ...]:
        """Indices of the stages serving ``module`` (an encoder branch or the LLM chain)."""
        return tuple(s.index for s in self.stages if module in s.modules)

    def replica_group(self, stage: int) -> tuple[int, ...]:
        """Indices of every replica of ``stage`` (``(stage,)`` when it is not replicated), in replica order."""
        first = self.stages[stage].first_replica
        return tuple(range(first, first + self.stages[stage].replicas))

    @property
    def replicated(self) -> bool:
        """True when some stage has ``replicas > 1`` (data-parallel replicas or a tensor-parallel group)."""
        return any(s.replicas > 1 for s in self.stages)

    @property
    def tensor_parallel(self) -> bool:
        """True when some encoder stage runs as a tensor-parallel group (``Stage.tensor_parallel``)."""
        return any(s.tensor_parallel for s in self.stages)

    def stage_of_unit(self, name: str) -> int:
        """Index of the stage that runs unit ``name`` (replica 0 of a replicated stage).

        Raises:
            ValueError: when no stage runs it.
        """
        for stage in self.stages:
            if name in stage.units:
                return stage.index
        raise ValueError(f"no stage of the plan runs unit {name!r}")

    def replace(self, **changes: Any) -> "PipelinePlan":
        """A copy with ``changes`` applied (e.g. ``num_microbatches=8``), validated again."""
        return dataclasses.replace(self, **changes)


# ----- plan validation ---------------------------------------------------------------------------
def _validate_stages(layout: str, stages: Sequence[Stage]) -> None:
    if not stages:
        raise ValueError("PipelinePlan needs at least one stage")
    seen: dict[str, int] = {}
    for i, stage in enumerate(stages):
        if stage.index != i:
            raise ValueError(f"PipelinePlan.stages[{i}] has index {stage.index}; stages must be numbered 0..n-1")
        if LLM_MODULE in stage.modules and len(stage.modules) > 1:
            raise ValueError(f"stage {i} mixes LLM units with encoder units {stage.modules}")
        if layout == "encoder_parallel" and len(stage.modules) > 1:
            raise ValueError(f"stage {i}: an encoder_parallel stage serves one module, got {stage.modules}")
        if stage.replicas > 1 or stage.replica:
            _validate_replica(layout, stages, stage)
            if stage.replica:
                continue  # its units are replica 0's
        for name in stage.units:
            if name in seen:
                raise ValueError(f"unit {name!r} is in stage {seen[name]} and stage {i}")
            seen[name] = i
    if not stages[-1].is_llm:
        raise ValueError("the last stage must be an LLM stage (it computes the loss)")
    _validate_module_order(layout, stages)


def _validate_replica(layout: str, stages: Sequence[Stage], stage: Stage) -> None:
    """A replica is one of ``replicas`` consecutive copies of one encoder_parallel stage on distinct ranks, and
    every stage of its branch has the same ``replicas``."""
    where = f"stage {stage.index} (replica {stage.replica} of {stage.replicas})"
    if layout != "encoder_parallel":
        raise ValueError(f"{where}: replicas > 1 needs the encoder_parallel layout, got {layout!r}")
    first = stage.first_replica
    group = stages[first : first + stage.replicas]
    if first < 0 or len(group) != stage.replicas:
        raise ValueError(f"{where}: its {stage.replicas} replicas must be consecutive stages")
    for k, other in enumerate(group):
        same = dataclasses.replace(other, index=stage.index, rank=stage.rank, replica=stage.replica) == stage
        if other.replica != k or not same:
            raise ValueError(f"{where}: stage {other.index} must be replica {k} of it, with the same units, flags and "
                             f"replicas, got replica={other.replica}, replicas={other.replicas}, units={other.units}")
    ranks = [s.rank for s in group]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: the replicas of a stage need distinct ranks, got {ranks}")
    branch = {(s.replicas, s.tensor_parallel) for s in stages if s.modules == stage.modules}
    if len(branch) != 1:
        raise ValueError(f"{where}: every stage of encoder {stage.modules[0]!r} needs the same replicas and "
                         f"tensor_parallel, got {sorted(branch)}")


def _validate_module_order(layout: str, stages: Sequence[Stage]) -> None:
    llm = [s.index for s in stages if s.is_llm]
    if llm != list(range(llm[0], len(stages))):
        raise ValueError(f"LLM stages must be the last, contiguous stages, got {llm}")
    encoder_stages = stages[: llm[0]]
    if layout == "encoders_colocated":
        for stage in encoder_stages:
            if stage.modules != encoder_stages[0].modules:
                raise ValueError(
                    f"encoders_colocated: stage {stage.index} serves {stage.modules} but stage 0 serves "
                    f"{encoder_stages[0].modules}; every encoder stage runs a chunk of every encoder"
                )
        return
    for module in {s.modules[0] for s in encoder_stages}:
        idx = [s.index for s in encoder_stages if s.modules[0] == module]
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError(f"stages of encoder {module!r} must be contiguous, got {idx}")


def _derive_edges(layout: str, stages: Sequence[Stage]) -> tuple[tuple[int, int], ...]:
    """The stage DAG of ``layout``: branch chains into the first LLM stage, or one line. Replica ``k`` of a
    replicated encoder stage sends to replica ``k`` of the branch's next stage, or to the first LLM stage."""
    if layout == "encoders_colocated":
        return tuple((i, i + 1) for i in range(len(stages) - 1))
    first_llm = next(s.index for s in stages if s.is_llm)
    edges = []
    for stage in stages[:-1]:
        after = stage.first_replica + stage.replicas  # the next stage of the chain starts after the replicas
        same_chain = after < len(stages) and stages[after].modules == stage.modules
        edges.append((stage.index, after + stage.replica if same_chain else first_llm))  # replica k -> replica k
    return tuple(edges)


def _validate_ranks(stages: Sequence[Stage]) -> None:
    used = {s.rank for s in stages}
    missing = sorted(set(range(max(used) + 1)) - used)
    if missing:
        raise ValueError(f"ranks {missing} hold no stage; pipeline ranks must be 0..{max(used)} and all used")


def _validate_grad_flow(stages: Sequence[Stage], edges: Sequence[tuple[int, int]]) -> None:
    """Gradient flags must agree along every edge (frozen-ness is a property of the graph)."""
    feeds_grad = [False] * len(stages)
    for a, b in edges:
        src, dst = stages[a], stages[b]
        if src.runs_backward and not dst.needs_input_grad:
            raise ValueError(
                f"stage {a} runs backward (trainable={src.trainable}, needs_input_grad={src.needs_input_grad}) "
                f"but its successor stage {b} does not need an input gradient: inconsistent unit flags"
            )
        feeds_grad[b] |= src.runs_backward
    for stage in stages:
        if stage.needs_input_grad and not feeds_grad[stage.index]:
            raise ValueError(
                f"stage {stage.index} needs an input gradient but no predecessor runs backward: "
                "inconsistent unit flags"
            )


@dataclass(frozen=True)
class P2PModel(JsonDataclass):
    """Point-to-point transfer time ``latency_s + nbytes / bandwidth_Bps``, plus the host time each end
    spends per message (LogP's overhead ``o``, module docstring).

    Attributes:
        latency_s: per-transfer latency (seconds).
        bandwidth_Bps: link bandwidth (bytes per second); ``None`` means unlimited.
        send_overhead_s: seconds the sending rank is busy per cross-rank message it sends.
        recv_overhead_s: seconds the receiving rank is busy per cross-rank message it receives.

    Raises:
        ValueError: on a negative latency or overhead, or a non-positive bandwidth.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float | None = None
    send_overhead_s: float = 0.0
    recv_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("latency_s", "send_overhead_s", "recv_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"P2PModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.bandwidth_Bps is not None and not self.bandwidth_Bps > 0:
            raise ValueError(f"P2PModel.bandwidth_Bps must be > 0 or None, got {self.bandwidth_Bps}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes between two ranks."""
        return self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0)


@dataclass(frozen=True)
class StageMemory(JsonDataclass):
    """Memory of one stage on its rank.

    Attributes:
        static_bytes: parameters, gradients and optimizer state (bytes), held for the whole iteration.
        activation_bytes: activations kept per in-flight microbatch (bytes): one number for every
            microbatch, or a tuple indexed by microbatch.

    Raises:
        ValueError: on negative bytes.
    """

    static_bytes: int = 0
    activation_bytes: int | tuple[int, ...] = 0

    def __post_init__(self) -> None:
        if isinstance(self.activation_bytes, (list, tuple)):
            object.__setattr__(self, "activation_bytes", tuple(int(b) for b in self.activation_bytes))
        values = self.activation_bytes if isinstance(self.activation_bytes, tuple) else (self.activation_bytes,)
        if self.static_bytes < 0 or any(v < 0 for v in values):
            raise ValueError(f"StageMemory bytes must be >= 0, got {self.static_bytes}/{self.activation_bytes}")

    def activation_of(self, microbatch: int) -> int:
        """Activation bytes of ``microbatch``.

        Raises:
            ValueError: when a per-microbatch tuple has no entry for it.
        """
        if not isinstance(self.activation_bytes, tuple):
            return self.activation_bytes
        if microbatch >= len(self.activation_bytes):
            raise ValueError(f"StageMemory.activation_bytes has no entry for microbatch {microbatch}")
        return self.activation_bytes[microbatch]


@dataclass(frozen=True)
class SimResult(JsonDataclass):
    """What one simulated iteration costs.

    Attributes:
        makespan_s: iteration time (seconds), first start (0) to last end.
        busy_s: per rank, seconds spent in actions.
        bubble_fraction: per rank, ``1 - busy_s / makespan_s``.
        peak_memory_bytes: per rank, the most bytes held at once (module docstring).
        events: the timed actions, sorted by rank then start time.
    """

    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]
    events: tuple[TimelineEvent, ...]

    @property
    def mean_bubble_fraction(self) -> float:
        """Bubble fraction averaged over ranks."""
        return sum(self.bubble_fraction) / len(self.bubble_fraction)


@dataclass(frozen=True)
class TimelineEvent(JsonDataclass):
    """One timed action on one rank: the format of predicted (simulator) and measured (runtime) timelines.

    Attributes:
        rank: pipeline rank that ran it.
        kind: ``"F"``, ``"B"``, ``"W"``, or another label for measured non-pipeline work (e.g. ``"optim"``).
        stage: stage index (-1 when not applicable).
        microbatch: microbatch index (-1 when not applicable).
        start_s: start time (seconds; any common origin).
        end_s: end time (seconds), ``>= start_s``.
        frequency_mhz: the GPU SM frequency (MHz) an energy plan set (on GPU) or would set (on CPU, recorded)
            before the action (``plait.parallel.energy``); 0 when no plan applies.

    Raises:
        ValueError: on an empty kind, a negative rank or ``end_s < start_s``.
    """

    rank: int
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    frequency_mhz: int = 0

    def __post_init__(self) -> None:
        if not self.kind or self.rank < 0:
            raise ValueError(f"TimelineEvent needs a kind and a rank >= 0, got {self.kind!r}/{self.rank}")
        if self.end_s < self.start_s:
            raise ValueError(f"TimelineEvent {self.kind} on rank {self.rank}: end {self.end_s} < start {self.start_s}")

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` (seconds)."""
        return self.end_s - self.start_s
