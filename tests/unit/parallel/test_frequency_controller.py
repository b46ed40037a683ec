"""Frequency controllers (parallel.energy): the recording one, the NVML one against a fake zeus GPU collection
(locking, changes only, refusal -> one warning and recording), plan files, the step span."""

import logging

import pytest
import torch

from plait.parallel.energy import (
    FrequencyController,
    NvmlFrequencyController,
    StragglerReaction,
    build_frequency_controller,
    read_energy_plan,
    step_span_s,
)
from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint
from plait.planner.resilience.types import StragglerPolicy
from plait.planner.pipeline.types import TimelineEvent

PLAN = EnergyPlan("h100", 1980, (
    FrontierPoint(1.0, 500.0, (ActionFrequency(0, "F s0 m0", 1500), ActionFrequency(0, "B s0 m0", 1500),
                               ActionFrequency(1, "F s1 m0", 1200))),
    FrontierPoint(1.4, 400.0, (ActionFrequency(0, "F s0 m0", 900),)),
))


class FakeGpus:
    def __init__(self, refuse: bool = False):
        self.calls, self.refuse = [], refuse

    def set_gpu_locked_clocks(self, index, lo, hi):
        if self.refuse:
            raise PermissionError("SYS_ADMIN needed")
        self.calls.append(("lock", index, lo, hi))

    def reset_gpu_locked_clocks(self, index):
        self.calls.append(("reset", index))


def test_recording_controller_gives_planned_frequency_and_max_for_unlisted():
    ctl = FrequencyController(PLAN, 0)
    assert [ctl.before("F", 0, 0), ctl.before("B", 0, 0), ctl.before("F", 0, 1)] == [1500, 1500, 1980]
    assert ctl.records == [("F s0 m0", 1500), ("B s0 m0", 1500), ("F s0 m1", 1980)]
    ctl.use_point(PLAN.points[1])
    assert ctl.before("F", 0, 0) == 900 and ctl.before("B", 0, 0) == 1980
    assert FrequencyController(PLAN, 1).before("F", 1, 0) == 1200
    assert not ctl.applies


def test_nvml_controller_locks_only_on_change_and_resets():
    gpus = FakeGpus()
    ctl = NvmlFrequencyController(PLAN, 0, 3, gpus)
    for kind, m in [("F", 0), ("B", 0), ("F", 1), ("B", 1)]:
        ctl.before(kind, 0, m)
    ctl.close()
    assert gpus.calls == [("lock", 3, 1500, 1500), ("lock", 3, 1980, 1980), ("reset", 3)]


def test_nvml_controller_refused_warns_once_and_records(caplog):
    gpus = FakeGpus(refuse=True)
    ctl = NvmlFrequencyController(PLAN, 0, 0, gpus)
    with caplog.at_level(logging.WARNING, logger="plait.parallel.energy"):
        got = [ctl.before("F", 0, 0), ctl.before("F", 0, 1), ctl.before("F", 0, 0)]
    assert got == [1500, 1980, 1500] and not ctl.applies
    assert sum("SYS_ADMIN" in r.message for r in caplog.records) == 1
    ctl.close()
    assert gpus.calls == []


def test_cpu_device_gets_the_recording_controller():
    assert type(build_frequency_controller(PLAN, 0, torch.device("cpu"))) is FrequencyController


def test_read_energy_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(PLAN.to_json())
    assert read_energy_plan(path) == PLAN
    with pytest.raises(FileNotFoundError, match="plait energy"):
        read_energy_plan(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"gpu": "h100"}')
    with pytest.raises(ValueError, match="bad.json is not a frequency plan"):
        read_energy_plan(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text(EnergyPlan("h100", 1980).to_json())
    with pytest.raises(ValueError, match="no frontier point"):
        read_energy_plan(tmp_path / "empty.json")


def test_step_span_and_single_process_reaction():
    events = [TimelineEvent(0, "F", 0, 0, 10.0, 10.5), TimelineEvent(0, "B", 0, 0, 11.0, 12.25)]
    assert step_span_s(events) == 2.25 and step_span_s([]) == 0.0
    ctl = FrequencyController(PLAN, 0)
    reaction = StragglerReaction(ctl, StragglerPolicy(patience=1), 0, 1, torch.device("cpu"))
    assert reaction.observe(3.0) == PLAN.points[0] and reaction.history == [(-1, 1.0)]


def test_build_energy_runtime_from_the_config_section(tmp_path):
    from plait.config.schema import EnergyConfig
    from plait.parallel.energy import build_energy_runtime

    assert build_energy_runtime(EnergyConfig(), 0, 0, 1, torch.device("cpu")) is None  # no plan: off
    path = tmp_path / "plan.json"
    path.write_text(PLAN.to_json())
    runtime = build_energy_runtime(EnergyConfig(plan=str(path), patience=2), 1, 0, 1, torch.device("cpu"))
    assert runtime.controller.rank == 1 and runtime.controller.before("F", 1, 0) == 1200
    assert runtime.reaction.policy == StragglerPolicy(1.15, 1.05, 2)
    runtime.after_step([TimelineEvent(1, "F", 1, 0, 0.0, 0.5)])  # one replica: no straggler
    assert runtime.reaction.history == [(-1, 1.0)]
    runtime.close()
    off = build_energy_runtime(EnergyConfig(plan=str(path), straggler=False), 0, 0, 2, torch.device("cpu"))
    assert off.reaction is None
    off.after_step([])


def test_energy_config_is_validated():
    from plait.config.loader import config_from_dict, validate

    def job(energy, pp=2):
        return config_from_dict({"model": {"llm": {"config": {"model_type": "llama"}}},
                                 "parallel": {"pp": {"degree": pp}}, "energy": energy})

    with pytest.raises(ValueError, match=r"energy.plan = 'p.json' sets the frequency of pipeline actions: it needs "
                                         r"parallel.pp.degree > 1"):
        validate(job({"plan": "p.json"}, pp=1))
    with pytest.raises(ValueError, match="energy.recover_ratio must be >= 1 and below energy.slow_ratio"):
        validate(job({"slow_ratio": 1.1, "recover_ratio": 1.2}, pp=1))
    with pytest.raises(ValueError, match="energy.patience must be >= 1, got 0"):
        validate(job({"patience": 0}, pp=1))
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['energy.plann'\]"):
        job({"plann": "x"})


def test_a_plan_made_for_another_layout_is_refused_at_its_first_unknown_action():
    """A plan records its schedule; the controller refuses an action the planned schedule does not hold (a
    2-stage job given a plan made for one stage), instead of running it silently at the top clock."""
    from plait.planner.energy.types import ActionFrequency, EnergyPlan, FrontierPoint

    point = FrontierPoint(1.0, 10.0, (ActionFrequency(0, "F s0 m0", 1140),))
    plan = EnergyPlan("h100", 1980, (point,), schedule=("0 F s0 m0", "0 B s0 m0"))
    again = EnergyPlan.from_json(plan.to_json())
    assert again == plan and again.plans_action(0, "B s0 m0") and not again.plans_action(1, "F s1 m0")
    controller = FrequencyController(again, rank=0)
    assert controller.before("F", 0, 0) == 1140 and controller.before("B", 0, 0) == 1980
    with pytest.raises(ValueError, match=r"made for another layout: it has no action 'F s0 m1' on rank 0"):
        controller.before("F", 0, 1)
    assert FrequencyController(EnergyPlan("h100", 1980, (point,)), rank=1).before("F", 1, 0) == 1980  # unchecked
