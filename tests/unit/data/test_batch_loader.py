"""GlobalBatchLoader: every sample once per epoch, deterministic order, exact resume."""

from __future__ import annotations

import pytest

from plait.data.loader import GlobalBatchLoader, rank_share


def test_each_epoch_visits_every_sample_once_with_a_short_last_batch():
    loader = GlobalBatchLoader(10, 4, seed=3)
    assert loader.batches_per_epoch == 3
    epoch0 = [loader.next_batch() for _ in range(3)]
    assert [len(b) for b in epoch0] == [4, 4, 2]
    assert sorted(i for b in epoch0 for i in b) == list(range(10))
    assert loader.epoch == 1 and loader.batch_in_epoch == 0
    epoch1 = [loader.next_batch() for _ in range(3)]
    assert sorted(i for b in epoch1 for i in b) == list(range(10))
    assert epoch0 != epoch1  # a fresh permutation per epoch


def test_order_depends_only_on_seed_and_epoch_and_resumes_exactly():
    a, b = GlobalBatchLoader(50, 8, seed=1), GlobalBatchLoader(50, 8, seed=1)
    first = [a.next_batch() for _ in range(9)]  # into the second epoch (7 batches per epoch)
    state = a.state_dict()
    rest = [a.next_batch() for _ in range(5)]
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(5)] == rest
    assert GlobalBatchLoader(50, 8, seed=2).next_batch() != first[0]
    with pytest.raises(ValueError, match="global_batch_size was 8 in the checkpoint, now 4"):
        GlobalBatchLoader(50, 4, seed=1).load_state_dict(state)


def test_no_shuffle_keeps_file_order_and_rank_share_is_a_partition():
    loader = GlobalBatchLoader(6, 6, shuffle=False)
    batch = loader.next_batch()
    assert batch == [0, 1, 2, 3, 4, 5]
    shares = [rank_share(batch, r, 4) for r in range(4)]
    assert shares == [[0, 4], [1, 5], [2], [3]]
    with pytest.raises(ValueError):
        GlobalBatchLoader(0, 4)
