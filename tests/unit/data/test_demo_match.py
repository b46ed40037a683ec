"""The demo's fine-tuning task digit_pair (plait/data/demo/match.py): the committed files' answers recomputed from
the demo's own labels, balance, split hygiene, determinism of the builder, and its job file configs/demo_match.toml.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plait.config.loader import load_config
from plait.data.chat_template import tokenizer_dir
from plait.data.demo.match import MATCH_TASK, MediaPools, build_match_task, make_match_records, media_pools

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "data" / "demo"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _labels(split: str) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Image digits and clip transcripts from the demo's own records (independent of match.py)."""
    images, clips = {}, {}
    for r in _read(DEMO / f"{split}.jsonl"):
        answer = r["messages"][1]["content"]
        if r["task"] == "image_digit":
            images[r["images"][0]] = WORDS.index(answer)
        if r["task"] == "audio_transcribe":
            clips[r["audios"][0]] = [WORDS.index(w) for w in answer.split()]
        if r["task"] == "image_audio":
            images[r["images"][0]] = WORDS.index(answer.split(" ; ")[0])
            clips[r["audios"][0]] = [WORDS.index(w) for w in answer.split(" ; ")[1].split()]
    return images, clips


@pytest.mark.parametrize("split,count", [("train", 1200), ("val", 200)])
def test_committed_match_records_answer_right_and_cover_the_digits(split, count):
    images, clips = _labels(split)
    records = _read(DEMO / f"match_{split}.jsonl")
    assert len(records) == count and len({r["id"] for r in records}) == count
    for r in records:
        assert r["task"] == MATCH_TASK == "digit_pair"
        assert r["messages"][0]["content"] == "<image>\n<audio>\nSay the handwritten digit, then the first spoken digit."
        want = f"{WORDS[images[r['images'][0]]]} {WORDS[clips[r['audios'][0]][0]]}"
        assert r["messages"][1]["content"] == want, r["id"]
    # Both words vary over all ten digits, and mostly differ: neither modality alone answers.
    answers = [r["messages"][1]["content"].split() for r in records]
    assert {a[0] for a in answers} == {a[1] for a in answers} == set(WORDS)
    assert sum(a[0] != a[1] for a in answers) > 0.8 * count


def test_match_splits_share_no_media():
    train, val = _read(DEMO / "match_train.jsonl"), _read(DEMO / "match_val.jsonl")
    for key in ("images", "audios"):
        assert not {p for r in train for p in r[key]} & {p for r in val for p in r[key]}


def test_builder_is_deterministic_and_reproduces_the_committed_files(tmp_path):
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_bytes((DEMO / f"{split}.jsonl").read_bytes())
    assert build_match_task(tmp_path) == {"train": 1200, "val": 200}
    for split in ("train", "val"):
        assert (tmp_path / f"match_{split}.jsonl").read_bytes() == (DEMO / f"match_{split}.jsonl").read_bytes()


def test_make_match_records_answers_image_digit_then_first_spoken_digit():
    pools = MediaPools(images=(("a.png", 1), ("b.png", 2), ("c.png", 3)), clips=(("x.flac", (4, 2, 7)), ("y.flac", (3,))))
    records = make_match_records(pools, 8, "t", np.random.default_rng(0))
    digit, spoken = dict(pools.images), dict(pools.clips)
    assert sorted(r["audios"][0] for r in records) == ["x.flac"] * 4 + ["y.flac"] * 4  # clips in shuffled passes
    assert len({r["id"] for r in records}) == 8
    for r in records:
        answer = r["messages"][1]["content"]
        assert answer == f"{WORDS[digit[r['images'][0]]]} {'four' if r['audios'][0] == 'x.flac' else 'three'}"
        assert r["meta"] == {"image_digit": digit[r["images"][0]], "spoken_digits": list(spoken[r["audios"][0]])}
    with pytest.raises(ValueError, match="no images or no clips"):
        make_match_records(MediaPools((), pools.clips), 2, "t", np.random.default_rng(0))
    with pytest.raises(ValueError, match="record count must be >= 0, got -1"):
        make_match_records(pools, -1, "t", np.random.default_rng(0))


def test_media_pools_names_a_bad_answer():
    bad = {"id": "r7", "task": "image_digit", "messages": [{"role": "user", "content": "<image>"},
                                                           {"role": "assistant", "content": "eleven"}],
           "images": ["i.png"], "audios": []}
    with pytest.raises(ValueError, match="f.jsonl record r7: answer 'eleven'"):
        media_pools([bad], "f.jsonl")


def test_match_job_loads(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "demo_match.toml")
    assert cfg.model.pretrained == "runs/demo/final"
    assert cfg.model.llm.lora.r == 8 and cfg.model.encoders["vision"].lora.r == 8
    assert cfg.model.encoders["audio"].freeze and cfg.data.train.endswith("match_train.jsonl")


def test_match_job_without_the_trained_demo_says_to_train_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no runs/demo/final here
    cfg = load_config(ROOT / "configs" / "demo_match.toml")
    with pytest.raises(ValueError, match=r"model.pretrained = 'runs/demo/final' does not exist: .*`make demo`"):
        tokenizer_dir(cfg.data, cfg.model)
