"""``tensor_parallel.clip_by_square_sum_`` and ``check_max_norm``: the one clipping rule of the trainers (TP,
pipeline and heterogeneous pipelines), ``torch.nn.utils.clip_grad_norm_``'s, on one process."""

from __future__ import annotations

import pytest
import torch

from plait.parallel.tensor_parallel import check_max_norm, clip_by_square_sum_, clip_grad_norm_, grad_square_sum


def test_clipping_scales_only_above_the_norm_and_returns_the_norm_before():
    grads = [torch.tensor([3.0]), torch.tensor([0.0, 4.0])]
    assert clip_by_square_sum_(grads, grad_square_sum(grads, 1), 10.0, reduce=False) == 5.0
    assert [g.tolist() for g in grads] == [[3.0], [0.0, 4.0]]  # below max_norm: untouched
    assert clip_by_square_sum_(grads, grad_square_sum(grads, 1), 1.0, reduce=False) == 5.0
    scale = 1.0 / (5.0 + 1e-6)
    assert grads[0].item() == pytest.approx(3.0 * scale) and grads[1][1].item() == pytest.approx(4.0 * scale)


def test_clip_grad_norm_matches_torch_and_refuses_a_negative_norm():
    ours = [torch.nn.Parameter(torch.arange(4.0)), torch.nn.Parameter(torch.ones(3))]
    ref = [torch.nn.Parameter(torch.arange(4.0)), torch.nn.Parameter(torch.ones(3))]
    for p in ours + ref:
        p.grad = p.detach() * 2
    assert clip_grad_norm_(ours, 0.5) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(ref, 0.5)))
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad)
    with pytest.raises(ValueError, match="max_norm must be >= 0, got -1"):
        check_max_norm(-1)
    with pytest.raises(ValueError, match="max_norm must be >= 0, got -0.5"):
        clip_grad_norm_(ours, -0.5)
