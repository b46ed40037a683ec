"""The resilience room's value types: pipeline templates and their instantiation over the live ranks, the
reconfiguration after a failure or a rejoin, and the straggler policy and state.

Frozen dataclasses that round-trip through JSON (``serialize.JsonDataclass``); planning them is ``templates``',
``reconfigure``'s and ``straggler``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.planner.pipeline.types import P2PModel, PipelinePlan
from plait.planner.serialize import JsonDataclass

__all__ = [
    "Instantiation",
    "LostUnitsError",
    "PipelineInstance",
    "PipelineTemplate",
    "Reconfiguration",
    "StragglerPolicy",
    "StragglerState",
    "TemplateSet",
    "Transfer",
    "UnitBytes",
    "format_seconds",
    "rank_noun",
]


@dataclass(frozen=True)
class PipelineTemplate(JsonDataclass):
    """The best plan for one pipeline on ``num_ranks`` ranks, with its predicted time.

    Attributes:
        num_ranks: ranks the pipeline occupies (``n``); ``plan.num_ranks <= n`` run stages, the rest are spares.
        plan: the pipeline plan (plan ranks ``0..plan.num_ranks-1``).
        schedule: the schedule the search timed it with (``"1f1b"`` or ``"interleaved_1f1b"``).
        fixed_s, per_microbatch_s: the pipeline's makespan for ``nb >= 1`` microbatches is
            ``fixed_s + per_microbatch_s * nb`` seconds (fitted through two simulations of the plan; a 1F1B
            makespan is linear in ``nb``, as Oobleck's formula ``sum w + (nb - S + k* - 1) w_k* + ...``).
        rank_grad_bytes: per plan rank, the bytes of trainable parameters it holds (its gradient all-reduce).

    Raises:
        ValueError: when the plan needs more ranks than ``num_ranks`` or a time is negative.
    """

    num_ranks: int
    plan: PipelinePlan
    schedule: str
    fixed_s: float
    per_microbatch_s: float
    rank_grad_bytes: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.plan.num_ranks > self.num_ranks:
            raise ValueError(f"template for {self.num_ranks} ranks has a plan on {self.plan.num_ranks} ranks")
        if self.per_microbatch_s < 0 or self.fixed_s < 0:
            raise ValueError(f"template for {self.num_ranks} ranks: negative time ({self.fixed_s}, "
                             f"{self.per_microbatch_s})")

    def makespan_s(self, microbatches: int) -> float:
        """Predicted makespan (s) of ``microbatches`` microbatches (0 for none)."""
        return 0.0 if microbatches <= 0 else self.fixed_s + self.per_microbatch_s * microbatches

    def units_of(self, plan_rank: int) -> tuple[str, ...]:
        """Unit names plan rank ``plan_rank`` holds (empty for a spare)."""
        return tuple(u for s in self.plan.stages_on_rank(plan_rank) for u in self.plan.stages[s].units)


@dataclass(frozen=True)
class UnitBytes(JsonDataclass):
    """What moving one unit to another rank copies (bytes): its parameters and, when it trains, its optimizer
    state (``OptimizerSpec.state_bytes_per_param`` per trained parameter; 0 for a frozen unit)."""

    name: str
    param_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class TemplateSet(JsonDataclass):
    """Templates for every pipeline size a job of ``num_ranks`` ranks tolerating ``failures`` failures needs.

    Attributes:
        num_ranks: ranks of the job (``N``).
        failures: failures tolerated at once (``f``): instantiations hold at least ``f + 1`` pipelines.
        microbatches: microbatches of the global batch (``M``), the same whatever the pipelines.
        templates: one per size, increasing, from ``min_ranks`` (``n0``) to ``max_ranks`` (``N - f n0``).
        units: per unit (model order), its copy bytes.
        dp_link: the link of the per-unit gradient all-reduce between pipelines (None: free).
        dp_shard: FSDP2 shard degree inside every pipeline (1: none). Above 1 the set's ranks are **shard groups**
            of ``dp_shard`` workers (group ``g``: workers ``g * dp_shard .. g * dp_shard + dp_shard - 1``,
            ``plait.planner.resilience.shards``): a plan rank runs on a group, its trainable units sharded over the
            group's workers, each worker running its own copy of the pipeline (a shard row) on its own microbatches;
            ``microbatches`` counts one row's, ``num_ranks`` the groups. Every pipeline has the same degree, so
            shard ``i`` of a unit is the same slice in every pipeline.

    Raises:
        ValueError: on no template, sizes that are not consecutive, templates over different units, or
            ``dp_shard`` < 1.
    """

    num_ranks: int
    failures: int
    microbatches: int
    templates: tuple[PipelineTemplate, ...]
    units: tuple[UnitBytes, ...]
    dp_link: P2PModel | None = None
    dp_shard: int = 1

    def __post_init__(self) -> None:
        if int(self.dp_shard) != self.dp_shard or self.dp_shard < 1:
            raise ValueError(f"TemplateSet needs dp_shard >= 1 (an integer), got {self.dp_shard!r}")
        sizes = [t.num_ranks for t in self.templates]
        if not sizes or sizes != list(range(sizes[0], sizes[0] + len(sizes))):
            raise ValueError(f"TemplateSet needs templates for consecutive sizes, got {sizes}")
        names = {u.name for u in self.units}
        for t in self.templates:
            held = {u for s in t.plan.stages for u in s.units}
            if held != names:
                raise ValueError(f"template for {t.num_ranks} ranks covers other units than the set's")

    @property
    def rank_noun(self) -> str:
        """What the set's ranks are, for people: ``"ranks"``, or ``"shard groups"`` when :attr:`dp_shard` > 1."""
        return rank_noun(self.dp_shard)

    @property
    def workers(self) -> int:
        """Worker processes of the job: ``num_ranks * dp_shard``."""
        return self.num_ranks * self.dp_shard

    @property
    def min_ranks(self) -> int:
        """``n0``: the fewest ranks a pipeline fits on."""
        return self.templates[0].num_ranks

    @property
    def max_ranks(self) -> int:
        """The largest template's size."""
        return self.templates[-1].num_ranks

    def template(self, num_ranks: int) -> PipelineTemplate:
        """The template for ``num_ranks`` ranks; above the largest size, the largest one (the extra ranks are
        spares).

        Raises:
            ValueError: below ``min_ranks``.
        """
        if num_ranks < self.min_ranks:
            raise ValueError(f"no pipeline fits on {num_ranks} ranks: the smallest template needs "
                             f"{self.min_ranks}")
        return self.templates[min(num_ranks, self.max_ranks) - self.min_ranks]

    def unit_bytes(self) -> dict[str, UnitBytes]:
        """Copy bytes by unit name."""
        return {u.name: u for u in self.units}


@dataclass(frozen=True)
class PipelineInstance(JsonDataclass):
    """One pipeline of an instantiation.

    Attributes:
        template: its template.
        ranks: the global ranks it occupies; ``ranks[i]`` runs plan rank ``i`` (``i < template.plan.num_ranks``),
            the rest are spares.
        microbatches: its share of the global batch's microbatches.

    Raises:
        ValueError: when the rank count differs from the template's size (or is below its plan's), ranks
            repeat, or a negative microbatch count.
    """

    template: PipelineTemplate
    ranks: tuple[int, ...]
    microbatches: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(set(self.ranks)) != len(self.ranks) or len(self.ranks) < self.template.plan.num_ranks:
            raise ValueError(f"pipeline ranks {self.ranks} must be distinct and at least the plan's "
                             f"{self.template.plan.num_ranks}")
        if self.microbatches < 0:
            raise ValueError(f"a pipeline's microbatches must be >= 0, got {self.microbatches}")

    def units_of(self, rank: int) -> tuple[str, ...]:
        """Unit names global rank ``rank`` holds in this pipeline (empty for a spare).

        Raises:
            ValueError: when ``rank`` is not in the pipeline.
        """
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in pipeline {self.ranks}")
        return self.template.units_of(self.ranks.index(rank))

    def holder(self, unit: str) -> int:
        """The global rank holding ``unit`` in this pipeline."""
        plan = self.template.plan
        return self.ranks[plan.stages[plan.stage_of_unit(unit)].rank]

    @property
    def makespan_s(self) -> float:
        """Predicted makespan (s) of its microbatches."""
        return self.template.makespan_s(self.microbatches)


@dataclass(frozen=True)
class Instantiation(JsonDataclass):
    """Pipelines (heterogeneous data-parallel replicas of one model) over a job's ranks.

    Attributes:
        pipelines: the pipelines; their ranks are disjoint.
        iteration_s: predicted iteration time (s): the slowest pipeline's makespan plus the slowest rank's
            gradient all-reduce among the pipelines.

    Raises:
        ValueError: when pipelines share a rank.
    """

    pipelines: tuple[PipelineInstance, ...]
    iteration_s: float

    def __post_init__(self) -> None:
        ranks = [r for p in self.pipelines for r in p.ranks]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"pipelines share ranks: {[p.ranks for p in self.pipelines]}")

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank of the instantiation, sorted."""
        return tuple(sorted(r for p in self.pipelines for r in p.ranks))

    @property
    def microbatches(self) -> int:
        """The global batch's microbatches (the sum over pipelines)."""
        return sum(p.microbatches for p in self.pipelines)

    def spares(self) -> list[tuple[int, int]]:
        """``(ranks, ranks with a stage)`` of each pipeline whose plan leaves some of its ranks without a stage
        (spares), in pipeline order; empty when every rank runs a stage."""
        return [(len(p.ranks), p.template.plan.num_ranks) for p in self.pipelines
                if p.template.plan.num_ranks < len(p.ranks)]

    def pipeline_of(self, rank: int) -> int:
        """Index of the pipeline holding global rank ``rank``.

        Raises:
            ValueError: when no pipeline holds it.
        """
        for index, pipeline in enumerate(self.pipelines):
            if rank in pipeline.ranks:
                return index
        raise ValueError(f"rank {rank} is in no pipeline of {[p.ranks for p in self.pipelines]}")

    def units_of(self, rank: int) -> tuple[str, ...]:
        """Unit names ``rank`` holds."""
        return self.pipelines[self.pipeline_of(rank)].units_of(rank)

    def holders(self, unit: str) -> tuple[int, ...]:
        """The ranks holding ``unit``, one per pipeline in pipeline order: its gradient-reduction group."""
        return tuple(p.holder(unit) for p in self.pipelines)

    def describe(self, dp_shard: int = 1) -> str:
        """One line for people: ``3 pipelines: 4 ranks (4 stages) x 10 mb, ...; predicted 1.234 s per iteration``.
        With ``dp_shard`` > 1 (the ranks are shard groups of that many workers, each pipeline ``dp_shard`` shard
        rows of ``microbatches`` each): ``2 shard groups (2 stages) x 8 mb (4 per shard row)``: the pipeline's
        microbatches."""
        noun = rank_noun(dp_shard)
        rows = f" ({{}} per shard row of {dp_shard} workers)" if dp_shard > 1 else ""
        parts = ", ".join(f"{len(p.ranks)} {noun} ({p.template.plan.num_stages} stages) x "
                          f"{p.microbatches * dp_shard} mb{rows.format(p.microbatches)}" for p in self.pipelines)
        return f"{len(self.pipelines)} pipelines: {parts}; predicted {format_seconds(self.iteration_s)} per iteration"


