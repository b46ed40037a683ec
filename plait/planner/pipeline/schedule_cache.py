"""Schedules generated once per plan shape: a search times thousands of candidate plans that differ only in their
stage boundaries, and a schedule generator reads none of that (only which stages exist, on which ranks, which of them
train or need an input gradient, the edges and the microbatch count), so each shape's schedule is generated and checked
once (:func:`memoized_schedule`) and handed to the other plans of that shape.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.types import PipelinePlan

__all__ = ["CACHE_SIZE", "memoized_schedule", "plan_shape"]

CACHE_SIZE = 4096
"""Schedules kept per generator (least recently used dropped first)."""


def plan_shape(plan: PipelinePlan) -> tuple:
    """What a schedule generator reads of ``plan``: its layout, edges, microbatch count and, per stage, its modules,
    rank and gradient flags (not its units: two plans of one shape get the same actions)."""
    return (plan.layout, plan.edges, plan.num_microbatches,
            tuple((s.modules, s.rank, s.trainable, s.needs_input_grad) for s in plan.stages))


def _frozen(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else value


def memoized_schedule(generator: Callable[..., Any]) -> Callable[..., Any]:
    """``generator(plan, *args, **kwargs)`` remembered by :func:`plan_shape` and its other arguments: the first plan
    of a shape runs the generator (and its checks); a later one gets the same actions on its own plan (a
    :class:`Schedule` marked checked as the first was), or a fresh copy of per-rank action lists. Errors are not
    remembered (a refused shape is refused again, by the generator)."""
    cache: OrderedDict[tuple, Any] = OrderedDict()

    @functools.wraps(generator)
    def wrapper(plan: PipelinePlan, *args: Any, **kwargs: Any) -> Schedule:
        key = (plan_shape(plan), tuple(_frozen(a) for a in args), tuple(sorted((k, _frozen(v))
                                                                               for k, v in kwargs.items())))
        known = cache.get(key)
        if known is None:
            made = generator(plan, *args, **kwargs)
            known = cache[key] = made if isinstance(made, Schedule) else tuple(tuple(rank) for rank in made)
            if len(cache) > CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        if not isinstance(known, Schedule):  # per-rank action lists: a fresh copy the caller may change
            return [list(rank) for rank in known]
        if known.plan is plan:
            return known
        return Schedule(plan=plan, actions=known.actions, num_microbatches=known.num_microbatches,
                        split_backward=known.split_backward, name=known.name, checked=known.checked)

    wrapper.cache = cache  # type: ignore[attr-defined]
    return wrapper
