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

from collections.abc import Mapping, Sequence

from plait.planner.pipeline.graph import consistent_units
from plait.planner.pipeline.types import LAYOUTS, PipelinePlan, Stage
from plait.planner.types import LLM_MODULE, Unit

__all__ = ["plan_pipeline", "check_plan_units", "split_even", "interleaved_ranks", "stage_ranks", "synthetic_units"]


# ----- builder -----------------------------------------------------------------------------------
def plan_pipeline(
    units: Sequence[Unit],
    layout: str = "encoder_parallel",
    *,
    stages_per_module: Mapping[str, int] | None = None,
    splits: Mapping[str, Sequence[str]] | None = None,
    ranks: Sequence[int] | None = None,
    num_microbatches: int = 1,
    replicas: Mapping[str, int] | None = None,
    tensor_parallel: Mapping[str, int] | None = None,
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
        replicas: per encoder module of an ``encoder_parallel`` plan, its data-parallel degree ``r`` (default 1):
            every stage of that branch becomes ``r`` replica stages (consecutive indices, ``Stage.replica``
            ``0..r-1``), each on its own rank, each taking ``1/r`` of the branch's rows of every microbatch.
            ``ranks`` then counts every replica stage.
        tensor_parallel: per encoder module of an ``encoder_parallel`` plan, its tensor-parallel degree ``t``
            (default 1): every stage of that branch becomes ``t`` copies (``Stage.tensor_parallel``, consecutive
            indices, each on its own rank) forming one TP group; not with ``replicas`` above 1 on the same module.

    Returns:
        A validated ``PipelinePlan``.

    Raises:
        ValueError: on duplicate unit names, no LLM unit, a module whose units are not contiguous, unknown
            modules in ``stages_per_module``/``splits``, a module given both, a stage count that is < 1 or
            exceeds the module's units, boundaries that are unknown, repeated, out of order or at the
            module's first unit, unequal colocated encoder chunk counts, a wrong-length ``ranks``, a stage
            starting at a ``Unit.joined`` unit, ``replicas`` or ``tensor_parallel`` naming the LLM, an unknown
            module or a degree below 1, or given with ``encoders_colocated``, a module with both above 1, and every
            ``PipelinePlan`` validation error.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    by_module = _group_units(units)
    chunks = _chunk_modules(by_module, dict(stages_per_module or {}), dict(splits or {}))
    groups = _arrange_stages(layout, chunks)
    degrees = _check_replicas(layout, by_module, dict(replicas or {}), "replicas")
    tp = _check_replicas(layout, by_module, dict(tensor_parallel or {}), "tensor_parallel")
    both = sorted(m for m in degrees if degrees[m] > 1 and tp.get(m, 1) > 1)
    if both:
        raise ValueError(f"module(s) {both}: an encoder branch has either data-parallel replicas or a tensor-parallel "
                         "group, not both")
    degrees.update((m, t) for m, t in tp.items() if t > 1)
    copies = [(group, k, degrees.get(group[0][0].module, 1), tp.get(group[0][0].module, 1) > 1) for group in groups
              for k in range(degrees.get(group[0][0].module, 1))]
    if ranks is None:
        ranks = range(len(copies))
    if len(ranks) != len(copies):
        raise ValueError(f"ranks has {len(ranks)} entries but the plan has {len(copies)} stages")
    stages = tuple(_make_stage(i, group, int(r), k, n, split) for i, ((group, k, n, split), r)
                   in enumerate(zip(copies, ranks)))
    plan = PipelinePlan(layout=layout, stages=stages, num_microbatches=num_microbatches)
    check_plan_units(plan, units)
    _check_joined(plan, units)
    return plan


def _check_joined(plan: PipelinePlan, units: Sequence[Unit]) -> None:
    """No stage chunk starts at a ``Unit.joined`` unit.

    Raises:
        ValueError: naming the unit and its stage.
    """
    joined = {u.name for u in units if u.joined}
    for stage in plan.stages:
        for module in stage.modules:
            first = stage.module_units(module)[0]
            if first in joined:
                raise ValueError(f"stage {stage.index} starts at unit {first!r}, which stays in the stage of the "
                                 f"unit before it (its module's units up to it form one stage: a tower whose "
                                 f"DeepStack mergers read blocks inside it)")


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


def v_shape_ranks(encoder_ranks: Sequence[int], llm_ranks: int) -> tuple[int, ...]:
    """Stage ranks of a plan whose ``2 p`` LLM stages sit on ``p = llm_ranks`` ranks in a V: LLM stage ``j`` on
    rank ``e + j`` for ``j < p`` and on rank ``e + 2p - 1 - j`` after (``e = 1 + max(encoder_ranks)``, or 0
    without encoder stages), so the first LLM rank holds the first and the last LLM stage (the placement of the
    V-shape zero-bubble schedule ``schedules.zb_v``; Qi et al., "Pipeline Parallelism with Controllable Memory",
    NeurIPS 2024, section 3). Pass the result as ``plan_pipeline(..., ranks=...)`` with ``2 p`` LLM stages.

    Raises:
        ValueError: on ``llm_ranks`` below 1 or a negative encoder rank.
    """
    encoder_ranks = [int(r) for r in encoder_ranks]
    if llm_ranks < 1:
        raise ValueError(f"llm_ranks must be >= 1, got {llm_ranks}")
    if any(r < 0 for r in encoder_ranks):
        raise ValueError(f"encoder_ranks must be >= 0, got {encoder_ranks}")
    first = 1 + max(encoder_ranks, default=-1)
    return tuple(encoder_ranks) + tuple(first + min(j, 2 * llm_ranks - 1 - j) for j in range(2 * llm_ranks))


def stage_ranks(encoder_stages: int, llm_ranks: int, virtual_stages: int = 1,
                attach_encoders: bool = False, v_shape: bool = False, in_bubble: bool = False) -> tuple[int, ...]:
    """Pipeline rank of every stage of a plan with ``encoder_stages`` encoder stages followed by
    ``virtual_stages * llm_ranks`` LLM stages, as the layout search places them and ``[parallel.pp]`` describes
    them (one mapping for both): each encoder stage on its own rank ``0..encoder_stages-1`` and LLM stage ``j``
    on rank ``encoder_stages + j mod llm_ranks`` (:func:`interleaved_ranks`; with ``virtual_stages = 1`` stage
    ``i`` on rank ``i``), or, with ``attach_encoders``, every encoder stage on rank 0 and LLM stage ``j`` on rank
    ``j mod llm_ranks`` (the encoders share the first LLM rank, as ``schedules.interleaved_1f1b`` runs them). With
    ``v_shape`` (``virtual_stages`` 2) the LLM stages sit in a V instead (:func:`v_shape_ranks`, ``schedules.zb_v``).
    With ``in_bubble`` (``virtual_stages`` 1) encoder stage ``k`` sits on LLM rank ``p - 1 - (k mod p)``: the last
    LLM ranks, whose 1F1B warm-up idles longest (``p - 1 - i`` forward slots on rank ``i``), run the encoders'
    forwards there (Optimus, ATC'25: encoder work in the LLM pipeline's bubbles); the schedule generators place
    each encoder action where its rank would otherwise wait (``schedules._merge_ranks``).
    ``encoder_stages`` counts every replica of a replicated encoder stage (``Stage.replicas``): with own ranks each
    replica gets its own rank; ``in_bubble`` puts consecutive replicas on different LLM ranks (while there are
    no more replicas than LLM ranks), the layout where a replicated encoder shares ranks with LLM stages.

    Raises:
        ValueError: on ``encoder_stages`` below 0, ``llm_ranks`` or ``virtual_stages`` below 1, ``v_shape`` with
            ``virtual_stages`` other than 2, or ``in_bubble`` with ``virtual_stages`` above 1 or another placement.
    """
    if encoder_stages < 0:
        raise ValueError(f"encoder_stages must be >= 0, got {encoder_stages}")
    if in_bubble:
        if llm_ranks < 1:
            raise ValueError(f"llm_ranks must be >= 1, got {llm_ranks}")
        if virtual_stages != 1 or attach_encoders or v_shape:
            raise ValueError("encoders in the bubbles sit on LLM ranks of one LLM stage each (virtual_stages 1), "
                             f"not with attach_encoders or a V; got virtual_stages={virtual_stages}, "
                             f"attach_encoders={attach_encoders}, v_shape={v_shape}")
        return tuple(llm_ranks - 1 - k % llm_ranks for k in range(encoder_stages)) + tuple(range(llm_ranks))
    if v_shape:
        if virtual_stages != 2:
            raise ValueError(f"a V-shape placement holds 2 LLM stages per rank, got virtual_stages={virtual_stages}")
        llm = v_shape_ranks((), llm_ranks)
        return (0,) * encoder_stages + llm if attach_encoders else \
            tuple(range(encoder_stages)) + tuple(encoder_stages + r for r in llm)
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


def _check_replicas(layout: str, by_module: Mapping[str, list[Unit]], replicas: dict[str, int],
                    name: str) -> dict[str, int]:
    """``plan_pipeline``'s ``replicas`` or ``tensor_parallel`` (``name``), checked: encoder modules of an
    encoder_parallel plan, degrees >= 1."""
    for module, degree in replicas.items():
        if module == LLM_MODULE or module not in by_module:
            encoders = [m for m in by_module if m != LLM_MODULE]
            verb = "replicated" if name == "replicas" else "split"
            raise ValueError(f"{name}[{module!r}]: only encoder modules may be {verb}; they are {encoders}")
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ValueError(f"{name}[{module!r}] must be an integer >= 1, got {degree!r}")
        if degree > 1 and layout != "encoder_parallel":
            raise ValueError(f"{name}[{module!r}] = {degree} needs the encoder_parallel layout, got {layout!r}")
    return replicas


def _make_stage(index: int, group: list[list[Unit]], rank: int, replica: int = 0, replicas: int = 1,
                tensor_parallel: bool = False) -> Stage:
    return Stage(
        index=index,
        modules=tuple(chunk[0].module for chunk in group),
        units=tuple(u.name for chunk in group for u in chunk),
        rank=rank,
        trainable=any(u.trainable for chunk in group for u in chunk),
        needs_input_grad=any(chunk[0].needs_input_grad for chunk in group),
        module_unit_counts=tuple(len(chunk) for chunk in group),
        replica=replica,
        replicas=replicas,
        tensor_parallel=tensor_parallel,
    )


def check_plan_units(plan: PipelinePlan, units: Sequence[Unit]) -> None:
    """Check that ``plan`` fits the model whose pipeline units are ``units`` (e.g. a cached plan).

    Every unit must be run by exactly one stage (or the replicas of one stage), each stage's module chunks must list units of that
    module in model order, the stages of a module must cover it in order, and each stage's flags must be
    the ones its units imply (module docstring).

    Raises:
        ValueError: naming the first unit or stage that does not fit.
    """
    by_name = {u.name: u for u in units}
    planned = [name for stage in plan.stages if not stage.replica for name in stage.units]
    missing = [u.name for u in units if u.name not in set(planned)]
    extra = [n for n in planned if n not in by_name]
    if missing or extra:
        raise ValueError(f"plan does not cover the model: units not in any stage {missing}, unknown units {extra}")
    order = {u.name: i for i, u in enumerate(units)}
    last: dict[str, int] = {}
    for stage in plan.stages:
        _check_stage_flags(stage, by_name)
        if stage.replica:
            continue  # the same units as replica 0 (PipelinePlan checks it)
        for module in stage.modules:
            for name in stage.module_units(module):
                if by_name[name].module != module:
                    raise ValueError(f"stage {stage.index}: unit {name!r} is not a unit of module {module!r}")
                if order[name] <= last.get(module, -1):
                    raise ValueError(f"stage {stage.index}: unit {name!r} is out of model order")
                last[module] = order[name]


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
