"""Pipeline plans: which units each pipeline stage runs, on which rank, and how the stages connect.

An MLLM pipeline is a DAG, not a line (Cornstarch, "Modality parallelism"):

- ``"encoder_parallel"``: each encoder branch is its own chain of stages (its last stage holds the
  projector) and every branch feeds the first LLM stage; the LLM stages form a chain.
- ``"encoders_colocated"``: encoder stage ``s`` runs the ``s``-th chunk of every encoder, then the LLM
  stages follow; the whole pipeline is a line.

Stage indices are a topological order: encoder stages first (branch by branch in ``encoder_parallel``),
LLM stages last, and the last stage (the one that computes the loss) is the only sink. Every stage sends
its output to exactly one successor; the first LLM stage of an ``encoder_parallel`` plan receives from one
predecessor per encoder branch.

A stage's flags come from its units: it is ``trainable`` when any of its
units trains, it ``needs_input_grad`` when the first unit of (any of) its module chunk(s) needs one, and
it ``runs_backward`` when either holds. A stage that runs no backward is forward-only: the schedule gives
it no ``B``/``W`` actions and it keeps no activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from plait.planner.pipeline.graph import consistent_units
from plait.planner.serialize import JsonDataclass
from plait.planner.types import LLM_MODULE, Unit

__all__ = [
    "LAYOUTS",
    "Stage",
    "PipelinePlan",
    "plan_pipeline",
    "check_plan_units",
    "split_even",
    "interleaved_ranks",
    "stage_ranks",
    "synthetic_units",
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

    Raises:
        ValueError: on a negative index or rank, empty/duplicate modules, no units, or unit counts that do
            not match ``modules`` and ``units``.
    """

    index: int
    modules: tuple[str, ...]
    units: tuple[str, ...]
    rank: int
    trainable: bool
    needs_input_grad: bool
    module_unit_counts: tuple[int, ...] = ()

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

    @property
    def runs_backward(self) -> bool:
        """True when the stage has any backward work (dX, dW or both); False means forward-only."""
        return self.trainable or self.needs_input_grad

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
        ValueError: on an unknown layout, misnumbered stages, a unit in two stages, an encoder stage mixing
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

    def stage_of_unit(self, name: str) -> int:
        """Index of the stage that runs unit ``name``.

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
        for name in stage.units:
            if name in seen:
                raise ValueError(f"unit {name!r} is in stage {seen[name]} and stage {i}")
            seen[name] = i
    if not stages[-1].is_llm:
        raise ValueError("the last stage must be an LLM stage (it computes the loss)")
    _validate_module_order(layout, stages)


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
    """The stage DAG of ``layout``: branch chains into the first LLM stage, or one line."""
    if layout == "encoders_colocated":
        return tuple((i, i + 1) for i in range(len(stages) - 1))
    first_llm = next(s.index for s in stages if s.is_llm)
    edges = []
    for stage in stages[:-1]:
        nxt = stages[stage.index + 1]
        same_chain = nxt.modules == stage.modules
        edges.append((stage.index, stage.index + 1 if same_chain else first_llm))
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


# ----- builder -----------------------------------------------------------------------------------
def plan_pipeline(
    units: Sequence[Unit],
    layout: str = "encoder_parallel",
    *,
    stages_per_module: Mapping[str, int] | None = None,
    splits: Mapping[str, Sequence[str]] | None = None,
    ranks: Sequence[int] | None = None,
    num_microbatches: int = 1,
) -> PipelinePlan:
    """Partition ``units`` into pipeline stages and connect them as ``layout`` says.

    Each module (an encoder or ``"llm"``) is cut into chunks, either evenly by unit count
    (``stages_per_module[module]`` chunks, default 1; the first ``n % k`` chunks get one unit more) or at
    explicit boundaries (``splits[module]``: the names of the units that start a new chunk, in model
    order, the module's first unit excluded). ``encoder_parallel`` makes each encoder chunk a stage of its
    branch; ``encoders_colocated`` needs every encoder cut into the same number of chunks and makes stage
    ``s`` of all ``s``-th chunks. LLM chunks follow. Cost-balanced boundaries come from the partitioner.

    Args:
        units: the model's pipeline units in model order (each module's units contiguous).
        layout: ``"encoder_parallel"`` or ``"encoders_colocated"``.
        stages_per_module: number of stages per module, for modules without ``splits``.
        splits: explicit chunk boundaries per module (unit names).
        ranks: pipeline rank of each stage (default: stage ``i`` on rank ``i``); several stages may share
            a rank, and every rank ``0..max`` must be used.
        num_microbatches: microbatches per iteration.

    Returns:
        A validated ``PipelinePlan``.

    Raises:
        ValueError: on duplicate unit names, no LLM unit, a module whose units are not contiguous, unknown
            modules in ``stages_per_module``/``splits``, a module given both, a stage count that is < 1 or
            exceeds the module's units, boundaries that are unknown, repeated, out of order or at the
            module's first unit, unequal colocated encoder chunk counts, a wrong-length ``ranks``, and every
            ``PipelinePlan`` validation error.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    by_module = _group_units(units)
    chunks = _chunk_modules(by_module, dict(stages_per_module or {}), dict(splits or {}))
    groups = _arrange_stages(layout, chunks)
    if ranks is None:
        ranks = range(len(groups))
    if len(ranks) != len(groups):
        raise ValueError(f"ranks has {len(ranks)} entries but the plan has {len(groups)} stages")
    stages = tuple(_make_stage(i, group, int(r)) for i, (group, r) in enumerate(zip(groups, ranks)))
    plan = PipelinePlan(layout=layout, stages=stages, num_microbatches=num_microbatches)
    check_plan_units(plan, units)
    return plan


