"""The pipeline trainer's directly driven LR schedule follows the LambdaLR of the same factor, and their
checkpointed positions restore into each other."""

from __future__ import annotations

import pytest
import torch

from plait.train.checkpoint import _restore_schedule
from plait.train.optim import LRSchedule, build_scheduler, lr_factor


def test_lr_schedule_follows_the_lambdalr_of_the_same_factor():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    reference = build_scheduler(opt, warmup=2, total=10, min_ratio=0.1)
    direct = LRSchedule(0.1, lr_factor(2, 10, 0.1))
    seen = []
    for _ in range(12):
        assert direct.get_last_lr() == pytest.approx(reference.get_last_lr(), rel=1e-12)
        seen.append(direct.get_last_lr()[0])
        opt.step()
        reference.step()
        direct.step()
    assert seen[:3] == pytest.approx([0.05, 0.1, 0.1]) and seen[-1] == pytest.approx(0.01)
    assert (direct.last_epoch, direct._step_count) == (reference.last_epoch, reference._step_count) == (12, 13)


def test_positions_restore_across_the_two_kinds():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    lambdalr = build_scheduler(opt, warmup=2, total=10, min_ratio=0.1)
    direct = LRSchedule(0.1, lr_factor(2, 10, 0.1))
    for _ in range(4):
        direct.step()
    _restore_schedule(lambdalr, direct.state_dict(), reposition=True)  # PP checkpoint -> single process
    assert lambdalr.last_epoch == 4 and opt.param_groups[0]["lr"] == pytest.approx(0.2 * lr_factor(2, 10, 0.1)(4))
    back = LRSchedule(0.1, lr_factor(2, 10, 0.1))
    _restore_schedule(back, lambdalr.state_dict(), reposition=True)  # and back
    assert back.last_epoch == 4 and back.get_last_lr() == pytest.approx([0.1 * lr_factor(2, 10, 0.1)(4)])
