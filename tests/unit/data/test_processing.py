"""MultimodalProcessor: labels, placeholder expansion, and one test per kind of bad input."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from plait.data.collate import collate
from plait.data.loader import MultimodalDataset
from plait.data.processing import IGNORE
from plait.data.sources import SampleError, parse_record
from plait.train.loss import token_loss_sum
from tests.helpers.jobs import DEMO, demo_records, write_jsonl
from tests.helpers.processing import setup


def record(task: str):
    return demo_records("train", (task,), limit=1)[0]


def process(proc, rec):
    return proc(parse_record(rec, "test:1", DEMO))


def test_labels_are_next_tokens_of_the_answer_only(setup):
    tok, _, proc = setup
    s = process(proc, record("image_digit"))
    targets = s.labels[s.labels != IGNORE]
    answer = record("image_digit")["messages"][-1]["content"]
    # the model must produce the answer tokens and then <|im_end|>
    assert tok.decode(targets[:-1]).strip() == answer
    assert targets[-1].item() == tok.convert_tokens_to_ids("<|im_end|>")
    # each target is the following input token
    pos = (s.labels != IGNORE).nonzero().flatten()
    assert torch.equal(s.labels[pos], s.input_ids[pos + 1])
    assert s.meta.target_tokens == len(targets)


def test_placeholders_expand_to_the_encoder_feature_count(setup):
    tok, model, proc = setup
    rec = record("image_audio")
    s = process(proc, rec)
    vis, aud = model.encoders["vision"], model.encoders["audio"]
    n_img = int((s.input_ids == model.placeholder_ids["vision"]).sum())
    n_aud = int((s.input_ids == model.placeholder_ids["audio"]).sum())
    h, w = s.inputs["vision"][0]["pixel_values"].shape[-2:]
    assert n_img == vis.feature_count((h, w)) == (h // 8) * (w // 8)
    samples = s.inputs["audio"][0]["num_samples"]
    assert n_aud == aud.feature_count(samples) == math.ceil(math.ceil(math.ceil(samples / 160) / 2) / 4)
    assert s.meta.items == (("vision", n_img), ("audio", n_aud))
    assert s.meta.text_tokens == len(s.input_ids) - n_img - n_aud
    assert (s.labels[s.input_ids == model.placeholder_ids["vision"]] == IGNORE).all()
    # the real encoders produce exactly as many features as placeholders
    b = collate([s], proc.pad_id)
    assert model.embed(b.input_ids, b.modality_inputs).shape[1] == len(s.input_ids)
    assert model.encoders["audio"](b.modality_inputs["audio"]).shape[0] == n_aud


def test_collate_pads_and_records_metadata(setup):
    _, _, proc = setup
    a, b = process(proc, record("text")), process(proc, record("audio_transcribe"))
    batch = collate([a, b], proc.pad_id)
    n = max(len(a.input_ids), len(b.input_ids))
    assert batch.input_ids.shape == (2, n)
    short = 0 if len(a.input_ids) < n else 1
    assert batch.attention_mask[short].sum() == min(len(a.input_ids), len(b.input_ids))
    assert (batch.document_ids[short][batch.attention_mask[short] == 0] == -1).all()
    assert set(batch.modality_inputs) == {"audio"}
    assert batch.target_tokens == a.meta.target_tokens + b.meta.target_tokens
    left = collate([a, b], proc.pad_id, padding_side="left")
    assert left.attention_mask[short, -1] == 1 and left.position_ids[short, -1] == left.attention_mask[short].sum() - 1


def bad_cases(tmp_path):
    good_img, good_aud = record("image_digit"), record("audio_transcribe")
    corrupt_png = tmp_path / "corrupt.png"
    corrupt_png.write_bytes(b"not a png at all")
    corrupt_flac = tmp_path / "corrupt.flac"
    corrupt_flac.write_bytes(b"fLaC garbage")
    return {
        "missing image": ({**good_img, "images": [str(tmp_path / "nope.png")]}, "image file .* does not exist"),
        "corrupt image": ({**good_img, "images": [str(corrupt_png)]}, "cannot decode image"),
        "corrupt audio": ({**good_aud, "audios": [str(corrupt_flac)]}, "cannot decode audio"),
        "missing audio": ({**good_aud, "audios": [str(tmp_path / "nope.flac")]}, "audio file .*nope.flac does not exist$"),
        "unknown field": ({**good_img, "weight": "heavy"},
                          "unknown field 'weight'; a record's fields are id, task, messages, images, audios, videos, meta$"),
        "placeholder count": ({**good_img, "images": good_img["images"] * 2}, "1 <image> placeholder.* but 2 image"),
        "too long": ({**good_img, "messages": [{"role": "user", "content": "<image>\n" + "nine " * 300},
                                               good_img["messages"][-1]]}, "longer than data.max_length=256"),
        "empty conversation": ({**good_img, "messages": []}, "'messages' must be a non-empty list"),
        "unknown role": ({**good_img, "messages": [{"role": "robot", "content": "hi"}, good_img["messages"][-1]]},
                         "unknown role 'robot'"),
        "no answer": ({**good_img, "messages": good_img["messages"][:1]}, "last message must be the assistant"),
        "nothing to answer": ({**good_img, "images": [], "messages": [{"role": "user", "content": "  "},
                                                                      good_img["messages"][-1]]},
                              "nothing to answer: every message before the answer is empty and the record has no "
                              "images, audios or videos$"),
    }


@pytest.mark.parametrize("case", ["missing image", "corrupt image", "corrupt audio", "missing audio", "unknown field",
                                  "placeholder count", "too long", "empty conversation", "unknown role", "no answer",
                                  "nothing to answer"])
def test_bad_input_raises_naming_record_and_file(setup, tmp_path, case):
    _, _, proc = setup
    rec, pattern = bad_cases(tmp_path)[case]
    path = write_jsonl(tmp_path / "data.jsonl", [record("text"), rec])
    with pytest.raises(SampleError, match=pattern) as info:
        MultimodalDataset(path, proc, on_error="raise")
    assert f"{path}:2" in str(info.value) and rec["id"] in str(info.value)


def test_skip_mode_counts_and_logs_every_bad_record(setup, tmp_path, caplog):
    _, _, proc = setup
    cases = bad_cases(tmp_path)
    good = demo_records("train", ("image_digit",), limit=3)
    path = write_jsonl(tmp_path / "data.jsonl", good + [rec for rec, _ in cases.values()])
    (tmp_path / "data.jsonl").write_text(path.read_text() + "{not json\n")
    with caplog.at_level(logging.WARNING):
        ds = MultimodalDataset(path, proc, on_error="skip")
    assert len(ds) == 3
    assert len(ds.skipped) == len(cases) + 1
    assert [s.source for s in ds.skipped][-1].endswith(f":{len(good) + len(cases) + 1}")
    assert sum("skipping sample" in r.message for r in caplog.records) == len(cases) + 1


@pytest.mark.parametrize("rid", ["absent", None, ["a"], "", "  ", True, 1.5])
def test_a_record_needs_an_id_string_or_integer(setup, tmp_path, rid):
    _, _, proc = setup
    good = demo_records("train", ("text",), limit=2)
    bad = {k: v for k, v in good[1].items() if k != "id"} | ({} if rid == "absent" else {"id": rid})
    path = write_jsonl(tmp_path / "data.jsonl", [good[0], bad])
    got = "no 'id'" if rid == "absent" else "'id' = "
    with pytest.raises(SampleError, match=rf"record at {path}:2: {got}.*needs an 'id', a non-empty string or an integer"):
        MultimodalDataset(path, proc, on_error="raise")
    ds = MultimodalDataset(path, proc, on_error="skip")
    assert len(ds) == 1 and [(s.id, s.source) for s in ds.skipped] == [(f"{path}:2", f"{path}:2")]


def test_an_integer_id_is_accepted_as_its_decimal_string(setup, tmp_path):
    _, _, proc = setup
    good = demo_records("train", ("text",), limit=2)
    path = write_jsonl(tmp_path / "data.jsonl", [{**good[0], "id": 7}, {**good[1], "id": "7"}])
    with pytest.raises(SampleError, match=rf"record '7' \({path}:2\): the id is already used at {path}:1"):
        MultimodalDataset(path, proc, on_error="raise")


def test_a_repeated_record_id_is_refused_or_skipped(setup, tmp_path):
    _, _, proc = setup
    first, second = demo_records("train", ("image_digit",), limit=2)
    path = write_jsonl(tmp_path / "data.jsonl", [first, {**second, "id": first["id"]}])
    with pytest.raises(SampleError, match=rf"record '{first['id']}' \({path}:2\): the id is already used at {path}:1"):
        MultimodalDataset(path, proc, on_error="raise")
    ds = MultimodalDataset(path, proc, on_error="skip")
    assert len(ds) == 1 and [s.source for s in ds.skipped] == [f"{path}:2"]


def test_sample_without_targets_gives_zero_loss_not_nan(setup):
    _, model, proc = setup
    s = process(proc, record("text"))
    s.labels[:] = IGNORE  # e.g. an answer cut away: nothing to learn
    batch = collate([s], proc.pad_id)
    logits = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids)
    loss = token_loss_sum(logits, batch.labels) / max(1, batch.target_tokens)
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
