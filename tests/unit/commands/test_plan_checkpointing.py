"""``plait plan`` honours ``train.activation_checkpointing`` (issue 14, item 5): the searched costs charge the
recomputation in the backward and keep only the checkpointed layers' inputs (``planner.recompute``)."""

from __future__ import annotations

import io

from plait.commands.plan.command import plan_command
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"


def _choice(policy: str):
    return plan_command(DEMO, 1, device="h100", overrides=[f"--train.activation_checkpointing={policy}"],
                        dp_degrees=[1], out=io.StringIO())


def test_plan_charges_recomputation_and_keeps_fewer_activation_bytes():
    none, selective, full = _choice("none"), _choice("selective"), _choice("full")
    assert sum(full.stage_activation_bytes) < sum(selective.stage_activation_bytes) < sum(none.stage_activation_bytes)
    assert sum(full.stage_backward_s) > sum(selective.stage_backward_s) > sum(none.stage_backward_s)
    assert full.stage_forward_s == none.stage_forward_s
    assert full.stage_static_bytes == none.stage_static_bytes
