"""Checks of the committed demo set in data/demo/ and of the pure parts of its builder.

Reads only committed files (no espeak-ng needed). Expected values come from independent sources:
scikit-learn's own digit labels and pixels, answers recomputed from the question text, token ids
from encoding the answer on its own, and ChatML strings written out by hand here.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from plait.data.demo import build

DEMO = Path(__file__).resolve().parents[3] / "data" / "demo"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<image>", "<audio>"]
TASKS = {"image_digit", "audio_transcribe", "image_audio", "text"}


@lru_cache(maxsize=None)
def records(split: str) -> tuple[dict, ...]:
    with (DEMO / f"{split}.jsonl").open(encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


@lru_cache(maxsize=None)
def sklearn_digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images, d.target


@lru_cache(maxsize=None)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))


def media(split: str, key: str) -> set[str]:
    return {p for r in records(split) for p in r[key]}


def user(r: dict) -> str:
    return r["messages"][0]["content"]


def answer(r: dict) -> str:
    return r["messages"][1]["content"]


# ---------------------------------------------------------------------------------------- records


@pytest.mark.parametrize("split", ["train", "val"])
def test_record_schema_and_placeholder_counts(split):
    ids = [r["id"] for r in records(split)]
    assert len(ids) == len(set(ids))
    for r in records(split):
        assert set(r) >= {"id", "task", "messages", "images", "audios"}, r["id"]
        assert r["task"] in TASKS
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert user(r).count("<image>") == len(r["images"])
        assert user(r).count("<audio>") == len(r["audios"])
        assert "<image>" not in answer(r) and "<audio>" not in answer(r)
        expected = {"image_digit": (1, 0), "audio_transcribe": (0, 1), "image_audio": (1, 1), "text": (0, 0)}
        assert (len(r["images"]), len(r["audios"])) == expected[r["task"]], r["id"]


@pytest.mark.parametrize("split", ["train", "val"])
def test_task_counts_meet_minima(split):
    counts = Counter(r["task"] for r in records(split))
    total = sum(counts.values())
    assert (2800 <= total <= 3200) if split == "train" else (350 <= total <= 450)
    for task, share in {"image_digit": 0.40, "audio_transcribe": 0.40, "image_audio": 0.15, "text": 0.05}.items():
        assert abs(counts[task] / total - share) < 0.02, (task, counts[task], total)
    if split == "val":
        assert counts["image_digit"] >= 100 and counts["audio_transcribe"] >= 100


def test_splits_share_no_image_and_no_audio():
    train_idx = {i for r in records("train") for i in r["meta"].get("sklearn_index", [])}
    val_idx = {i for r in records("val") for i in r["meta"].get("sklearn_index", [])}
    assert train_idx and val_idx and not train_idx & val_idx
    assert not media("train", "images") & media("val", "images")
    assert not media("train", "audios") & media("val", "audios")
    # image_audio records use items of their own split: seen in no record of the other split.
    for split, other in [("train", "val"), ("val", "train")]:
        for r in records(split):
            if r["task"] == "image_audio":
                assert r["images"][0] not in media(other, "images")
                assert r["audios"][0] not in media(other, "audios")


def test_image_answers_and_indices_match_sklearn_labels():
    _, target = sklearn_digits()
    for split in ["train", "val"]:
        for r in records(split):
            if not r["images"]:
                continue
            (idx,) = r["meta"]["sklearn_index"]
            assert r["images"] == [f"img/{idx:06d}.png"]
            assert answer(r).split(" ; ")[0] == WORDS[target[idx]], r["id"]


def test_audio_transcripts_are_consistent_digit_words():
    transcript: dict[str, str] = {}
    for split in ["train", "val"]:
        for r in records(split):
            if not r["audios"]:
                continue
            said = answer(r).split(" ; ")[-1]
            assert 1 <= len(said.split()) <= 3 and set(said.split()) <= set(WORDS), r["id"]
            # the same clip always carries the same transcript
            assert transcript.setdefault(r["audios"][0], said) == said, r["audios"][0]
    assert len(transcript) >= 1500


def _solve(question: str) -> str:
    """Recompute a text-task answer from the question wording."""
    n = {w: i for i, w in enumerate(WORDS)}
    if m := re.fullmatch(r"What is (\w+) plus (\w+)\?", question):
        return WORDS[n[m[1]] + n[m[2]]]
    if m := re.fullmatch(r"Which number comes after (\w+)\?", question):
        return WORDS[n[m[1]] + 1]
    if m := re.fullmatch(r"Which is larger, (\w+) or (\w+)\?", question):
        return WORDS[max(n[m[1]], n[m[2]])]
    raise AssertionError(f"unknown text question {question!r}")


def test_text_answers_are_correct():
    texts = [r for s in ["train", "val"] for r in records(s) if r["task"] == "text"]
    assert len(texts) >= 100
    for r in texts:
        assert _solve(user(r)) == answer(r), r["id"]


# ------------------------------------------------------------------------------------------ files


def test_every_image_exists_decodes_and_shows_its_sklearn_digit():
    images, _ = sklearn_digits()
    paths = sorted(media("train", "images") | media("val", "images"))
    sides, small = Counter(), []
    for rel in paths:
        with Image.open(DEMO / rel) as im:
            assert im.format == "PNG" and im.mode == "RGB"
            assert im.size[0] == im.size[1] and im.size[0] in {16, 24, 32}, rel
            sides[im.size[0]] += 1
            small.append(np.asarray(im.convert("L").resize((8, 8), Image.Resampling.BOX), dtype=float).ravel())
    assert len(sides) == 3 and min(sides.values()) > 0.2 * len(paths)

    def zscore(a):
        return (a - a.mean(1, keepdims=True)) / a.std(1, keepdims=True)

    # correlation of each file (box-averaged back to 8x8) with every sklearn image
    corr = zscore(np.stack(small)) @ zscore(images.reshape(len(images), -1)).T / 64
    own = np.array([int(Path(rel).stem) for rel in paths])
    assert corr[np.arange(len(own)), own].min() > 0.9
    assert np.mean(corr.argmax(1) == own) > 0.99  # the named sklearn image is (almost always) the best match


def test_every_audio_exists_decodes_16khz_mono_at_most_2_5_s():
    seconds: dict[str, float] = {}
    for split in ["train", "val"]:
        for r in records(split):
            for rel, meta_s in zip(r["audios"], r["meta"].get("seconds", [])):
                if rel not in seconds:
                    info = soundfile.info(str(DEMO / rel))
                    wave, rate = soundfile.read(str(DEMO / rel), dtype="float32")
                    assert rate == 16_000 and info.channels == 1 and wave.ndim == 1, rel
                    assert 0.1 < wave.size / rate <= 2.5, rel
                    assert 0.5 < np.abs(wave).max() <= 1.0, rel  # not silent, not clipped
                    seconds[rel] = wave.size / rate
                assert abs(seconds[rel] - meta_s) < 1e-3, rel
    assert len(seconds) == len(media("train", "audios") | media("val", "audios"))
    words = {}
    for r in records("train"):
        if r["task"] == "audio_transcribe":
            words[r["audios"][0]] = len(answer(r).split())
    mean = {k: np.mean([seconds[p] for p, n in words.items() if n == k]) for k in (1, 2, 3)}
    assert mean[1] < mean[2] < mean[3]  # longer transcripts are longer clips


def test_folder_content_is_under_15_mb():
    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert total < 15e6, total


# -------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens_are_single_ids():
    tok = tokenizer()
    ids = [tok.encode(t, add_special_tokens=False) for t in SPECIALS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(SPECIALS)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|eos|>"
    assert tok.pad_token_id == ids[0][0] and tok.eos_token_id == ids[2][0]
    image_id = tok.convert_tokens_to_ids("<image>")
    enc = tok.encode("<image>\nWhich digit is this?", add_special_tokens=False)
    assert enc[0] == image_id and enc.count(image_id) == 1
    assert enc[1:] == tok.encode("\nWhich digit is this?", add_special_tokens=False)
    assert 256 + len(SPECIALS) < len(tok) <= 512
    text = "<image>\n<audio>\nName the digit, then transcribe.<|im_end|>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _check_mask(messages: list[dict]) -> None:
    tok = tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    assert ids == tok.encode(rendered, add_special_tokens=False)
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    expected = [0] * len(ids)
    starts = [i + len(header) for i in range(len(ids)) if ids[i : i + len(header)] == header]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(starts) == len(replies)
    for start, reply in zip(starts, replies):
        span = tok.encode(reply, add_special_tokens=False) + [im_end]
        assert ids[start : start + len(span)] == span
        expected[start : start + len(span)] = [1] * len(span)
    assert mask == expected


def test_assistant_mask_covers_exactly_answer_and_im_end():
    by_task = {}
    for r in records("val"):
        by_task.setdefault(r["task"], []).append(r)
    for task, rs in by_task.items():
        for r in rs[:5]:
            _check_mask(r["messages"])
    first, second = records("val")[0]["messages"], records("val")[1]["messages"]
    _check_mask(first + second)  # two assistant turns: both spans marked, nothing between


# ----------------------------------------------------------------------------- builder (pure parts)


@pytest.mark.parametrize("n", [0, 1, 7, 20, 400, 3001])
def test_plan_task_counts_sums_and_shares(n):
    counts = build.plan_task_counts(n)
    assert sum(counts.values()) == n
    for task, share in {"image_digit": 0.40, "audio_transcribe": 0.40, "image_audio": 0.15, "text": 0.05}.items():
        assert abs(counts[task] - share * n) < 1.0
    with pytest.raises(ValueError, match="n_records"):
        build.plan_task_counts(-1)


def test_plan_utterances_distinct_and_seeded():
    a = build.plan_utterances(300, np.random.default_rng(5))
    b = build.plan_utterances(300, np.random.default_rng(5))
    assert a == b and len(set(a)) == 300
    assert all(1 <= len(u.digits) <= 3 and u.voice and 140 <= u.wpm <= 200 for u in a)
    assert build.Utterance((3, 1, 4), "en", 160).words == "three one four"


def test_trim_silence_keeps_loud_part_plus_pad():
    wave = np.zeros(1000, dtype=np.float32)
    wave[400:500] = 1.0
    wave[300] = 0.005  # below 1 % of the peak: trimmed
    out = build.trim_silence(wave, rel_threshold=0.01, pad=10)
    assert out.size == 120 and out[10] == 1.0 and out[-11] == 1.0
    with pytest.raises(ValueError, match="silent"):
        build.trim_silence(np.zeros(10))


def test_missing_espeak_gives_install_hint(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install -y espeak-ng"):
        build.require_espeak()
