"""``plait plan --schedules``: the zero-bubble schedules weighed beside 1F1B, the one planned in the job tables."""

from __future__ import annotations

import io

from plait.cli import main
from plait.commands.plan.command import plan_command
from tests.helpers.jobs import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


def test_the_fastest_weighed_schedule_is_planned_and_written_into_the_job_tables(tmp_path):
    weighed, alone = io.StringIO(), io.StringIO()
    common = dict(device="h100", dp_degrees=[1], virtual_stages=(1,), attach_encoders=False, profile_store=None)
    choice = plan_command(DEMO, 4, tmp_path / "plan.json", out=weighed, schedules=("1f1b", "zb_h1", "zb_h2"),
                          **common)
    one = plan_command(DEMO, 4, None, out=alone, **common)
    assert one.schedule == "1f1b" and choice.schedule in ("zb_h1", "zb_h2")
    assert choice.plan == one.plan and choice.iteration_s < one.iteration_s
    assert f'schedule = "{choice.schedule}"' in weighed.getvalue()
    assert f"under {choice.schedule}; " in weighed.getvalue() and "under 1f1b; " in alone.getvalue()


def test_an_unknown_schedule_is_refused_naming_the_choices(capsys):
    assert main(["plan", "--config", DEMO, "--devices", "4", "--schedules", "1f1b,zb_h3"]) == 2
    assert "--schedules: unknown schedule(s) ['zb_h3']; choose from gpipe, 1f1b, memory_capped_1f1b, zb_h1, zb_h2" \
        in capsys.readouterr().err
