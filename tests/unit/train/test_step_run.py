"""The FSDP2 uniform step's agreement (plait.train.step_run) in one process: the encoder calls each branch runs per
microbatch, 0 everywhere for a branch no sample of the step uses (it then runs nowhere and keeps no gradient, as in
one process); the pipeline trainer's rule for such branches (``unused_branches``) and ``ShardedModel.drop_gradients``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from plait.data.processing import SampleMeta
from plait.parallel.fsdp import ShardedModel
from plait.planner.microbatch.routing import FeatureRouting
from plait.train.step_run import Uniform, agreed_schedule, unused_branches


class FakeSharded:
    """The one question ``agreed_schedule`` asks of the FSDP2 groups: does a module have any."""

    def __init__(self, modules: set[str]) -> None:
        self.modules = modules

    def sharded(self, module: str) -> bool:
        return module in self.modules


def step_of(encoder_inputs: list[dict[str, int] | None]) -> SimpleNamespace:
    """A step whose encoder microbatch ``i`` holds ``encoder_inputs[i]`` (branch -> encoder calls; None: no sample),
    each sample read by the LLM microbatch of its own index (no deferral)."""
    n = len(encoder_inputs)
    routing = FeatureRouting(tuple((i,) for i in range(n)), tuple((i,) for i in range(n)), {i: {} for i in range(n)})
    batches = [SimpleNamespace(modality_inputs=dict(inputs)) if inputs is not None else None
               for inputs in encoder_inputs]
    return SimpleNamespace(routing=routing, encoder_batches=batches)


def uniform(sharded: set[str]) -> Uniform:
    return Uniform(FakeSharded(sharded), ("vision", "audio", "video"), lambda b, batch: batch.modality_inputs[b])


def test_a_branch_no_microbatch_uses_runs_nowhere_and_a_used_one_runs_in_every_microbatch():
    release, calls = agreed_schedule(step_of([{"vision": 2}, None, {"vision": 1}]), uniform({"vision", "audio"}))
    assert release == [0, 1, 2]
    # vision (sharded, used in microbatches 0 and 2): its own calls, at least 1 (a dummy item) in microbatch 1;
    # audio (sharded, used nowhere): 0, no dummy; video (not sharded, a frozen encoder): only where it has items
    assert calls == [[2, 0, 0], [1, 0, 0], [1, 0, 0]]
    _, calls = agreed_schedule(step_of([{"video": 1}, {"audio": 3}]), uniform({"vision", "audio"}))
    assert calls == [[0, 1, 1], [0, 3, 0]]


def meta(*encoders: str) -> SampleMeta:
    return SampleMeta("s", "task", 10, 4, 2, tuple((e, 3) for e in encoders))


def test_unused_branches_are_the_sharded_encoders_without_an_item_in_the_global_batch():
    sharded = ShardedModel(groups={"vision": [], "audio": [], "llm": []})
    assert unused_branches(sharded, [meta("vision"), meta()]) == ["audio"]
    assert unused_branches(sharded, [meta("audio", "vision")]) == []
    assert unused_branches(sharded, [meta()]) == ["vision", "audio"]  # the LLM is never an unused branch


def test_drop_gradients_clears_only_the_named_modules_groups():
    vision, audio = nn.Linear(2, 2), nn.Linear(2, 2)
    sharded = ShardedModel(groups={"vision": [vision], "audio": [audio]})  # stand-ins for FSDPModule groups
    for p in [*vision.parameters(), *audio.parameters()]:
        p.grad = torch.zeros_like(p)
    sharded.drop_gradients(["audio"])
    assert all(p.grad is None for p in audio.parameters())
    assert all(p.grad is not None for p in vision.parameters())
