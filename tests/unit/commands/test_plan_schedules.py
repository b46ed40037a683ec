"""``plait plan --schedules``: the zero-bubble schedules weighed beside 1F1B, the one planned in the job tables."""

from __future__ import annotations

import io

from plait.cli import main
from plait.commands.plan.command import plan_command
from tests.helpers.jobs import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


def test_the_fastest_weighed_schedule_is_planned_and_written_into_the_job_tables(tmp_path):
    weighed, alone = io.StringIO(), io.StringIO()
    # one replica per encoder stage: the schedules are weighed on the same plan (with replicas, the default, a
    # 3-rank plan with audio on 2 replicas is 10% faster under 1F1B than this plan's 1F1B and is chosen instead)
    common = dict(device="h100", dp_degrees=[1], virtual_stages=(1,), attach_encoders=False, profile_store=None,
                  encoder_dp=False)
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


def test_a_schedule_that_could_not_be_weighed_is_named_with_why():
    from plait.commands.plan.command import not_weighed
    from plait.planner.pipeline.plan import synthetic_units
    from plait.planner.search.layout import plan_layout
    from plait.planner.search.types import SearchSpace
    from plait.planner.types import UnitCost

    units = synthetic_units({}, [True] * 3)  # 3 LLM units: no V of 2 ranks x 2 units
    costs = [UnitCost(1.0, 1.0, 0.5, param_bytes=0, activation_bytes=10, output_bytes=0) for _ in units]
    choice = plan_layout(units, costs, 3, microbatches=6, space=SearchSpace(dp_degrees=[1], schedules=("1f1b", "zb_v")))
    assert choice.schedule == "1f1b" and choice.schedules_weighed == ()
    assert not_weighed(("1f1b", "zb_v"), choice).startswith("not weighed: zb_v (a V needs the best plan of one stage")
    assert not_weighed(("1f1b",), choice) == ""


def test_an_empty_schedule_list_is_refused(capsys):
    assert main(["plan", "--config", DEMO, "--devices", "4", "--schedules", ""]) == 2
    assert "--schedules: give at least one schedule" in capsys.readouterr().err