def rank_noun(dp_shard: int) -> str:
    """What a resilience plan's ranks are, for people: ``"ranks"``, or ``"shard groups"`` when ``dp_shard`` > 1
    (FSDP2 inside the pipelines: each rank a group of ``dp_shard`` workers)."""
    return "ranks" if dp_shard <= 1 else "shard groups"


def format_seconds(seconds: float) -> str:
    """A duration for people with 4 significant digits in a unit that fits: ``1.234 s``, ``12.35 ms``,
    ``45.60 us`` (a tiny model's predicted iteration is well under a millisecond)."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms")):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-6:.4g} us"


class LostUnitsError(ValueError):
    """Every copy of some units was on failed ranks: training cannot continue from the replicas.

    Attributes:
        units: the lost units' names, in model order.
    """

    def __init__(self, units: tuple[str, ...], failed: tuple[int, ...]) -> None:
        shown = ", ".join(units[:8]) + (f" and {len(units) - 8} more" if len(units) > 8 else "")
        super().__init__(f"ranks {list(failed)} failed and held every copy of {len(units)} unit(s): {shown}; "
                         "no replica is left to copy them from: resume from the last checkpoint")
        self.units = units


@dataclass(frozen=True)
class Transfer(JsonDataclass):
    """One unit's state sent from a surviving holder to a rank that now needs it.

    Attributes:
        unit: the unit's name.
        src: global rank sending (held the unit before the failure).
        dst: global rank receiving.
        param_bytes: parameter bytes; state_bytes: optimizer-state bytes (0 for a frozen unit).
    """

    unit: str
    src: int
    dst: int
    param_bytes: int
    state_bytes: int

    @property
    def bytes(self) -> int:
        """Bytes moved."""
        return self.param_bytes + self.state_bytes


@dataclass(frozen=True)
class Reconfiguration(JsonDataclass):
    """The plan after a failure.

    Attributes:
        failed: the failed ranks, sorted.
        before, after: the instantiation before the failure and the survivors' new one.
        transfers: every unit copy, grouped by receiving rank (ascending), units in model order.
        actions: what happened to the pipelines, for people (``"pipeline 1 shrinks 4 -> 3 ranks"``, ...).
    """

    failed: tuple[int, ...]
    before: Instantiation
    after: Instantiation
    transfers: tuple[Transfer, ...]
    actions: tuple[str, ...]

    @property
    def bytes(self) -> int:
        """Bytes copied in all."""
        return sum(t.bytes for t in self.transfers)

    def received_by(self, rank: int) -> tuple[Transfer, ...]:
        """The transfers ``rank`` receives."""
        return tuple(t for t in self.transfers if t.dst == rank)

    def summary(self, dp_shard: int = 1) -> str:
        """One line: what failed, the new pipelines, bytes to copy (``dp_shard`` > 1: the ranks are shard groups of
        that many workers, :func:`rank_noun`)."""
        noun = rank_noun(dp_shard)
        sizes = "+".join(str(len(p.ranks)) for p in self.after.pipelines)
        return (f"{noun} {list(self.failed)} failed; {'; '.join(self.actions) or 'no pipeline changed'}; "
                f"pipelines now {sizes} {noun}; {len(self.transfers)} unit copies, {self.bytes / 2**20:.1f} MiB; "
                f"predicted {format_seconds(self.before.iteration_s)} -> {format_seconds(self.after.iteration_s)} "
                "per iteration")


@dataclass(frozen=True)
class StragglerPolicy(JsonDataclass):
    """When to react to a straggler and when to stop (module docstring).

    Attributes:
        slow_ratio: slowest / fastest relative replica time at which a step counts as slow (> 1).
        recover_ratio: the ratio at or below which a step counts as recovered (>= 1, < ``slow_ratio``).
        patience: consecutive slow (recovered) steps before switching (switching back), >= 1.

    Raises:
        ValueError: on ratios out of those ranges or ``patience < 1``.
    """

    slow_ratio: float = 1.15
    recover_ratio: float = 1.05
    patience: int = 3

    def __post_init__(self) -> None:
        if not (1.0 <= self.recover_ratio < self.slow_ratio) or self.patience < 1:
            raise ValueError(f"StragglerPolicy needs 1 <= recover_ratio < slow_ratio and patience >= 1, got "
                             f"recover_ratio={self.recover_ratio}, slow_ratio={self.slow_ratio}, "
                             f"patience={self.patience}")


@dataclass(frozen=True)
class StragglerState(JsonDataclass):
    """Where the reaction stands after some steps.

    Attributes:
        straggler: the DP replica being waited for (-1: none, every replica runs the fastest point).
        slowdown: the straggler's relative time over the fastest replica's (1.0 when none).
        slow_steps: consecutive slow steps counted while not reacting.
        recovered_steps: consecutive recovered steps counted while reacting.
    """

    straggler: int = -1
    slowdown: float = 1.0
    slow_steps: int = 0
    recovered_steps: int = 0
