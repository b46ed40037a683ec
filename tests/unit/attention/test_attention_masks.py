"""Mask metadata -> dense mask, flex mask_mod, per-block work and key spans, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attn_cases import brute_mask, random_info
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.attention.masks import (
    MaskInfo,
    block_work,
    build_block_mask,
    build_mask_mod,
    dense_mask,
    query_chunk_spans,
    token_work,
)


def _info(docs, items, mode):
    docs = torch.tensor([docs])
    pos = torch.zeros_like(docs)
    return MaskInfo(docs, torch.tensor([items]), pos, mode)


def test_hand_worked_bidirectional_case():
    # doc 0: text, image(2 tokens), text; doc 1: text, text; one padding token
    info = _info([0, 0, 0, 0, 1, 1, -1], [-1, 7, 7, -1, -1, -1, -1], "bidirectional_items")
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],  # image token sees the later token of its image
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],  # text after the image sees it
        [0, 0, 0, 0, 1, 0, 0],  # packed document 1 sees nothing of document 0
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],  # padding sees only itself
    ], dtype=torch.bool)
    assert torch.equal(dense_mask(info)[0], expected)
    causal = MaskInfo(info.document_ids, info.item_ids, info.positions, "causal")
    expected[1, 2] = False
    assert torch.equal(dense_mask(causal)[0], expected)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 24),
       mode=st.sampled_from(["causal", "bidirectional_items"]))
def test_dense_mask_matches_brute_force(seed, n, mode):
    info = random_info(seed, 2, n, mode)
    assert torch.equal(dense_mask(info), brute_mask(info))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 20),
       mode=st.sampled_from(["causal", "bidirectional_items"]))
def test_mask_mod_matches_dense_with_and_without_query_subset(seed, n, mode):
    info = random_info(seed, 2, n, mode)
    full = brute_mask(info)
    grid = torch.arange(n)
    mod = build_mask_mod(info)
    for b in range(2):
        got = mod(torch.tensor(b), torch.tensor(0), grid[:, None], grid[None, :])
        assert torch.equal(got, full[b])
    rng = np.random.default_rng(seed)
    subset = torch.from_numpy(np.sort(rng.choice(n, size=max(1, n // 2), replace=False))).expand(2, -1)
    mod_q = build_mask_mod(info, q_global=subset)
    for b in range(2):
        qs = torch.arange(subset.shape[1])
        got = mod_q(torch.tensor(b), torch.tensor(0), qs[:, None], grid[None, :])
        assert torch.equal(got, full[b][subset[b]])
    assert torch.equal(dense_mask(info, subset), full[:, subset[0]])


def test_mask_mod_clamps_out_of_range_indices():
    info = random_info(3, 1, 10, "bidirectional_items")
    mod = build_mask_mod(info)
    got = mod(torch.tensor(0), torch.tensor(0), torch.tensor(15), torch.tensor(12))
    assert bool(got) == bool(brute_mask(info)[0, 9, 9])


def test_every_row_attends_somewhere():
    info = random_info(5, 3, 30, "causal", max_pad=10)
    assert bool(dense_mask(info).any(-1).all())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), block=st.integers(1, 9),
       mode=st.sampled_from(["causal", "bidirectional_items"]))
def test_block_work_counts_attended_pairs(seed, n, block, mode):
    info = random_info(seed, 2, n, mode)
    per_row = brute_mask(info).sum(-1).numpy()  # [B, N] pairs per query
    assert np.array_equal(token_work(info, row=1), per_row[1])
    starts = range(0, n, block)
    expected = np.array([per_row[:, s:s + block].sum() for s in starts])
    assert np.array_equal(block_work(info, block), expected)
    assert np.array_equal(block_work(info, block, row=0), [per_row[0, s:s + block].sum() for s in starts])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), chunk=st.integers(1, 12),
       mode=st.sampled_from(["causal", "bidirectional_items"]))
def test_chunk_spans_contain_every_visible_key(seed, n, chunk, mode):
    info = random_info(seed, 2, n, mode)
    full = brute_mask(info)
    spans = query_chunk_spans(info, chunk=chunk)
    assert [(s, e) for s, e, _, _ in spans] == [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    for qs, qe, ks, ke in spans:
        rows = full[:, qs:qe]
        assert not rows[:, :, :ks].any() and not rows[:, :, ke:].any()
        assert rows[:, :, ks].any() and rows[:, :, ke - 1].any()  # tight: both ends are used


def test_block_mask_matches_dense_blocks():
    info = random_info(11, 2, 50, "bidirectional_items", max_docs=4)
    block = build_block_mask(info, block_size=8)
    full = brute_mask(info)
    dense = block.to_dense()[:, 0].bool()  # [B, q_blocks, kv_blocks]: block has any visible pair
    nb = dense.shape[1]
    padded = torch.zeros(2, nb * 8, dense.shape[2] * 8, dtype=torch.bool)
    padded[:, :50, :50] = full
    any_pair = padded.view(2, nb, 8, -1, 8).any(2).any(-1)
    assert torch.equal(dense, any_pair)
    assert build_block_mask(info, block_size=8) is block  # cached for the next layer


def test_from_batch_and_validation_errors():
    docs = torch.tensor([[0, 0, 1, -1]])
    batch = {"document_ids": docs, "item_ids": torch.tensor([[-1, 0, -1, -1]]),
             "position_ids": torch.tensor([[0, 1, 0, 0]])}
    info = MaskInfo.from_batch(batch, mode="bidirectional_items")
    assert info.shape == (1, 4) and info.mode == "bidirectional_items"
    with pytest.raises(ValueError, match="lacks key"):
        MaskInfo.from_batch({"document_ids": docs})
    with pytest.raises(ValueError, match="mode"):
        MaskInfo.from_batch(batch, mode="full")
    with pytest.raises(ValueError, match="on padding"):
        MaskInfo.from_batch({**batch, "item_ids": torch.tensor([[-1, -1, -1, 3]])})
    with pytest.raises(ValueError, match="item 5 spans more than one document"):
        MaskInfo.from_batch({**batch, "item_ids": torch.tensor([[-1, 5, 5, -1]])})
    with pytest.raises(ValueError, match="item_ids has shape"):
        MaskInfo(docs, torch.zeros(1, 3, dtype=torch.long), docs, "causal")
    with pytest.raises(ValueError, match="integer"):
        MaskInfo(docs.float(), docs, docs, "causal")
    with pytest.raises(ValueError, match="q_global"):
        dense_mask(info, torch.zeros(2, 2, dtype=torch.long))


def test_from_padding_is_one_causal_document():
    info = MaskInfo.from_padding(torch.tensor([[1, 1, 1, 0]]))
    assert info.document_ids.tolist() == [[0, 0, 0, -1]] and info.positions.tolist() == [[0, 1, 2, 2]]
    plain = MaskInfo.from_padding(None, shape=(1, 3))
    assert torch.equal(dense_mask(plain)[0], torch.ones(3, 3, dtype=torch.bool).tril())
