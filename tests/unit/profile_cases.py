"""Profile fixtures shared by the profiler tests (tests/unit/train) and the profile command's store tests
(tests/unit/commands)."""

from __future__ import annotations

from plait.planner.pipeline.plan import synthetic_units
from plait.planner.cost.measured_profile import Profile, UnitMeasurement
from plait.planner.cost.types import ProfileKey

KEY = ProfileKey({"llm": {"hidden_size": 32}, "freeze": False}, [{"input_ids": [2, 9]}], "float32",
                 "cpu x86_64 (1 threads)", "0.1.0", "2.13.0")


def measurement(name: str, f: float = 1.0, dx: float = 0.5, dw: float = 0.75, fused: float = 1.0,
                split: tuple[float, float] | None = None) -> UnitMeasurement:
    """A unit's measurement; ``split``: the runtime's split ``(B, W)`` seconds (None: not measured, an old profile)."""
    return UnitMeasurement(name, f, dx, dw, fused, 400, 400, 800, 100, 50, *(split or (None, None)))


def make_profile(key: ProfileKey = KEY) -> Profile:
    units = synthetic_units({"vision": [False, True]}, [True, True])
    return Profile(key, units, tuple(measurement(u.name) for u in units), {"vision": {"F": 0.1, "B": 0.2}}, 3, 1)
