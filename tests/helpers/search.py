"""Helpers of several test modules, taken from tests/unit/planner/test_search.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import random

from plait.planner.pipeline.plan import synthetic_units
from plait.planner.types import UnitCost


def random_model(seed: int, encoders: int):
    rng = random.Random(seed)
    spec = {}
    for name in ("vision", "audio")[:encoders]:
        n = rng.randint(1, 3)
        spec[name] = [rng.random() < 0.3 for _ in range(n - 1)] + [rng.random() < 0.7]
    units = synthetic_units(spec, [rng.random() < 0.4 for _ in range(rng.randint(1, 4))])
    costs = [UnitCost(rng.randint(1, 16) / 8, rng.randint(0, 16) / 8, rng.randint(0, 16) / 8,
                      param_bytes=rng.randint(0, 64), activation_bytes=rng.randint(0, 16),
                      output_bytes=rng.randint(0, 32)) for _ in units]
    return units, costs, rng
