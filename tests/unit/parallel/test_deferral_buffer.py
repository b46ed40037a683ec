"""The one deferral execution (plait.parallel.deferral): the feature buffer and the feature-gradient split, on
real values, without processes."""

from __future__ import annotations

import pytest
import torch

from plait.parallel.deferral import FeatureBuffer, split_feature_grad
from plait.planner.microbatch.routing import FeatureRouting


def test_buffer_gathers_in_placeholder_order_and_counts_held_bytes():
    # sample 0 deferred from encoder microbatch 0 to LLM microbatch 1
    routing = FeatureRouting(((0, 1), (2,)), ((1,), (0, 2)), {0: {"v": 1}, 1: {"v": 2}, 2: {"v": 1}})
    buffer = FeatureBuffer(routing)
    first = torch.arange(6.0).reshape(3, 2)  # rows: sample 0 -> row 0, sample 1 -> rows 1-2
    buffer.hold(0, {"v": first})
    assert torch.equal(buffer.gather(0)["v"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    assert buffer.release(0) == []  # encoder microbatch 0 is still read by LLM microbatch 1
    assert buffer.peak == first.numel() * 4
    buffer.hold(1, {"v": torch.tensor([[10.0, 11.0]])})
    assert torch.equal(buffer.gather(1)["v"], torch.tensor([[0.0, 1.0], [10.0, 11.0]]))
    assert buffer.release(1) == [0, 1] and not buffer.held and buffer.peak == 24
    with pytest.raises(ValueError, match="produced 2 feature rows but FeatureRouting.features gives its samples 3"):
        FeatureBuffer(routing).hold(0, {"v": torch.zeros(2, 2)})
    with pytest.raises(RuntimeError, match="reads encoder microbatch 0 of stage 0 before its forward"):
        FeatureBuffer(routing).gather(1, ["v"])


def test_split_feature_grad_places_each_samples_rows_in_its_encoder_microbatch():
    routing = FeatureRouting(((0, 1), (2,)), ((1,), (0, 2)), {0: {"v": 1}, 1: {"v": 2}, 2: {"v": 1}})
    outputs = {0: torch.zeros(3, 2, requires_grad=True), 1: torch.zeros(1, 2, requires_grad=True)}
    grad = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    pieces = split_feature_grad(routing, 1, "v", grad, outputs.__getitem__)
    assert torch.equal(pieces[0], torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(pieces[1], torch.tensor([[3.0, 3.0]]))
    with pytest.raises(RuntimeError, match="1 feature gradient rows"):
        split_feature_grad(routing, 1, "v", grad[:1], outputs.__getitem__)
