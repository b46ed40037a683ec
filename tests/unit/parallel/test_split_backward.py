"""The split backward of zero-bubble schedules (``plait.parallel.pipeline.split_backward``): ``B`` then ``W`` give
the fused backward's input and weight gradients on stages of every shape (chains, a weight used twice, weights
combined before they meet the activations, LoRA adapters, two outputs, inputs that need no gradient), and ``W``
does not run ``B``'s part again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.parallel.pipeline.split_backward import input_gradients, weight_gradients


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls (an activation-path op: B must run it, W must not)."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        return grad


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x):
        return [self.b(Counted.apply(torch.tanh(self.a(x))))]


class Tied(nn.Module):
    """One weight used at two places of the activation path, and a weight combined with another first."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) / 3)
        self.scale, self.shift = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = torch.relu(x @ self.w)
        gain = self.scale * 2 + self.shift.exp()  # weights only, before they meet the activations
        return [Counted.apply(h * gain) @ self.w.t()]


class Lora(nn.Module):
    """A frozen base linear with trainable adapters, and two outputs."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(6, 6).requires_grad_(False)
        self.down, self.up = nn.Linear(6, 2, bias=False), nn.Linear(2, 6, bias=False)

    def forward(self, x):
        h = self.base(x) + self.up(self.down(Counted.apply(x)))
        return [h.sum(-1), torch.sigmoid(h)]


def _fused(model, x):
    model, x = copy.deepcopy(model), x.detach().clone().requires_grad_(x.requires_grad)
    outs = model(x)
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    return x.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _split(model, x):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    outs = model(x)
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outs]
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = [x] if x.requires_grad else []
    Counted.calls = 0
    found, kept = input_gradients(list(zip(outs, grads)), inputs, params)
    after_b = Counted.calls
    assert all(p.grad is None for p in params)  # B computes no weight gradient
    assert weight_gradients(kept) is True
    return (found[0] if inputs else None), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, \
        (after_b, Counted.calls - after_b)


@pytest.mark.parametrize("make, counted_after_a_weight", [(Chain, True), (Tied, True), (Lora, False)])
@pytest.mark.parametrize("input_grad", [True, False])
def test_b_then_w_equals_the_fused_backward_and_w_repeats_nothing_of_b(make, counted_after_a_weight, input_grad):
    torch.manual_seed(0)
    model, x = make(), torch.randn(3, 6, requires_grad=input_grad)
    want_x, want = _fused(model, x)
    got_x, got, (calls_b, calls_w) = _split(model, x)
    if input_grad:
        torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-7)
        assert (calls_b, calls_w) == (1, 0)  # the activation path runs in B only
    else:  # nothing to send upstream: W is the whole backward, once (LoRA's counted op then needs no backward)
        assert (calls_b, calls_w) == (0, int(counted_after_a_weight))
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_w_meets_the_weights_where_they_meet_the_activations():
    torch.manual_seed(0)
    model, x = Tied(), torch.randn(3, 6, requires_grad=True)
    outs = model(x)
    _, kept = input_gradients([(outs[0], torch.ones_like(outs[0]))], [x], list(model.parameters()))
    # w meets the activations at both matmuls; scale and shift combine with each other first, then meet them at the
    # product: three intermediates, every weight reached through them
    assert len(kept.meetings) == 3 and len(kept.params) == 3 and kept.rest == []
    assert all(m.grads is not None for m in kept.meetings)
