"""Checkpoints across parallel layouts, in one process: the recorded layout, exact RNG restore with the same
layout and re-derived streams with another, the LR schedule moved between a pipeline trainer's one-group driver
and an optimizer with several groups, tied parameters' optimizer state under every name, and the errors for
checkpoints that cannot be resumed. (Real multi-process resumes: tests/distributed/test_resume_reconfigure.py.)"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from plait.train.checkpoint import (
    CheckpointLayout,
    derive_rng_seed,
    load_checkpoint,
    save_checkpoint,
    seed_rng_streams,
)
from plait.train.optim import build_scheduler
from plait.train.trainer import Trainer
from tests.helpers.jobs import TINY_LLM, demo_records

SINGLE = CheckpointLayout()
PP2 = CheckpointLayout(world_size=2, dp=1, pp=2, cp=1, plan="encoders_colocated, stages 0: vision; 1: llm")
LOADER = {"epoch": 0, "batch_in_epoch": 3, "seed": 5, "num_samples": 10, "global_batch_size": 2}


def draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_derived_rng_seed_is_the_documented_hash_and_seeds_every_generator():
    expected = int.from_bytes(hashlib.sha256(b"plait-rng/7/12/3").digest()[:8], "big") & (2**63 - 1)
    assert derive_rng_seed(7, 12, 3) == expected
    assert seed_rng_streams(7, 12, 3) == expected
    got = draws()
    torch.manual_seed(expected)
    random.seed(expected)
    np.random.seed(expected % 2**32)
    assert got == draws()
    seeds = {derive_rng_seed(s, t, r) for s in (0, 1) for t in (0, 1, 12) for r in range(4)}
    assert len(seeds) == 24 and all(0 <= v < 2**63 for v in seeds)


def test_layout_round_trips_and_describes_itself():
    assert CheckpointLayout.from_dict(PP2.to_dict()) == PP2
    assert SINGLE.describe() == "1 process (DP 1 x PP 1 x CP 1)"
    assert PP2.describe() == "2 processes (DP 1 x PP 2 x CP 1; encoders_colocated, stages 0: vision; 1: llm)"
    with pytest.raises(ValueError, match="checkpoint layout fields"):
        CheckpointLayout.from_dict({"world_size": 2})


def two_group_job(lr: float = 1e-3):
    """Two linear layers, AdamW with two LR groups (the second at 3x), the trainer's warm-up + cosine schedule
    (1 warm-up step of 10)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": lr},
                             {"params": model[1].parameters(), "lr": 3 * lr}], lr=lr)
    return model, opt, build_scheduler(opt, warmup=1, total=10, min_ratio=0.1)