def interleaved_ranks(encoder_ranks: Sequence[int], llm_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """Stage ranks of a plan whose ``virtual_stages * llm_ranks`` LLM stages sit cyclically on ``llm_ranks``
    ranks (LLM stage ``j`` on rank ``e + j mod llm_ranks``, ``e = 1 + max(encoder_ranks)``, or 0 without
    encoder stages): the placement of interleaved 1F1B (``schedules.interleaved_1f1b``). Pass the result
    as ``plan_pipeline(..., ranks=...)`` with ``virtual_stages * llm_ranks`` LLM stages.

    Args:
        encoder_ranks: the rank of each encoder stage, in stage order (e.g. ``range(n)``).
        llm_ranks: ``p >= 1`` ranks for the LLM; virtual_stages: ``v >= 1`` LLM chunks per rank.

    Raises:
        ValueError: on ``llm_ranks`` or ``virtual_stages`` below 1, or a negative encoder rank.
    """
    encoder_ranks = [int(r) for r in encoder_ranks]
    if llm_ranks < 1 or virtual_stages < 1:
        raise ValueError(f"llm_ranks and virtual_stages must be >= 1, got {llm_ranks}/{virtual_stages}")
    if any(r < 0 for r in encoder_ranks):
        raise ValueError(f"encoder_ranks must be >= 0, got {encoder_ranks}")
    first = 1 + max(encoder_ranks, default=-1)
    return tuple(encoder_ranks) + tuple(first + j % llm_ranks for j in range(llm_ranks * virtual_stages))


def stage_ranks(encoder_stages: int, llm_ranks: int, virtual_stages: int = 1,
                attach_encoders: bool = False) -> tuple[int, ...]:
    """Pipeline rank of every stage of a plan with ``encoder_stages`` encoder stages followed by
    ``virtual_stages * llm_ranks`` LLM stages, as the layout search places them and ``[parallel.pp]`` describes
    them (one mapping for both): each encoder stage on its own rank ``0..encoder_stages-1`` and LLM stage ``j``
    on rank ``encoder_stages + j mod llm_ranks`` (:func:`interleaved_ranks`; with ``virtual_stages = 1`` stage
    ``i`` on rank ``i``), or, with ``attach_encoders``, every encoder stage on rank 0 and LLM stage ``j`` on rank
    ``j mod llm_ranks`` (the encoders share the first LLM rank, as ``schedules.interleaved_1f1b`` runs them).

    Raises:
        ValueError: on ``encoder_stages`` below 0, ``llm_ranks`` or ``virtual_stages`` below 1.
    """
    if encoder_stages < 0:
        raise ValueError(f"encoder_stages must be >= 0, got {encoder_stages}")
    if attach_encoders:
        return (0,) * encoder_stages + interleaved_ranks((), llm_ranks, virtual_stages)
    return interleaved_ranks(range(encoder_stages), llm_ranks, virtual_stages)


def _group_units(units: Sequence[Unit]) -> dict[str, list[Unit]]:
    """Units by module, modules in order of first appearance; checks names and contiguity."""
    by_module: dict[str, list[Unit]] = {}
    names: set[str] = set()
    previous = None
    for unit in units:
        if unit.name in names:
            raise ValueError(f"duplicate unit name {unit.name!r}")
        names.add(unit.name)
        if unit.module in by_module and unit.module != previous:
            raise ValueError(f"units of module {unit.module!r} are not contiguous (see unit {unit.name!r})")
        by_module.setdefault(unit.module, []).append(unit)
        previous = unit.module
    if LLM_MODULE not in by_module:
        raise ValueError(f"no unit belongs to module {LLM_MODULE!r}; a pipeline needs the language model")
    llm = by_module.pop(LLM_MODULE)
    by_module[LLM_MODULE] = llm
    return by_module


def _chunk_modules(
    by_module: Mapping[str, list[Unit]], counts: dict[str, int], splits: dict[str, Sequence[str]]
) -> dict[str, list[list[Unit]]]:
    for name, given in (("stages_per_module", counts), ("splits", splits)):
        unknown = sorted(set(given) - set(by_module))
        if unknown:
            raise ValueError(f"{name} names unknown module(s) {unknown}; modules are {list(by_module)}")
    both = sorted(set(counts) & set(splits))
    if both:
        raise ValueError(f"module(s) {both} given in both stages_per_module and splits")
    out = {}
    for module, mod_units in by_module.items():
        if module in splits:
            out[module] = _split_at(module, mod_units, splits[module])
        else:
            out[module] = split_even(module, mod_units, counts.get(module, 1))
    return out


def split_even(module: str, units: list[Unit], count: int) -> list[list[Unit]]:
    """``units`` (one module's, in model order) cut into ``count`` contiguous chunks by unit count, the first
    ``len(units) % count`` chunks one unit longer: ``plan_pipeline``'s even split.

    Raises:
        ValueError: naming ``stages_per_module[module]`` when ``count`` is not in ``1..len(units)``.
    """
    if not 1 <= count <= len(units):
        raise ValueError(f"stages_per_module[{module!r}] must be in 1..{len(units)} (its unit count), got {count}")
    base, extra = divmod(len(units), count)
    sizes = [base + (1 if i < extra else 0) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return [units[a : a + n] for a, n in zip(starts, sizes)]


def _split_at(module: str, units: list[Unit], boundaries: Sequence[str]) -> list[list[Unit]]:
    position = {u.name: i for i, u in enumerate(units)}
    cuts = [0]
    for name in boundaries:
        if name not in position:
            names = [u.name for u in units]
            shown = names if len(names) <= 8 else [*names[:3], "...", *names[-3:]]
            raise ValueError(f"splits[{module!r}]: {name!r} is not a unit of module {module!r}; its units are {shown}")
        if position[name] <= cuts[-1]:
            raise ValueError(
                f"splits[{module!r}]: boundary {name!r} is repeated, out of order or the module's first unit"
            )
        cuts.append(position[name])
    cuts.append(len(units))
    return [units[a:b] for a, b in zip(cuts, cuts[1:])]


def _arrange_stages(layout: str, chunks: Mapping[str, list[list[Unit]]]) -> list[list[list[Unit]]]:
    """Stage contents: per stage, one unit list per module chunk it runs."""
    encoders = [m for m in chunks if m != LLM_MODULE]
    groups: list[list[list[Unit]]] = []
    if layout == "encoder_parallel":
        for module in encoders:
            groups.extend([chunk] for chunk in chunks[module])
    elif encoders:
        counts = {m: len(chunks[m]) for m in encoders}
        if len(set(counts.values())) != 1:
            raise ValueError(f"encoders_colocated needs the same number of stages for every encoder, got {counts}")
        for s in range(len(chunks[encoders[0]])):
            groups.append([chunks[m][s] for m in encoders])
    groups.extend([chunk] for chunk in chunks[LLM_MODULE])
    return groups


def _make_stage(index: int, group: list[list[Unit]], rank: int) -> Stage:
    return Stage(
        index=index,
        modules=tuple(chunk[0].module for chunk in group),
        units=tuple(u.name for chunk in group for u in chunk),
        rank=rank,
        trainable=any(u.trainable for chunk in group for u in chunk),
        needs_input_grad=any(chunk[0].needs_input_grad for chunk in group),
        module_unit_counts=tuple(len(chunk) for chunk in group),
    )


def check_plan_units(plan: PipelinePlan, units: Sequence[Unit]) -> None:
    """Check that ``plan`` fits the model whose pipeline units are ``units`` (e.g. a cached plan).

    Every unit must be run by exactly one stage, each stage's module chunks must list units of that
    module in model order, the stages of a module must cover it in order, and each stage's flags must be
    the ones its units imply (module docstring).

    Raises:
        ValueError: naming the first unit or stage that does not fit.
    """
    by_name = {u.name: u for u in units}
    planned = [name for stage in plan.stages for name in stage.units]
    missing = [u.name for u in units if u.name not in set(planned)]
    extra = [n for n in planned if n not in by_name]
    if missing or extra:
        raise ValueError(f"plan does not cover the model: units not in any stage {missing}, unknown units {extra}")
    order = {u.name: i for i, u in enumerate(units)}
    last: dict[str, int] = {}
    for stage in plan.stages:
        for module in stage.modules:
            for name in stage.module_units(module):
                if by_name[name].module != module:
                    raise ValueError(f"stage {stage.index}: unit {name!r} is not a unit of module {module!r}")
                if order[name] <= last.get(module, -1):
                    raise ValueError(f"stage {stage.index}: unit {name!r} is out of model order")
                last[module] = order[name]
        _check_stage_flags(stage, by_name)


def _check_stage_flags(stage: Stage, by_name: Mapping[str, Unit]) -> None:
    trainable = any(by_name[n].trainable for n in stage.units)
    needs = any(by_name[stage.module_units(m)[0]].needs_input_grad for m in stage.modules)
    if (trainable, needs) != (stage.trainable, stage.needs_input_grad):
        raise ValueError(
            f"stage {stage.index}: flags trainable={stage.trainable}, needs_input_grad={stage.needs_input_grad} "
            f"but its units imply trainable={trainable}, needs_input_grad={needs}"
        )


def synthetic_units(encoders: Mapping[str, Sequence[bool]], llm: Sequence[bool]) -> tuple[Unit, ...]:
    """Pipeline units of a made-up MLLM from per-unit ``trainable`` flags (tests, benchmarks, dry runs).

    Encoder ``e`` gets units ``"e.0" .. "e.{n-1}"`` (embed, layers, projector last), the LLM gets
    ``"llm.0" .. "llm.{n-1}"`` (embed, layers, head last). ``needs_input_grad`` follows the unit-graph rule
    (``graph.consistent_units``).

    Raises:
        ValueError: when a module has no units or an encoder is called ``"llm"``.
    """
    out: list[Unit] = []
    for module, flags in encoders.items():
        if module == LLM_MODULE or not flags:
            raise ValueError(f"encoder {module!r}: needs a name other than {LLM_MODULE!r} and at least one unit")
        out.extend(_chain_units(module, flags, last_kind="projector"))
    if not llm:
        raise ValueError("the LLM needs at least one unit")
    out.extend(_chain_units(LLM_MODULE, llm, last_kind="head"))
    return consistent_units(out)


def _chain_units(module: str, flags: Sequence[bool], last_kind: str) -> list[Unit]:
    """Units of one chain with their ``trainable`` flags (``needs_input_grad`` is set by the graph rule)."""
    units = []
    for i, trainable in enumerate(flags):
        kind = last_kind if i == len(flags) - 1 else ("embed" if i == 0 else "layer")
        units.append(Unit(f"{module}.{i}", module, kind, bool(trainable), False))
    return units
