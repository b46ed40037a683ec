"""Rows of replicated encoder stages: each replica's cost-balanced slice of a branch's items, a field that is not per
item refused naming it, and the replicas' features joined in item order with their gradients split back."""

from __future__ import annotations

import pytest
import torch

from plait.parallel.encoder_rows import merge_replica_features, replica_inputs


def _images(*sizes):
    return {"pixel_values": [torch.zeros(3, h, w) for h, w in sizes], "image_grid_thw": [(1, h, w) for h, w in sizes]}


def test_replica_slices_balance_item_sizes():
    inputs = _images((32, 32), (16, 16), (16, 16), (16, 16), (16, 16))
    first, second = (replica_inputs(inputs, "vision", k, 2) for k in (0, 1))
    assert [tuple(t.shape[1:]) for t in first["pixel_values"]] == [(32, 32)]  # 1024 px vs 4 x 256
    assert len(second["pixel_values"]) == 4 and second["image_grid_thw"] == [(1, 16, 16)] * 4
    audio = {"input_features": torch.arange(12.0).reshape(3, 2, 2), "num_samples": torch.tensor([5, 6, 7])}
    parts = [replica_inputs(audio, "audio", k, 2) for k in (0, 1)]
    assert torch.equal(torch.cat([p["num_samples"] for p in parts]), audio["num_samples"])
    assert replica_inputs(audio, "audio", 0, 1) is audio and replica_inputs(None, "audio", 1, 2) is None


def test_fewer_items_than_replicas_leave_a_replica_empty():
    inputs = _images((16, 16))
    assert len(replica_inputs(inputs, "vision", 0, 2)["pixel_values"]) == 1
    assert replica_inputs(inputs, "vision", 1, 2) is None


def test_a_field_not_per_item_is_refused_naming_it():
    inputs = {"pixel_values": [torch.zeros(3, 4, 4)] * 2, "fps": 2.0}
    with pytest.raises(ValueError, match="encoder 'vision' runs on 2 replicas, but its input field 'fps' is not one "
                                         r"entry per item \(2 items\)"):
        replica_inputs(inputs, "vision", 0, 2)


def test_features_join_in_replica_order_and_gradients_split_back():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    llm = torch.randn(1, 5, 4)
    merged = merge_replica_features([{"vision": [a]}, {"vision": [b]}, {"vision": []}, {"audio": []}, {"llm": [llm]}])
    assert set(merged) == {"vision", "audio", "llm"} and merged["audio"] == [] and merged["llm"][0] is llm
    (features,) = merged["vision"]
    assert torch.equal(features, torch.cat([a, b]))
    weights = torch.arange(20.0).reshape(5, 4)
    (features * weights).sum().backward()
    assert torch.equal(a.grad, weights[:3]) and torch.equal(b.grad, weights[3:])
    assert merge_replica_features([{"vision": []}, {"vision": [b]}])["vision"][0] is b
