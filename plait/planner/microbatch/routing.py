"""Feature routing (deferred encoder outputs; Entrain's level 2): which
rows of which encoder microbatch feed which LLM microbatch, as plan data computed from a ``MicrobatchPlan``.

A microbatch plan may run a sample's LLM work in a later microbatch ``j`` than its encoder work ``i``. The
encoder view of a DP replica runs microbatch ``i`` on the items of its encoder samples; the LLM view runs
microbatch ``j`` on its LLM samples, whose placeholders take their projected features from the encoder
microbatches of those samples. Both trainers execute a :class:`FeatureRouting` through one implementation
(:mod:`plait.parallel.deferral`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from plait.planner.microbatch import MicrobatchPlan
from plait.planner.serialize import JsonDataclass

__all__ = ["FeatureRouting", "plan_feature_routing"]


@dataclass(frozen=True)
class FeatureRouting(JsonDataclass):
    """The encoder view and the LLM view of one pipeline's (one DP replica's) ``M`` microbatches (plan data:
    ``to_dict``/``from_dict``/``to_json`` round-trip it).

    Encoder microbatch ``i`` runs the items of ``encoder_samples[i]``, in that order; LLM microbatch ``j`` runs
    ``llm_samples[j]``, in row-major placeholder order. A sample whose LLM microbatch is later than its encoder
    microbatch is *deferred*: its features are kept from encoder microbatch ``i`` to LLM microbatch ``j``.

    Attributes:
        encoder_samples: per microbatch, the keys (distinct ints, e.g. positions in the global batch) of the
            samples of the encoder view, in item order.
        llm_samples: per microbatch, the keys of the samples of the LLM view, in row-major placeholder order.
        features: per sample key, per encoder branch, its projected feature rows (= its placeholder tokens of
            that branch; a missing branch means 0).

    Raises:
        ValueError: on views of different lengths, a sample listed twice in one view or in one view only, a
            sample whose LLM microbatch precedes its encoder microbatch, or a sample without ``features``.
    """

    encoder_samples: tuple[tuple[int, ...], ...]
    llm_samples: tuple[tuple[int, ...], ...]
    features: dict[int, dict[str, int]]

    def __post_init__(self) -> None:
        for name in ("encoder_samples", "llm_samples"):
            object.__setattr__(self, name, tuple(map(tuple, getattr(self, name))))
        object.__setattr__(self, "features", {k: dict(v) for k, v in self.features.items()})
        m = len(self.encoder_samples)
        if len(self.llm_samples) != m:
            raise ValueError(f"FeatureRouting: encoder_samples ({m}) and llm_samples ({len(self.llm_samples)}) need "
                             "one entry per microbatch")
        enc, llm = _view_index(self.encoder_samples, "encoder_samples"), _view_index(self.llm_samples, "llm_samples")
        if set(enc) != set(llm):
            raise ValueError(f"FeatureRouting: samples {sorted(set(enc) ^ set(llm))[:5]} are in one view only")
        for key, i in enc.items():
            if llm[key] < i:
                raise ValueError(f"FeatureRouting: sample {key} has encoder microbatch {i} but LLM microbatch "
                                 f"{llm[key]}; deferral only moves LLM work later")
            if key not in self.features:
                raise ValueError(f"FeatureRouting: sample {key} has no features entry")

    @property
    def num_microbatches(self) -> int:
        """``M``, microbatches in each view."""
        return len(self.encoder_samples)

    @cached_property
    def encoder_of(self) -> dict[int, int]:
        """``{sample key: encoder microbatch}``."""
        return _view_index(self.encoder_samples, "encoder_samples")

    @cached_property
    def rows(self) -> dict[int, dict[str, tuple[int, int]]]:
        """Per sample key, per branch with features, its ``(start, stop)`` rows in the features ``[rows, hidden]``
        of its encoder microbatch."""
        out: dict[int, dict[str, tuple[int, int]]] = {}
        for samples in self.encoder_samples:
            start: dict[str, int] = defaultdict(int)
            for key in samples:
                out[key] = {}
                for branch, n in self.features[key].items():
                    if n:
                        out[key][branch] = (start[branch], start[branch] + int(n))
                        start[branch] += int(n)
        return out

    def encoder_rows(self, i: int, branch: str) -> int:
        """Feature rows of ``branch`` that encoder microbatch ``i`` produces (its samples' rows)."""
        return sum(int(self.features[k].get(branch, 0)) for k in self.encoder_samples[i])

    def spans(self, j: int, branch: str) -> tuple[tuple[int, int, int], ...]:
        """The features of ``branch`` of LLM microbatch ``j``, in placeholder order: per sample with such rows,
        ``(encoder microbatch, start, stop)`` of its rows in that microbatch's features."""
        return tuple((self.encoder_of[k], *self.rows[k][branch]) for k in self.llm_samples[j]
                     if branch in self.rows[k])

    @cached_property
    def sources(self) -> tuple[tuple[int, ...], ...]:
        """Per LLM microbatch ``j``, the encoder microbatches (ascending, all ``<= j``) of its samples."""
        return tuple(tuple(sorted({self.encoder_of[k] for k in samples})) for samples in self.llm_samples)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """Per encoder microbatch ``i``, the LLM microbatches (ascending, all ``>= i``) that read its samples."""
        out: list[list[int]] = [[] for _ in self.encoder_samples]
        for j, srcs in enumerate(self.sources):
            for i in srcs:
                out[i].append(j)
        return tuple(tuple(u) for u in out)

    @property
    def defers(self) -> bool:
        """Whether some sample's LLM microbatch is later than its encoder microbatch."""
        return any(self.encoder_of[k] != j for j, samples in enumerate(self.llm_samples) for k in samples)


def _view_index(view: Sequence[Sequence[int]], name: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, samples in enumerate(view):
        for key in samples:
            if key in out:
                raise ValueError(f"FeatureRouting.{name}: sample {key} is in microbatches {out[key]} and {i}")
            out[key] = i
    return out


def plan_feature_routing(plan: MicrobatchPlan, rank: int, features: Mapping[int, Mapping[str, int]]
                         ) -> FeatureRouting:
    """The :class:`FeatureRouting` of DP replica ``rank`` of ``plan``: encoder view ``plan.microbatches[rank]``,
    LLM view ``plan.llm_microbatches(rank)``, sample keys the plan's sample indices. Microbatches empty in both
    views are dropped (order kept), so the routing may have fewer than ``plan.num_microbatches``; none when the
    replica has no sample.

    Args:
        plan: the step's microbatch plan.
        rank: the DP replica.
        features: per sample index of the replica, per encoder branch, its projected feature rows.

    Raises:
        ValueError: on a rank outside the plan, or a sample of the replica without ``features``.
    """
    if not 0 <= rank < plan.dp:
        raise ValueError(f"plan_feature_routing: rank {rank} outside [0, {plan.dp})")
    enc, llm = plan.microbatches[rank], plan.llm_microbatches(rank)
    keep = [j for j in range(plan.num_microbatches) if enc[j] or llm[j]]
    mine = sorted(k for j in keep for k in enc[j])
    missing = [k for k in mine if k not in features]
    if missing:
        raise ValueError(f"plan_feature_routing: samples {missing[:5]} have no features entry")
    return FeatureRouting(tuple(enc[j] for j in keep), tuple(llm[j] for j in keep),
                          {k: dict(features[k]) for k in mine})
