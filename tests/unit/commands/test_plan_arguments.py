"""``plait plan``'s argument checks: a bad ``--devices`` is refused by name before the job is read."""

from __future__ import annotations

import pytest

from plait.commands.plan.command import plan_command
from tests.helpers.jobs import ROOT


@pytest.mark.parametrize("devices", [0, -2])
def test_devices_below_one_is_refused_naming_the_flag(devices):
    with pytest.raises(ValueError, match=rf"^--devices must be an integer >= 1, got {devices}$"):
        plan_command(ROOT / "configs" / "demo.toml", devices, device="cpu-preset")
