"""Extending a run on resume (a larger ``train.steps``): the LR schedule's remaining cosine is re-stretched, so the
LR goes on without a jump, by the formula of ``plait.train.optim`` (README "Longer runs")."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from plait.train.checkpoint import _restore_schedule
from plait.train.metrics import read_metrics
from plait.train.optim import CosineSchedule, LRSchedule, build_scheduler, lr_factor
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records


def cosine(r: float, phase: float) -> float:
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * phase))


def test_extension_restretches_the_remaining_cosine_from_the_current_phase():
    plain = lr_factor(2, 8, 0.1)
    longer = plain.extended(4, 16)  # resumed at step 4 (phase (4 - 2) / 6 = 1/3) with 16 steps
    assert longer.segments == ((2, 0.0, 8), (4, pytest.approx(1 / 3), 16))
    for s in range(4):
        assert longer(s) == pytest.approx(plain(s), rel=1e-12)  # the past is unchanged
    for s in range(4, 20):
        phase = 1 / 3 + (2 / 3) * min(1.0, (s - 4) / 12)
        assert longer(s) == pytest.approx(cosine(0.1, phase), rel=1e-12)
    assert longer(16) == pytest.approx(0.1) and longer.total == 16
    # extended again at step 10: continues the extended curve, not the first one
    again = longer.extended(10, 30)
    p10 = 1 / 3 + (2 / 3) * 6 / 12
    assert again.segments[-1] == (10, pytest.approx(p10), 30) and len(again.segments) == 3
    assert again(10) == pytest.approx(longer(10), rel=1e-12)
    assert again(20) == pytest.approx(cosine(0.1, p10 + (1 - p10) * 10 / 20), rel=1e-12)
    # extended during warm-up: the same as a run planned with the longer total from the start
    early = plain.extended(1, 16)
    assert all(early(s) == pytest.approx(lr_factor(2, 16, 0.1)(s), rel=1e-12) for s in range(20))
    # a finished run (phase 1) stays at the floor; the same total changes nothing
    assert all(plain.extended(8, 12)(s) == pytest.approx(0.1) for s in range(8, 14))
    assert plain.extended(5, 8) is plain
    assert CosineSchedule.from_json(again.to_json()) == again


def test_schedule_state_extends_on_load_with_or_without_an_optimizer_and_across_the_two():
    saved = LRSchedule(0.1, lr_factor(2, 8, 0.1))  # the pipeline trainer's kind
    for _ in range(5):
        saved.step()
    state = saved.state_dict()
    direct = LRSchedule(0.1, lr_factor(2, 20, 0.1))
    direct.load_state_dict(state)
    expected = 0.1 * lr_factor(2, 8, 0.1).extended(5, 20)(5)
    assert direct.extended_from == 8 and direct.get_last_lr() == pytest.approx([expected], rel=1e-12)
    assert direct.get_last_lr() == pytest.approx(saved.get_last_lr(), rel=1e-12)  # no jump
    # into the trainer's kind (optimizer groups, another layout: position only + the schedule)
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.3}], lr=0.1)
    driven = LRSchedule(0.1, lr_factor(2, 20, 0.1), opt)
    _restore_schedule(driven, state, reposition=True)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([expected, 3 * expected], rel=1e-12)
    lrs = []
    for _ in range(15):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        driven.step()
    assert lrs == pytest.approx([0.1 * lr_factor(2, 8, 0.1).extended(5, 20)(s) for s in range(5, 20)], rel=1e-12)
    # a job whose warm-up or floor changed takes its own schedule (as before this feature)
    other = LRSchedule(0.1, lr_factor(3, 20, 0.1))
    other.load_state_dict(state)
    assert other.extended_from is None and other.get_last_lr() == pytest.approx([0.1 * lr_factor(3, 20, 0.1)(5)])


def test_the_trainers_schedule_drives_its_groups_as_the_lambdalr():
    def opt():
        torch.manual_seed(0)
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2},
                                {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.6}], lr=0.2)
    a, b = opt(), opt()
    reference, ours = build_scheduler(a, 3, 10, 0.1), LRSchedule(0.2, lr_factor(3, 10, 0.1), b)
    for _ in range(12):
        assert [g["lr"] for g in b.param_groups] == pytest.approx([g["lr"] for g in a.param_groups], rel=1e-12)
        assert ours.get_last_lr() == pytest.approx(reference.get_last_lr(), rel=1e-12)
        a.step(), b.step(), reference.step(), ours.step()
    assert [g["initial_lr"] for g in b.param_groups] == [0.2, 0.6]


def _lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r}


def test_resume_with_more_steps_continues_the_lr_without_a_jump(tiny_job, tmp_path, capsys):
    recs = demo_records("train", ("text",), limit=4)
    sections = dict(train={"steps": 8, "warmup_steps": 2, "min_lr_ratio": 0.1, "lr": 1e-3, "global_batch_size": 2,
                           "microbatch_size": 2}, checkpoint={"every": 4, "keep": 0})
    Trainer.build(tiny_job(recs, **sections)).fit()
    run = tmp_path / "run"
    original = _lrs(run)  # steps 1..8 of the 8-step run
    shutil.copytree(run, tmp_path / "finished")

    sections["train"]["steps"] = 16
    assert Trainer.build(tiny_job(recs, **sections)).fit(resume=str(run / "checkpoints" / "step_000004"))["steps"] == 12
    assert "the run's length changed from 8 to 16 steps" in capsys.readouterr().out
    lrs = _lrs(run)
    assert sorted(lrs) == list(range(1, 17))
    for step in range(1, 5):
        assert lrs[step] == pytest.approx(original[step], rel=1e-9)
    # the documented formula: from step index 4 (row 5) the cosine goes on from phase 1/3 over the 12 new steps
    for step in range(5, 17):
        assert lrs[step] == pytest.approx(1e-3 * cosine(0.1, 1 / 3 + (2 / 3) * (step - 5) / 12), rel=1e-9)
    changes = [abs(lrs[s + 1] - lrs[s]) for s in range(1, 16)]
    before = [abs(original[s + 1] - original[s]) for s in range(1, 8)]
    assert max(changes[3:]) <= max(before)  # no jump after the resume (row 4 -> 5 and on)
    assert max(changes[3:]) <= max(before[2:])  # ... not even above the original cosine's steepest step
    assert changes[3] <= abs(original[5] - original[4]) * (1 + 1e-9)  # the resumed step: as the original did

    # a finished run extended: the LR stays at its floor (lr x min_lr_ratio), no re-warm-up
    sections["train"]["steps"] = 11
    sections["metrics"] = {"run_dir": str(tmp_path / "finished")}
    Trainer.build(tiny_job(recs, **sections)).fit(resume=True)
    tail = _lrs(tmp_path / "finished")
    assert [tail[s] for s in (9, 10, 11)] == pytest.approx([1e-4] * 3, rel=1e-9)
    assert tail[8] == pytest.approx(original[8], rel=1e-9)
