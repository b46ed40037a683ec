"""``parallel.plan = "auto"``: choose the pipeline layout of a job from measured unit costs (pure).

:func:`plan_auto_layout` searches layout, stages per module, cost-balanced partition and DP degree
(``search.plan_layout``) among the plans the pipeline trainer can run on exactly ``world_size`` processes:
``dp x pipeline ranks = world_size`` with one stage per pipeline rank (for each DP degree ``d`` dividing the
world size, the best plan on ``world_size / d`` devices with ``ceil(M / d)`` microbatches is kept when it fills
all of them; ``d = world_size``, plain DP, always does). Ties go to DP degrees that give every replica a
microbatch, then to fewer replicas. :func:`apply_layout_choice` writes the choice into a
copy of the job config (``parallel.dp`` and ``[parallel.pp]``: degree, layout, stages, explicit ``splits``
where the partition is not the even split by unit count, 1F1B, microbatches per replica) and
:func:`resolve_auto_plan` does both. Nothing here touches torch or the file system.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

from plait.config.schema import JobConfig, PipelineConfig
from plait.planner.pipeline_plan import LLM_MODULE, PipelinePlan
from plait.planner.search import LayoutChoice, plan_layout
from plait.planner.simulator import P2PModel
from plait.planner.types import Unit, UnitCost

__all__ = ["apply_layout_choice", "auto_microbatches", "plan_auto_layout", "plan_splits", "resolve_auto_plan"]


def auto_microbatches(cfg: JobConfig) -> int:
    """Global microbatches per step: ``train.global_batch_size / train.microbatch_size`` (rounded up)."""
    return max(1, -(-cfg.train.global_batch_size // cfg.train.microbatch_size))


def plan_auto_layout(units: Sequence[Unit], costs: Sequence[UnitCost], world_size: int, microbatches: int, *,
                     p2p: P2PModel | None = None, memory_cap: float | None = None,
                     dtype: str = "float32") -> LayoutChoice:
    """The fastest runnable plan for ``world_size`` processes (module docstring).

    Args:
        units, costs: pipeline units (real flags) and their per-microbatch costs (e.g. a measured profile).
        world_size: processes of the job; microbatches: global microbatches per step.
        p2p: stage-to-stage transfer model; memory_cap: bytes per device (None: unchecked); dtype: parameter
            dtype for memory.

    Returns:
        The chosen ``LayoutChoice`` (``dp * plan.num_ranks == world_size``).

    Raises:
        ValueError: on a world size or microbatch count < 1, or when no plan fits memory.
    """
    if world_size < 1 or microbatches < 1:
        raise ValueError(f"world_size and microbatches must be >= 1, got {world_size} and {microbatches}")
    best: LayoutChoice | None = None
    errors = []
    for dp in (d for d in range(1, world_size + 1) if world_size % d == 0):
        try:
            choice = plan_layout(units, costs, world_size // dp, microbatches=math.ceil(microbatches / dp),
                                 p2p=p2p, memory_cap=memory_cap, dp_degrees=[1], dtype=dtype)
        except ValueError as exc:
            errors.append(f"dp {dp}: {exc}")
            continue
        if choice.plan.num_ranks * dp != world_size:
            continue
        choice = _as_replicas(choice, dp, microbatches, world_size)
        if best is None or _rank(choice) < _rank(best):
            best = choice
    if best is None:
        raise ValueError(f"no runnable plan for {world_size} processes: " + "; ".join(errors))
    return best


def _rank(choice: LayoutChoice) -> tuple:
    """Order of preference: faster, then no replica without a microbatch, then fewer replicas."""
    return (choice.iteration_s, choice.dp > choice.microbatches, choice.dp)


def _as_replicas(choice: LayoutChoice, dp: int, microbatches: int, world_size: int) -> LayoutChoice:
    """A one-replica choice of ``ceil(M / dp)`` microbatches restated as ``dp`` replicas of the job."""
    return dataclasses.replace(choice, dp=dp, microbatches=microbatches, devices=world_size,
                               lower_bound_s=choice.lower_bound_s * microbatches / (choice.microbatches * dp))


def plan_splits(plan: PipelinePlan) -> dict[str, list[str]]:
    """Per module with more than one stage, the first unit of each of its stages after the first (the
    ``splits`` of ``plan_pipeline``)."""
    out = {}
    for module in plan.modules:
        stages = plan.module_stages(module)
        if len(stages) > 1:
            out[module] = [plan.stages[s].module_units(module)[0] for s in stages[1:]]
    return out


def _even_splits(units: Sequence[Unit], module: str, count: int) -> list[str]:
    """Boundaries of the even split by unit count (``plan_pipeline``'s rule: the first ``n % k`` chunks get one
    unit more)."""
    names = [u.name for u in units if u.module == module]
    base, extra = divmod(len(names), count)
    starts, position = [], 0
    for i in range(count - 1):
        position += base + (1 if i < extra else 0)
        starts.append(names[position])
    return starts


def apply_layout_choice(cfg: JobConfig, choice: LayoutChoice, units: Sequence[Unit]) -> JobConfig:
    """A copy of ``cfg`` running ``choice``: ``parallel.dp`` = its DP degree and ``[parallel.pp]`` = its plan
    (degree 1 when it is a single rank), ``parallel.plan = "manual"`` (resolved). Stage counts are written
    for every module; ``splits`` only for modules whose boundaries differ from the even split by count."""
    out = copy.deepcopy(cfg)
    out.parallel.plan = "manual"
    out.parallel.dp = choice.dp
    plan = choice.plan
    if plan.num_ranks == 1:
        out.parallel.pp = PipelineConfig(degree=1)
        return out
    counts = {m: len(plan.module_stages(m)) for m in plan.modules}
    splits = {m: names for m, names in plan_splits(plan).items()
              if names != _even_splits(units, m, counts[m])}
    out.parallel.pp = PipelineConfig(degree=plan.num_ranks, layout=plan.layout, stages=counts, schedule="1f1b",
                                     microbatches=choice.microbatches_per_replica, splits=splits)
    return out


def resolve_auto_plan(cfg: JobConfig, world_size: int, units: Sequence[Unit], costs: Sequence[UnitCost], *,
                      p2p: P2PModel | None = None, memory_cap: float | None = None,
                      dtype: str = "float32") -> tuple[JobConfig, LayoutChoice]:
    """``cfg`` with ``parallel.plan = "auto"`` resolved for ``world_size`` processes from unit costs: the
    config to train with and the chosen plan (:func:`plan_auto_layout`, :func:`apply_layout_choice`).

    Raises:
        ValueError: when ``parallel.plan`` is not ``"auto"``, the units are not the model's (no LLM unit), or
            no plan fits.
    """
    if cfg.parallel.plan != "auto":
        raise ValueError(f"parallel.plan is {cfg.parallel.plan!r}; only 'auto' is resolved")
    if not any(u.module == LLM_MODULE for u in units):
        raise ValueError("units have no LLM unit: they are not a plait model's pipeline units")
    choice = plan_auto_layout(units, costs, world_size, auto_microbatches(cfg), p2p=p2p, memory_cap=memory_cap,
                              dtype=dtype)
    return apply_layout_choice(cfg, choice, units), choice