def train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def factor(step: int) -> float:
    """The schedule of ``two_group_job`` by hand: cosine from 1 to 0.1 over steps 1..10."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 9))


def test_same_layout_restores_each_ranks_rng_and_another_layout_derives_it(tmp_path):
    model, opt, sched = two_group_job()
    train(model, opt, sched, 4)
    torch.manual_seed(123)
    save_checkpoint(tmp_path / "ck", model, opt, sched, LOADER, step=4, layout=SINGLE)
    expected = draws()  # what an uninterrupted run draws next

    torch.manual_seed(999)
    state = load_checkpoint(tmp_path / "ck", *two_group_job(), LOADER, layout=SINGLE, seed=5)
    assert state["rng"] == "restored" and state["layout"] == SINGLE and state["step"] == 4
    assert draws() == expected

    state = load_checkpoint(tmp_path / "ck", *two_group_job(), LOADER, layout=PP2, seed=5)
    assert state["rng"] == "derived" and state["layout"] == SINGLE
    got = draws()
    seed_rng_streams(5, 4, 0)
    assert got == draws() and got != expected


def test_schedule_and_moments_move_between_a_driver_schedule_and_optimizer_groups(tmp_path):
    model, opt, sched = two_group_job()
    train(model, opt, sched, 3)
    save_checkpoint(tmp_path / "single", model, opt, sched, LOADER, step=3, layout=SINGLE)

    # a pipeline trainer: the schedule drives a one-group placeholder; the real optimizer has no initial_lr
    pp_model, pp_opt, _ = two_group_job()
    driver = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-3)
    pp_sched = build_scheduler(driver, warmup=1, total=10, min_ratio=0.1)
    load_checkpoint(tmp_path / "single", pp_model, pp_opt, pp_sched, LOADER, layout=PP2)
    assert pp_sched.last_epoch == 3 and pp_sched.get_last_lr() == pytest.approx([1e-3 * factor(3)], rel=1e-12)
    assert driver.param_groups[0]["lr"] == pytest.approx(1e-3 * factor(3), rel=1e-12)
    for p, q in zip(model.parameters(), pp_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], pp_opt.state[q]["exp_avg_sq"])
        assert float(pp_opt.state[q]["step"]) == 3

    # ... and back to an optimizer whose groups the schedule drives: LRs from this job's base LRs at step 3
    for group in pp_opt.param_groups:
        group["lr"] = 0.5  # a pipeline trainer's groups hold the last step's LR; loading must not keep it
    save_checkpoint(tmp_path / "pp", pp_model, pp_opt, pp_sched, LOADER, step=3, layout=PP2)
    back_model, back_opt, back_sched = two_group_job()
    load_checkpoint(tmp_path / "pp", back_model, back_opt, back_sched, LOADER, layout=SINGLE)
    expected = [1e-3 * factor(3), 3e-3 * factor(3)]
    assert [g["lr"] for g in back_opt.param_groups] == pytest.approx(expected, rel=1e-12)
    assert [g["initial_lr"] for g in back_opt.param_groups] == [1e-3, 3e-3]
    assert back_sched.last_epoch == 3 and back_sched.get_last_lr() == pytest.approx(expected, rel=1e-12)


class Tied(nn.Module):
    """Input and output embeddings sharing one weight (``emb.weight`` is ``head.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_a_tied_weights_state_reaches_a_rank_that_holds_only_the_output_copy(tmp_path):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, 0, 10, 0.1)
    for _ in range(2):
        model(torch.tensor([1, 2, 3])).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    save_checkpoint(tmp_path / "ck", model, opt, sched, LOADER, step=2, layout=SINGLE)

    head_rank = nn.Module()  # a pipeline rank holding only the output embedding, under its full-model name
    head_rank.head = nn.Linear(4, 6, bias=False)
    head_opt = torch.optim.AdamW(head_rank.parameters(), lr=1e-2)
    load_checkpoint(tmp_path / "ck", head_rank, head_opt, build_scheduler(head_opt, 0, 10, 0.1), LOADER, layout=PP2)
    assert torch.equal(head_rank.head.weight, model.emb.weight)
    saved, got = opt.state[model.emb.weight], head_opt.state[head_rank.head.weight]
    assert float(got["step"]) == 2 and torch.equal(got["exp_avg"], saved["exp_avg"])
    assert torch.equal(got["exp_avg_sq"], saved["exp_avg_sq"])


# ----- what cannot be resumed (Trainer on the tiny job) -----------------------------------------------------
def test_changes_that_break_the_run_are_refused_and_the_attention_kernel_is_not(tiny_job):
    recs = demo_records("train", ("image_digit", "text"), limit=4)
    sections = dict(train={"steps": 1, "global_batch_size": 4, "microbatch_size": 2}, checkpoint={"every": 1})
    Trainer.build(tiny_job(recs, **sections)).fit()

    sections["model"] = {"llm": {"config": dict(TINY_LLM, num_hidden_layers=1), "attn_implementation": "eager"}}
    fewer_layers = Trainer.build(tiny_job(recs, **sections))  # a subset of the saved tensors: DCP alone would load it
    with pytest.raises(ValueError, match=r"\[model\] config differs .*model\.llm\.config\.num_hidden_layers: 2 -> 1"):
        fewer_layers.resume()
    del sections["model"]

    sections["train"]["global_batch_size"] = 2
    with pytest.raises(ValueError, match="train.global_batch_size was 4 when it was written, now 2; the data position"):
        Trainer.build(tiny_job(recs, **sections)).resume()
    sections["train"]["global_batch_size"] = 4

    # how attention runs, not what is trained: may change
    sections["model"] = {"llm": {"config": dict(TINY_LLM), "attn_implementation": "sdpa"}}
    assert Trainer.build(tiny_job(recs, **sections)).resume() == 1
