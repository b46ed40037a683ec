"""Straggler reaction (Perseus "extrinsic bloat"): when one DP replica is measured slower for
several steps, the others need not finish early and wait in the gradient all-reduce; they switch to the frontier
point at the straggler's iteration time (:meth:`plait.planner.energy.types.EnergyPlan.point_for`) and back to the
fastest point ``T*`` when it recovers.

Pure decision, the same on every rank: each step every rank gets every replica's *relative time* (its measured
step time divided by the predicted iteration time of the frontier point it ran, so a replica that slowed down on
purpose is not taken for a straggler) and folds it into a :class:`StragglerState` with :func:`react_to_stragglers`.

Hysteresis (stated, and in :class:`StragglerPolicy`): reacting starts after ``patience`` consecutive steps whose
slowest replica is at least ``slow_ratio`` times the fastest; it ends after ``patience`` consecutive steps with
that ratio at most ``recover_ratio`` (< ``slow_ratio``, so a ratio between them keeps the current state). While
reacting, the target slowdown follows the latest ratio (the straggler may get slower or faster) and never drops
below ``slow_ratio``.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.planner.energy.types import EnergyPlan, FrontierPoint
from plait.planner.resilience.types import StragglerPolicy, StragglerState

__all__ = ["react_to_stragglers", "replica_point"]


def react_to_stragglers(policy: StragglerPolicy, state: StragglerState,
                        relative_times: Sequence[float]) -> StragglerState:
    """The state after one more step whose replica ``d`` took ``relative_times[d]`` (measured step time over the
    predicted iteration time of the point it ran; any common unit), following ``policy``'s hysteresis.

    Raises:
        ValueError: on no replica or a time <= 0.
    """
    if not relative_times or min(relative_times) <= 0:
        raise ValueError(f"react_to_stragglers needs one positive time per DP replica, got {list(relative_times)}")
    ratio = max(relative_times) / min(relative_times)
    slowest = max(range(len(relative_times)), key=lambda d: (relative_times[d], -d))
    if state.straggler < 0:
        slow = state.slow_steps + 1 if ratio >= policy.slow_ratio else 0
        if slow >= policy.patience:
            return StragglerState(slowest, ratio, 0, 0)
        return StragglerState(-1, 1.0, slow, 0)
    recovered = state.recovered_steps + 1 if ratio <= policy.recover_ratio else 0
    if recovered >= policy.patience:
        return StragglerState()
    if ratio >= policy.slow_ratio:
        return StragglerState(slowest, ratio, 0, recovered)
    return StragglerState(state.straggler, state.slowdown, 0, recovered)


def replica_point(plan: EnergyPlan, state: StragglerState, dp_rank: int) -> FrontierPoint:
    """The frontier point DP replica ``dp_rank`` runs in ``state``: the fastest point ``T*`` for the straggler
    and when there is none; for the others ``plan.point_for(T* x slowdown)``, the least-energy point that still
    finishes by the time the straggler does.

    Raises:
        ValueError: when the plan has no point.
    """
    if not plan.points:
        raise ValueError(f"EnergyPlan for {plan.gpu} has no frontier point")
    fastest = plan.points[0]
    if state.straggler < 0 or state.straggler == dp_rank:
        return fastest
    return plan.point_for(fastest.iteration_time_s * state.slowdown)
