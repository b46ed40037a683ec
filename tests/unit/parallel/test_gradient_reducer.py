"""``data_parallel.GradientReducer`` in one process (a 1-rank gloo group, so a sum is the rank's own gradient):
buckets in backward order with the early parameters first, early buckets started from the armed backward's
post-accumulate-grad hooks, the others in ``finish``, flags keeping ``grad=None`` for unused parameters, and a
misuse (a gradient accumulated after its bucket started) refused."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.data_parallel import GradientReducer, sum_gradients
from tests.distributed.spawning import free_port


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net() -> tuple[nn.Module, nn.Module, nn.Parameter]:
    torch.manual_seed(0)
    encoder, llm = nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    return encoder, llm, nn.Parameter(torch.ones(2))  # the last one never used


def test_llm_buckets_start_during_the_armed_backward_and_sums_keep_none(one_rank):
    encoder, llm, unused = _net()
    params = [*encoder.parameters(), *llm.parameters(), unused]
    reducer = GradientReducer(params, bucket_elements=12, early=list(llm.parameters()))
    names = {id(p): n for n, p in [*(("enc." + n, p) for n, p in encoder.named_parameters()),
                                   *(("llm." + n, p) for n, p in llm.named_parameters()), ("unused", unused)]}
    order = [[names[id(p)] for p in b] for b in reducer.buckets]
    assert order == [["llm.1.bias", "llm.1.weight"], ["llm.0.bias"], ["llm.0.weight"],  # 2 + 10 | 5 | 20 elements
                     ["unused", "enc.bias"], ["enc.weight"]]
    x = torch.randn(6, 3)
    features = encoder(x)
    leaf = features.detach().requires_grad_()
    loss = llm(leaf).square().sum()
    reducer.arm()
    loss.backward()
    assert len(reducer._started) == 3  # every LLM bucket started inside the backward, before the encoder's
    features.backward(leaf.grad)  # the deferred encoder backward
    expected = {n: p.grad.clone() for n, p in [*encoder.named_parameters(), *llm.named_parameters()]}
    reducer.finish()
    assert reducer.started_early == 3 and unused.grad is None
    for n, p in [*encoder.named_parameters(), *llm.named_parameters()]:
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0)
    loss = llm(encoder(x)).sum()  # not armed: nothing starts in the backward
    loss.backward()
    assert reducer._started == []
    reducer.finish()
    assert reducer.started_early == 0
    reducer.close()


def test_a_gradient_after_its_bucket_started_is_refused(one_rank):
    _, llm, _ = _net()
    reducer = GradientReducer(list(llm.parameters()), early=list(llm.parameters()))
    reducer.arm()
    llm(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="after its all-reduce started"):
        llm(torch.randn(2, 4)).sum().backward()  # a second backward reaching the LLM after arm(): a misuse
    reducer.finish()
    reducer.close()
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    p.grad = torch.full((3,), 2.0)
    sum_gradients([p, q])  # one rank: the sum is its own gradient; q, unused everywhere, keeps none
    assert p.grad.tolist() == [2.0, 2.0, 2.0] and q.grad is None


def test_views_mode_accumulates_into_the_buckets_and_sums_like_the_copying_mode(one_rank):
    encoder, llm, unused = _net()
    params = [*encoder.parameters(), *llm.parameters(), unused]
    x = torch.randn(6, 3)

    def step(reducer: GradientReducer) -> dict[str, torch.Tensor]:
        reducer.prepare()
        for k in range(2):  # two microbatches: the second accumulates into the first's gradients
            features = encoder(x[3 * k:3 * k + 3])
            leaf = features.detach().requires_grad_()
            if k == 1:
                reducer.arm()
            llm(leaf).square().sum().backward()
            features.backward(leaf.grad)
        reducer.finish()
        grads = {n: None if p.grad is None else p.grad.clone()
                 for n, p in [*encoder.named_parameters(), *llm.named_parameters(), ("unused", unused)]}
        return grads

    copying = GradientReducer(params, bucket_elements=12, early=list(llm.parameters()))
    expected = step(copying)
    copying.close()
    for p in params:
        p.grad = None
    viewing = GradientReducer(params, bucket_elements=12, early=list(llm.parameters()), views=True)
    got = step(viewing)
    assert got["unused"] is None and expected["unused"] is None and viewing.started_early == 3
    for n, g in expected.items():
        if g is not None:
            torch.testing.assert_close(got[n], g, rtol=0, atol=0)
    buffers = {f.untyped_storage().data_ptr() for f in viewing._flat}
    assert all(p.grad.untyped_storage().data_ptr() in buffers for p in params if p.grad is not None)
    before = {id(p): p.grad.clone() for p in params if p.grad is not None}
    llm(encoder(x)).sum().backward()  # a second step without zeroing: prepare() copies, and the sums accumulate
    added = {id(p): p.grad - before[id(p)] for p in params if p.grad is not None}
    viewing.prepare()
    assert not viewing._viewed
    viewing.finish()
    for p in params:
        if p.grad is not None:
            torch.testing.assert_close(p.grad, before[id(p)] + added[id(p)], rtol=0, atol=0)
    for p in params:
        p.grad = None
    viewing.prepare()  # after zero_grad(set_to_none): views again, zeroed
    assert viewing._viewed and all(float(p.grad.abs().sum()) == 0 for p in params)
    viewing.finish()
    assert all(p.grad is None for p in params)  # nothing accumulated anywhere: no gradient
    viewing.close()
