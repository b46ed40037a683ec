"""Weighted mixtures of data sources (issue 13, item 3): realised fractions within 1% of the weights over an
epoch, deterministic per (seed, epoch), even mixing within batches, exact resume, and the [[data.sources]]
config with errors naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plait.config.loader import config_from_dict, validate
from plait.config.schema import DATA_FORMATS
from plait.data.formats import FORMATS
from plait.data.formats import open_source
from plait.data.mixture import MixtureBatchLoader, batch_sources, mixture_counts, mixture_order, source_counts
from plait.data.loader import GlobalBatchLoader
from tests.helpers.jobs import tiny_config_dict, write_jsonl
from tests.helpers.mixture import mixture_job

SIZES = (1000, 300, 5000)
WEIGHTS = (0.5, 0.3, 0.2)


def test_counts_are_the_largest_remainder_shares():
    assert mixture_counts((0.5, 0.3, 0.2), 6300) == (3150, 1890, 1260)
    assert mixture_counts((1, 1, 1), 10) == (4, 3, 3)  # the remainder goes to the earlier source on a tie
    assert mixture_counts((2, 1), 7) == (5, 2)  # 4.67, 2.33
    assert sum(mixture_counts((0.123, 0.456, 0.421), 999)) == 999


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_realised_fractions_are_within_one_percent_of_the_weights(seed):
    order = mixture_order(SIZES, WEIGHTS, seed, epoch=0)
    assert len(order) == sum(SIZES) == 6300
    fractions = np.array(source_counts(order, SIZES)) / len(order)
    assert np.abs(fractions - np.array(WEIGHTS)).max() < 0.01
    assert source_counts(order, SIZES) == [3150, 1890, 1260]
    # every global batch of 64 holds each source within 2 samples of its share
    for start in range(0, len(order) - 64, 64):
        counts = np.array(source_counts(order[start:start + 64], SIZES))
        assert np.abs(counts - 64 * np.array(WEIGHTS)).max() <= 2


def test_samples_are_drawn_without_replacement_before_repeating():
    order = mixture_order(SIZES, WEIGHTS, 3, epoch=0)
    small = np.bincount(order[(order >= 1000) & (order < 1300)] - 1000, minlength=300)  # 1890 draws of 300 records
    assert small.min() == 6 and small.max() == 7 and small.sum() == 1890
    big = np.bincount(order[order >= 1300] - 1300, minlength=5000)  # 1260 draws of 5000 records
    assert big.max() == 1 and big.sum() == 1260
    assert order.min() >= 0 and order.max() < sum(SIZES)


def test_the_order_is_a_function_of_seed_and_epoch():
    a = mixture_order(SIZES, WEIGHTS, 7, 2)
    assert np.array_equal(a, mixture_order(SIZES, WEIGHTS, 7, 2))
    assert np.array_equal(a, mixture_order(list(SIZES), list(WEIGHTS), 7, 2, epoch_samples=6300))
    assert np.mean(a == mixture_order(SIZES, WEIGHTS, 8, 2)) < 0.01
    assert np.mean(a == mixture_order(SIZES, WEIGHTS, 7, 3)) < 0.01
    assert sorted(source_counts(mixture_order(SIZES, WEIGHTS, 7, 3), SIZES)) == sorted(source_counts(a, SIZES))


def test_epoch_samples_and_file_order():
    order = mixture_order((4, 2), (1, 1), 0, 0, epoch_samples=6, shuffle=False)
    assert order.tolist() == [0, 4, 1, 5, 2, 4]
    assert mixture_order((4, 2), (3, 1), 0, 0, epoch_samples=8, shuffle=False).tolist() == [0, 1, 4, 2, 3, 0, 5, 1]


@pytest.mark.parametrize("sizes, weights, error", [
    ((3, 0), (1, 1), "source 1 has 0 usable samples; a mixture source needs at least one"),
    ((3, 2), (1, 0), "source 1 has weight 0; weights must be positive and finite"),
    ((3, 2), (1,), "a mixture needs one weight per source, got 2 sizes and 1 weights"),
])
def test_bad_mixtures_are_refused(sizes, weights, error):
    with pytest.raises(ValueError, match=f"^{error}$"):
        mixture_order(sizes, weights, 0, 0)


def test_the_loader_resumes_mid_epoch_exactly():
    def loader():
        return MixtureBatchLoader((40, 7, 13), (0.6, 0.3, 0.1), 8, seed=5, epoch_samples=50, names=("a", "b", "c"))

    full = loader()
    batches = [full.next_batch() for _ in range(15)]  # 7 batches per epoch: crosses two epoch ends
    assert sum(len(b) for b in batches[:7]) == 50 and len(batches[6]) == 2
    assert [i for b in batches[:7] for i in b] == mixture_order((40, 7, 13), (0.6, 0.3, 0.1), 5, 0, 50).tolist()
    first = loader()
    for _ in range(9):
        first.next_batch()
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batch_in_epoch"] == 2
    second = loader()
    second.load_state_dict(state)
    assert [second.next_batch() for _ in range(6)] == batches[9:]
    assert batch_sources(second, batches[0]) == {"sources": dict(zip("abc", source_counts(batches[0], (40, 7, 13))))}
    assert sum(batch_sources(second, batches[0])["sources"].values()) == 8
    assert batch_sources(GlobalBatchLoader(10, 2), [0, 1]) == {}


def test_a_resume_with_another_mixture_is_refused():
    state = MixtureBatchLoader((40, 7), (1, 1), 8, seed=5).state_dict()
    with pytest.raises(ValueError, match=r"cannot resume: the mixture's weights were \[1.0, 1.0\] in the checkpoint, "
                                         r"now \[2.0, 1.0\]"):
        MixtureBatchLoader((40, 7), (2, 1), 8, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match=r"cannot resume: the mixture's sizes were \[40, 7\] in the checkpoint"):
        MixtureBatchLoader((41, 6), (1, 1), 8, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="the checkpoint was written without a data mixture"):
        MixtureBatchLoader((40, 7), (1, 1), 8, seed=5).load_state_dict(GlobalBatchLoader(47, 8, 5).state_dict())


def source_files(tmp_path) -> tuple[Path, Path]:
    """Two sources in different folders: 5 demo records as JSONL in a/, 3 as LLaVA JSON in b/ (relative media)."""
    import json
    import shutil

    from tests.helpers.jobs import DEMO

    recs = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    image_recs = [r for r in recs if r["images"]][:3]
    recs = [r for r in recs if not r["audios"]]
    for folder in ("a", "b"):
        (tmp_path / folder / "img").mkdir(parents=True)
        for r in recs[:5] + image_recs:
            for p in r["images"]:
                shutil.copy(DEMO / p, tmp_path / folder / p)
    a = write_jsonl(tmp_path / "a" / "x.jsonl", recs[:5])
    b = tmp_path / "b" / "y.json"
    b.write_text(json.dumps([{"id": r["id"], "image": r["images"][0], "conversations": [
        {"from": "human", "value": r["messages"][0]["content"]}, {"from": "gpt", "value": r["messages"][1]["content"]}]}
        for r in image_recs]))
    return a, b


def test_a_mixture_source_numbers_rows_globally_and_tags_records(tmp_path):
    from plait.data.mixture import MixtureSource
    from plait.data.sources import sample_at

    a, b = source_files(tmp_path)
    sa, sb = open_source(a), open_source(b, name="llava")
    mix = MixtureSource([sa, sb])
    assert len(mix) == 8 and mix.sizes == (5, 3) and mix.names == ("x", "llava")
    assert [mix.source_of(i) for i in range(len(mix))] == [0] * 5 + [1] * 3
    for i in range(len(mix)):
        src, local = (sa, i) if i < len(sa) else (sb, i - len(sa))
        own, mixed = sample_at(src, local), sample_at(mix, i)
        assert mixed.id == f"{src.name}/{own.id}" and mixed.task == f"{src.name}/{own.task}"
        assert mixed.messages == own.messages and mixed.media == own.media and mixed.source == own.source
    assert sample_at(mix, len(mix) - 1).media["image"][0].startswith(str(tmp_path / "b" / "img"))
    assert mix.identity() == {"format": "mixture", "sources": [{"name": "x", **sa.identity()},
                                                                {"name": "llava", **sb.identity()}]}
    with pytest.raises(IndexError):
        mix.source_of(len(mix))
    with pytest.raises(ValueError, match="a mixture needs sources of distinct names, got \\['x', 'x'\\]"):
        MixtureSource([sa, open_source(a)])


def test_mixture_sources_from_the_config_and_the_batch_loader(tmp_path):
    from types import SimpleNamespace

    from plait.data.mixture import build_batch_loader, mixture_sources

    a, b = source_files(tmp_path)
    cfg = config_from_dict(job(sources=[{"path": str(a), "weight": 3, "val": str(a)},
                                        {"path": str(b), "weight": 1, "name": "llava"}]))
    train, val = mixture_sources(cfg.data)
    assert train.names == ("x", "llava") and val.names == ("x",) and len(val) == 5 and len(train) == 8
    rows = np.array([0, 2, 3, 6, 7])  # usable rows: 3 of x, 2 of llava
    loader = build_batch_loader(cfg, SimpleNamespace(source=train, table=SimpleNamespace(rows=rows)))
    assert isinstance(loader, MixtureBatchLoader) and loader.sizes == (3, 2) and loader.weights == (3.0, 1.0)
    assert loader.num_samples == 5 and loader.names == ("x", "llava")
    assert source_counts(loader.epoch_order(0).tolist(), (3, 2)) == [4, 1]
    with pytest.raises(ValueError, match=r"^data.sources\[1\] \(llava\) has no usable sample \(of 3 records\)$"):
        build_batch_loader(cfg, SimpleNamespace(source=train, table=SimpleNamespace(rows=rows[:3])))
    plain = build_batch_loader(config_from_dict(job(train=str(a))), list(range(7)))
    assert type(plain) is GlobalBatchLoader and plain.num_samples == 7


# --- config ----------------------------------------------------------------------------------------------------

def job(**data) -> dict:
    d = tiny_config_dict("")
    d["data"].update(data)
    return d


def test_sources_in_the_job_file(tmp_path):
    from plait.config.loader import load_config

    path = tmp_path / "job.toml"
    path.write_text('[model.llm]\npath = "llm"\n\n[data]\ntokenizer = "tok"\nepoch_samples = 100\n\n'
                    '[[data.sources]]\npath = "a.jsonl"\nweight = 3\n\n'
                    '[[data.sources]]\npath = "b.data"\nweight = 0.5\nformat = "parquet"\nname = "bee"\n'
                    'val = "bv.parquet"\n')
    cfg = load_config(path)
    a, b = cfg.data.sources
    assert (a.path, a.weight, a.format, a.name, a.val) == ("a.jsonl", 3.0, "", "", None)
    assert (b.path, b.weight, b.format, b.name, b.val) == ("b.data", 0.5, "parquet", "bee", "bv.parquet")
    assert cfg.data.epoch_samples == 100 and cfg.data.train == ""


@pytest.mark.parametrize("data, error", [
    ({"sources": [{"path": "a.jsonl", "weight": 0}]}, "data.sources[0].weight must be positive and finite, got 0.0"),
    ({"sources": [{"path": "a.jsonl"}, {"path": "x/a.parquet"}]},
     "data.sources[1].name 'a' is already the name of data.sources[0]; give each source a unique 'name'"),
    ({"sources": [{"path": "a.jsonl", "format": "csv"}]},
     "data.sources[0].format must be one of jsonl, llava, parquet, arrow (or empty: from the extension), got 'csv'"),
    ({"sources": [{"path": ""}]}, "data.sources[0].path must name a data file"),
    ({"sources": [{"path": "a.jsonl"}], "train": "t.jsonl"},
     "give data.train or [[data.sources]], not both (data.train = 't.jsonl')"),
    ({"sources": [{"path": "a.jsonl"}], "val": "v.jsonl"},
     "data.val with [[data.sources]]: give each source's validation file as its 'val'"),
    ({"train": "t.jsonl", "epoch_samples": 10}, "data.epoch_samples is the epoch length of a mixture: it needs "
                                                "[[data.sources]]"),
])
def test_bad_sources_are_refused_naming_the_field(data, error):
    with pytest.raises(ValueError) as info:
        validate(config_from_dict(job(**data)))
    assert str(info.value) == error


@pytest.mark.parametrize("sources, error", [
    ([{"path": "a", "wieght": 1}], "unknown config key(s) ['data.sources[0].wieght'] (did you mean "
                                   "data.sources[0].weight?); known: ['format', 'name', 'path', 'val', 'weight']"),
    ([{"path": "a", "weight": "x"}], "data.sources[0].weight: expected float, got 'x'"),
    ({"path": "a"}, "data.sources: expected a list, got {'path': 'a'}"),
])
def test_mistyped_sources_are_refused_naming_the_field(sources, error):
    with pytest.raises(ValueError) as info:
        config_from_dict(job(sources=sources))
    assert str(info.value) == error


def test_single_train_file_stays_valid_and_formats_agree():
    validate(config_from_dict(job(train="t.parquet")))
    assert tuple(FORMATS) == DATA_FORMATS


# --- training on a mixture -------------------------------------------------------------------------------------


def test_a_mixture_trains_with_per_source_counts_validation_and_exact_resume(tmp_path):
    from plait.train.metrics import read_metrics
    from plait.train.trainer import Trainer

    cfg = config_from_dict(mixture_job(tmp_path, "full", eval_every=0))
    full = Trainer.build(cfg).fit()
    assert len(full["losses"]) == 6
    steps = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "loss" in r]
    assert [sum(r["sources"].values()) for r in steps] == [8] * 6
    assert [r["sources"] for r in steps[:3]] == [{"text": 6, "images": 2}] * 3  # 3:1 in every batch
    assert set(full["eval"]) == {"text/text", "images/image_digit"}  # validation per source (and task)
    first = Trainer.build(config_from_dict(mixture_job(tmp_path, "part", eval_every=0)))
    part = first.fit(stop_after=4)  # epoch 1 (3 batches of 8 per epoch of 24), mid-epoch
    rest = Trainer.build(config_from_dict(mixture_job(tmp_path, "part", eval_every=0))).fit(resume=True)
    assert part["losses"] + rest["losses"] == full["losses"]  # exactly


def test_relative_source_paths_resolve_media_once(tmp_path, monkeypatch):
    """Sources given relative to the working directory (as in a job file): every media path of the mixture is
    the file next to its data file, not the source folder joined twice (a new user's ``data/demo/data/demo/img``)."""
    from plait.data.mixture import MixtureSource
    from plait.data.sources import sample_at

    source_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    sa, sb = open_source("a/x.jsonl"), open_source("b/y.json", name="llava")
    mix = MixtureSource([sa, sb])
    paths = [p for i in range(len(mix)) for items in sample_at(mix, i).media.values() for p in items]
    assert paths and all(Path(p).is_file() for p in paths)
    assert {str(Path(p).parent) for p in paths} == {str(tmp_path / "a" / "img"), str(tmp_path / "b" / "img")}
