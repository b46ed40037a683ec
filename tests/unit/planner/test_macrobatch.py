"""Tests of plait.planner.microbatch.macrobatch: a hand-worked 4-sample dataset, the loader's batch order, the
finite-population CV formula against brute-force enumeration, the CV shrinking with the batch size on a
random mixture, JSON round trips and bad input."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import numpy as np
import pytest

from plait.data.loader import GlobalBatchLoader
from plait.planner.microbatch.macrobatch import cv_by_batch_size, draw_batches, macrobatch_stats, predicted_batch_cv
from plait.planner.microbatch.types import CvScaling, MacrobatchStats
from plait.planner.microbatch import ModuleCostCoeffs

# vision: frozen, 1 unit of work per encoder token; llm: trainable (forward + dX + dW = 3x), 1 per token.
COEFFS = {"vision": ModuleCostCoeffs(linear=1.0), "llm": ModuleCostCoeffs(linear=1.0, trainable=True)}
# (text_tokens, vision placeholders per item) -> vision work = sum of items, llm work = 3 * (text + items)
HAND = [(10, (20,)), (5, ()), (1, (3, 6)), (15, ())]
HAND_VISION = [20.0, 0.0, 9.0, 0.0]
HAND_LLM = [90.0, 15.0, 30.0, 45.0]


def hand_metas() -> list[dict]:
    return [
        {"text_tokens": t, "items": [("vision", p) for p in items], "length": t + sum(items)}
        for t, items in HAND
    ]


def cv(values) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


# ------------------------------------------------------------ hand-worked case


def test_hand_case_per_sample_statistics() -> None:
    stats = macrobatch_stats(hand_metas(), 4, 3, COEFFS, seed=0, sampling="independent")
    assert stats.modules == ("vision", "llm")
    assert stats.num_samples == 4 and stats.num_batches == 3
    assert stats.usage == (0.5, 1.0)
    assert stats.sample_mean == pytest.approx((7.25, 45.0))
    assert stats.sample_cv == pytest.approx((cv(HAND_VISION), cv(HAND_LLM)))
    assert stats.sample_min == (0.0, 15.0) and stats.sample_max == (20.0, 90.0)
    # B = N: every batch is the whole dataset, so every total is the dataset total and nothing varies.
    assert stats.expected == pytest.approx((29.0, 180.0))
    assert stats.batch_mean == pytest.approx((29.0, 180.0))
    assert stats.batch_min == pytest.approx((29.0, 180.0)) and stats.batch_max == pytest.approx((29.0, 180.0))
    assert stats.batch_cv == pytest.approx((0.0, 0.0), abs=1e-12)
    assert stats.predicted_cv == (0.0, 0.0)


def test_hand_case_loader_batches() -> None:
    seed = 7
    loader = GlobalBatchLoader(4, 2, seed=seed)
    batches = [loader.next_batch() for _ in range(4)]  # two epochs of two full batches
    vision = [sum(HAND_VISION[i] for i in b) for b in batches]
    llm = [sum(HAND_LLM[i] for i in b) for b in batches]
    stats = macrobatch_stats(hand_metas(), 2, 4, COEFFS, seed=seed, sampling="loader",
                             epoch_order=GlobalBatchLoader(4, 2, seed=seed).epoch_order)
    assert stats.batch_mean == pytest.approx((statistics.fmean(vision), statistics.fmean(llm)))
    assert stats.batch_mean == pytest.approx((14.5, 90.0))  # whole epochs: each sample counted equally
    assert stats.expected == pytest.approx((14.5, 90.0))
    assert stats.batch_cv == pytest.approx((cv(vision), cv(llm)))
    assert stats.batch_min == (min(vision), min(llm)) and stats.batch_max == (max(vision), max(llm))
    c = cv(HAND_VISION)
    assert stats.predicted_cv[0] == pytest.approx(c / math.sqrt(2) * math.sqrt(2 / 3))


def test_loader_sampling_matches_global_batch_loader_without_partial_batches() -> None:
    loader = GlobalBatchLoader(10, 4, seed=3)
    seen = [loader.next_batch() for _ in range(9)]  # three epochs: 4 + 4 + 2 samples each
    full = [b for b in seen if len(b) == 4]
    assert len(full) == 6
    drawn = draw_batches(10, 4, 5, seed=3, sampling="loader", epoch_order=GlobalBatchLoader(10, 4, seed=3).epoch_order)
    assert drawn.tolist() == full[:5]


def test_independent_sampling_is_seeded_and_without_replacement() -> None:
    a = draw_batches(50, 20, 30, seed=1, sampling="independent")
    assert a.shape == (30, 20)
    assert all(len(set(row)) == 20 and min(row) >= 0 and max(row) < 50 for row in a.tolist())
    assert np.array_equal(a, draw_batches(50, 20, 30, seed=1, sampling="independent"))
    assert not np.array_equal(a, draw_batches(50, 20, 30, seed=2, sampling="independent"))


# ------------------------------------------------------------ the 1/sqrt(B) law


def test_predicted_cv_matches_enumeration_of_all_batches() -> None:
    values = [3.0, 0.0, 11.0, 4.0, 0.0, 7.0]
    n = len(values)
    for b in range(1, n + 1):
        totals = [sum(c) for c in itertools.combinations(values, b)]  # all equally likely without replacement
        assert predicted_batch_cv(cv(values), b, n) == pytest.approx(cv(totals), abs=1e-12)
    assert predicted_batch_cv(0.8, 1, 1) == 0.0
    assert predicted_batch_cv(1.0, 4, 9) == pytest.approx(0.5 * math.sqrt(5 / 8))


def random_metas(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """A mixture and its work per sample, computed here: vision sum of items (frozen, linear 1, quadratic
    1e-3 on 4 encoder tokens per placeholder), llm 3 * tokens."""
    rng = np.random.default_rng(seed)
    metas, work = [], []
    for _ in range(n):
        text = int(rng.integers(1, 400))
        items = [("vision", int(rng.integers(16, 600)))] if rng.random() < 0.5 else []
        metas.append({"text_tokens": text, "items": items})
        vision = sum(4 * p + 1e-3 * (4 * p) ** 2 for _, p in items)
        work.append((vision, 3.0 * (text + sum(p for _, p in items))))
    return metas, np.array(work)


def test_cv_shrinks_with_batch_size_as_predicted() -> None:
    metas, work = random_metas(3000, seed=5)
    coeffs = {
        "vision": ModuleCostCoeffs(linear=1.0, quadratic=1e-3, encoder_tokens_per_feature=4.0),
        "llm": ModuleCostCoeffs(linear=1.0, trainable=True),
    }
    scaling = cv_by_batch_size(metas, coeffs, (256, 1, 64, 8), num_batches=600, seed=0, sampling="independent")
    assert scaling.batch_sizes == (1, 8, 64, 256)
    for k in range(2):
        sample_cv = cv(work[:, k].tolist())
        measured = [row[k] for row in scaling.cv]
        assert all(a > b for a, b in zip(measured, measured[1:])), measured
        for b, m in zip(scaling.batch_sizes, measured):
            expected = sample_cv / math.sqrt(b) * math.sqrt((3000 - b) / 2999)
            assert m == pytest.approx(expected, rel=0.1)
        assert measured[0] / measured[-1] > 10  # sqrt(256) = 16 times a finite-population correction
    big = macrobatch_stats(metas, 256, 200, coeffs, seed=0, sampling="loader",
                           epoch_order=GlobalBatchLoader(3000, 256, seed=0).epoch_order)
    assert big.expected == pytest.approx(tuple(256 * work.mean(axis=0)))
    assert big.batch_mean == pytest.approx(big.expected, rel=0.02)


# ------------------------------------------------------------ serialisation and output


def test_json_round_trip_and_table() -> None:
    metas, _ = random_metas(300, seed=2)
    order = GlobalBatchLoader(300, 32, seed=4).epoch_order  # the loader's order does not depend on the batch size
    stats = macrobatch_stats(metas, 32, 20, COEFFS, seed=4, epoch_order=order)
    assert MacrobatchStats.from_dict(json.loads(json.dumps(stats.to_dict()))) == stats
    scaling = cv_by_batch_size(metas, COEFFS, (1, 8, 32), num_batches=20, seed=4, epoch_order=order)
    assert CvScaling.from_dict(json.loads(json.dumps(scaling.to_dict()))) == scaling
    table = stats.format_table("FLOPs").splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("vision") and table[3].startswith("llm")
    assert f"{stats.expected[1]:.4g}" in table[3]
    assert len(scaling.format_table().splitlines()) == 2 + 3
    with pytest.raises(ValueError, match="unknown field"):
        MacrobatchStats.from_dict({**stats.to_dict(), "extra": 1})


# ------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"global_batch_size": 5}, "global_batch_size 5 exceeds the 4 samples"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1"),
        ({"num_batches": 0}, "num_batches must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"sampling": "shuffled"}, "sampling must be one of"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    args = {"global_batch_size": 2, "num_batches": 2, "seed": 0, "sampling": "loader", **kwargs}
    with pytest.raises(ValueError, match=match):
        macrobatch_stats(hand_metas(), args.pop("global_batch_size"), args.pop("num_batches"), COEFFS, **args)


def test_bad_metadata_and_sizes() -> None:
    with pytest.raises(ValueError, match="metas is empty"):
        macrobatch_stats([], 1, 1, COEFFS)
    with pytest.raises(ValueError, match="encoder 'audio' has no cost coefficients"):
        macrobatch_stats([{"text_tokens": 3, "items": [("audio", 4)]}], 1, 1, COEFFS)
    with pytest.raises(ValueError, match="batch_sizes entry must be an integer >= 1"):
        cv_by_batch_size(hand_metas(), COEFFS, (0, 2))
    with pytest.raises(ValueError, match="global_batch_size 8 exceeds"):
        cv_by_batch_size(hand_metas(), COEFFS, (2, 8))
    with pytest.raises(ValueError, match="batch_size <= num_samples"):
        predicted_batch_cv(0.5, 3, 2)


def test_loader_order_is_passed_in_and_checked() -> None:
    with pytest.raises(ValueError, match="sampling='loader' needs epoch_order"):
        draw_batches(4, 2, 1, sampling="loader")
    with pytest.raises(ValueError, match=r"epoch_order\(0\) is not a permutation of the 4 sample indices"):
        draw_batches(4, 2, 1, sampling="loader", epoch_order=lambda epoch: [0, 1, 1, 3])
    # epoch e: the samples rotated by e; full batches only (N = 5, B = 2: two per epoch, the fifth sample left out)
    drawn = draw_batches(5, 2, 3, sampling="loader", epoch_order=lambda e: [(i + e) % 5 for i in range(5)])
    assert drawn.tolist() == [[0, 1], [2, 3], [1, 2]]


def test_expected_shapes_are_the_mean_sample_per_microbatch() -> None:
    from types import SimpleNamespace

    from plait.planner.cost.arch import EncoderArch
    from plait.planner.microbatch.macrobatch import expected_shapes

    metas = [SimpleNamespace(length=10, items=[("vision", 4), ("audio", 3)]), SimpleNamespace(length=20, items=[])]
    vision = EncoderArch("vision", hidden=8, layers=1, heads=1, head_dim=8, intermediate=16, prefix_tokens=1)
    audio = EncoderArch("audio", hidden=8, layers=1, heads=1, head_dim=8, intermediate=16, item_len=12)
    configs = {"vision": vision, "audio": audio, "llm": object()}
    shapes = expected_shapes(metas, configs, {"vision": 1, "audio": 0}, microbatch_size=4)
    # vision: one item of 4 features + 1 dropped prefix token = 5 tokens over 2 samples -> 4 * 5 / 2 = 10 tokens,
    # 4 * 25 / 2 = 50 attended pairs, items of 5 tokens
    assert (shapes["vision"].tokens, shapes["vision"].seq_len, shapes["vision"].attended_pairs) == (10, 5, 50.0)
    # audio: a Whisper-style clip always fills its window of 12 frames, whatever its feature count
    assert (shapes["audio"].tokens, shapes["audio"].seq_len, shapes["audio"].attended_pairs) == (24, 12, 288.0)
    # llm: (10 + 20) / 2 * 4 = 60 tokens; pairs 4 / 2 * (55 + 210) = 530
    assert (shapes["llm"].tokens, shapes["llm"].seq_len, shapes["llm"].attended_pairs) == (60, 15, 530.0)
    with pytest.raises(ValueError, match="item of unknown encoder 'audio'"):
        expected_shapes([SimpleNamespace(length=3, items=[("audio", 2)])], {"llm": object()}, {}, 1)
