"""DeepStack additions across LLM pipeline stages (``plait.models.deepstack``): the rows a stage sends on rebuild,
bit for bit, the dense additions of the later stage's layers, on a context-parallel shard's tokens too; their
gradients reach the features; the hook adds only the layers its additions cover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.models.deepstack import (DEEPSTACK_KWARG, DeepStackFeatures, attach_deepstack_hooks, carried_rows,
                                    deepstack_extras, deepstack_mask, received_features)

HIDDEN, IMAGE, AUDIO = 4, 7, 9


def _batch():
    ids = torch.tensor([[1, 7, 7, 3, 9, 7], [7, 2, 9, 9, 7, 7]])
    image = torch.randn(int((ids == IMAGE).sum()), 4 * HIDDEN, requires_grad=True)  # k = 3 DeepStack chunks
    audio = torch.randn(int((ids == AUDIO).sum()), HIDDEN)  # a branch without DeepStack chunks
    return ids, {"vision": image, "audio": audio}


@pytest.mark.parametrize("local", [None, [0, 2, 3, 5]], ids=["all tokens", "a CP shard"])
def test_carried_rows_rebuild_the_later_layers_additions_exactly(local):
    ids, feats = _batch()
    extras = deepstack_extras(ids, feats, {"vision": IMAGE, "audio": AUDIO}, HIDDEN)
    assert extras is not None and len(extras.dense) == 3
    mask = deepstack_mask(ids, {"vision": IMAGE})
    if local is not None:  # a shard's tokens, as plait.parallel.context.shard_tokens picks them
        index = torch.tensor(local)
        extras, mask = extras.select(lambda t: t.index_select(1, index)), mask.index_select(1, index)
    rows = carried_rows(extras, mask, start=1)
    assert rows.shape == (int(mask.sum()), 2 * HIDDEN)
    later = received_features(rows, mask, HIDDEN, first=1)
    assert later.first == 1 and later.end == 3
    for mine, want in zip(later.dense, extras.dense[1:]):
        assert torch.equal(mine, want)
    # a stage after that one: the rows of layer 2 only, sliced from the received ones
    last = received_features(rows[:, HIDDEN:], mask, HIDDEN, first=2)
    assert torch.equal(last.dense[0], extras.dense[2])
    (later.dense[0].sum() + 2 * later.dense[1].sum()).backward()
    grad = feats["vision"].grad
    shard_rows = int(mask.sum())
    assert float(grad[:, :2 * HIDDEN].abs().sum()) == 0  # the merged feature and layer 0: not sent on
    assert float(grad[:, 2 * HIDDEN:3 * HIDDEN].sum()) == shard_rows * HIDDEN
    assert float(grad[:, 3 * HIDDEN:].sum()) == 2 * shard_rows * HIDDEN


def test_rows_out_of_range_or_of_the_wrong_size_are_refused():
    ids, feats = _batch()
    extras = deepstack_extras(ids, feats, {"vision": IMAGE, "audio": AUDIO}, HIDDEN)
    mask = deepstack_mask(ids, {"vision": IMAGE})
    with pytest.raises(ValueError, match="layer 3 asked of additions for layers 0..2"):
        carried_rows(extras, mask, start=3)
    with pytest.raises(ValueError, match=r"DeepStack rows \(5, 8\) for 6 visual tokens"):
        received_features(torch.zeros(5, 2 * HIDDEN), mask, HIDDEN, first=1)


class _Layer(nn.Module):
    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        return hidden


def test_hooks_add_the_layers_their_additions_cover():
    layers = nn.ModuleList([_Layer() for _ in range(3)])
    attach_deepstack_hooks(layers, 3)
    x = torch.zeros(1, 2, HIDDEN)
    extras = DeepStackFeatures((torch.ones(1, 2, HIDDEN), 2 * torch.ones(1, 2, HIDDEN)), first=1)
    outs = [float(layer(x, **{DEEPSTACK_KWARG: extras}).mean()) for layer in layers]
    assert outs == [0.0, 1.0, 2.0]
