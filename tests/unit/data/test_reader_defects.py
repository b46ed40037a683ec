"""Defects of the JSONL reader and the image decoder (issue 13, item 4): line separators inside strings,
non-UTF-8 bytes, a byte-order mark, and transparent images (composited onto white like the HF processor)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from plait.data.loader import MultimodalDataset
from plait.data.processing import load_image
from plait.data.sources import SampleError, parse_record, read_jsonl
from tests.helpers.jobs import demo_records


@pytest.fixture(scope="module")
def proc():
    from plait.config.loader import config_from_dict
    from plait.models.registry import build_model, build_processor, load_tokenizer
    from tests.helpers.jobs import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict("unused.jsonl"))
    tok = load_tokenizer(cfg.data.tokenizer)
    return build_processor(cfg.model, build_model(cfg.model, tok), tok, 256)


def raw_lines(records: list[dict]) -> list[bytes]:
    """Each record as one UTF-8 JSON line (non-ASCII characters written raw), without its line end."""
    return [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in records]


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085"])
def test_a_raw_line_separator_inside_a_string_stays_in_its_record(proc, tmp_path, sep):
    recs = demo_records("train", ("text",), limit=3)
    recs[1]["messages"][0]["content"] = f"first{sep}second"
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(raw_lines(recs)) + b"\n")
    assert sep.encode("utf-8") in path.read_bytes()  # really written raw, not escaped
    rows = read_jsonl(path)
    assert [(where, err) for _, where, err in rows] == [(f"{path}:{i}", None) for i in (1, 2, 3)]
    assert rows[1][0]["messages"][0]["content"] == f"first{sep}second"
    ds = MultimodalDataset(path, proc, on_error="raise")
    assert len(ds) == 3 and ds.skipped == []


def test_crlf_line_endings_read_like_lf(tmp_path):
    recs = demo_records("train", ("text",), limit=2)
    lf, crlf = tmp_path / "lf.jsonl", tmp_path / "crlf.jsonl"
    lf.write_bytes(b"".join(line + b"\n" for line in raw_lines(recs)))
    crlf.write_bytes(b"".join(line + b"\r\n" for line in raw_lines(recs)))
    assert [obj for obj, _, _ in read_jsonl(crlf)] == [obj for obj, _, _ in read_jsonl(lf)] == recs
    assert [err for _, _, err in read_jsonl(crlf)] == [None, None]


def non_utf8_file(tmp_path):
    """Three text records; the second has a 0xff byte inside its answer. Returns (path, that byte's offset
    in the line, its offset in the file)."""
    lines = raw_lines(demo_records("train", ("text",), limit=3))
    at = lines[1].index(b'"content": "', lines[1].index(b'"assistant"')) + len(b'"content": "')
    lines[1] = lines[1][:at] + b"\xff" + lines[1][at:]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path, at, len(lines[0]) + 1 + at


def test_a_non_utf8_byte_stops_the_run_naming_file_line_and_offset(proc, tmp_path):
    path, in_line, in_file = non_utf8_file(tmp_path)
    with pytest.raises(SampleError) as info:
        MultimodalDataset(path, proc, on_error="raise")
    assert str(info.value) == (f"{path}:2: not valid UTF-8: byte 0xff at byte offset {in_line} of the line "
                               f"({in_file} of the file); the data file must be UTF-8")


def test_a_non_utf8_line_is_counted_logged_and_skipped(proc, tmp_path, caplog):
    path, in_line, _ = non_utf8_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        ds = MultimodalDataset(path, proc, on_error="skip")
    ids = [r["id"] for r in demo_records("train", ("text",), limit=3)]
    assert len(ds) == 2 and [s.meta.id for s in ds.samples] == [ids[0], ids[2]]
    assert [(s.id, s.source) for s in ds.skipped] == [(f"{path}:2", f"{path}:2")]
    assert f"byte 0xff at byte offset {in_line} of the line" in ds.skipped[0].reason
    assert sum(f"skipping sample: {path}:2: not valid UTF-8" in r.message for r in caplog.records) == 1


def test_a_utf8_byte_order_mark_at_the_start_is_accepted(proc, tmp_path):
    recs = demo_records("train", ("text",), limit=2)
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(line + b"\n" for line in raw_lines(recs)))
    rows = read_jsonl(path)
    assert rows == [(recs[0], f"{path}:1", None), (recs[1], f"{path}:2", None)]
    ds = MultimodalDataset(path, proc, on_error="raise")
    assert [s.meta.id for s in ds.samples] == [r["id"] for r in recs]


# (mode, pixels of a 2x2 image, palette transparency or None, expected RGB after compositing onto white)
TRANSPARENT = {
    "RGBA": ([[(200, 40, 10, 0), (200, 40, 10, 255)], [(200, 40, 10, 128), (0, 0, 0, 64)]], None,
             [[(255, 255, 255), (200, 40, 10)], [(227, 147, 132), (191, 191, 191)]]),
    "LA": ([[(100, 0), (100, 255)], [(100, 128), (0, 64)]], None,
           [[(255, 255, 255), (100, 100, 100)], [(177, 177, 177), (191, 191, 191)]]),
    "P": ([[0, 1], [1, 0]], 0, [[(255, 255, 255), (200, 40, 10)], [(200, 40, 10), (255, 255, 255)]]),
}


def transparent_png(tmp_path, mode: str) -> str:
    pixels, transparency, _ = TRANSPARENT[mode]
    path = tmp_path / f"{mode}.png"
    if mode == "P":
        img = Image.fromarray(np.array(pixels, dtype=np.uint8), "L").convert("P")
        img.putpalette([10, 20, 30, 200, 40, 10] + [0] * 762)
        img.save(path, transparency=transparency)
    else:
        Image.fromarray(np.array(pixels, dtype=np.uint8), mode).save(path)
    return str(path)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_are_composited_onto_white(tmp_path, mode):
    path = transparent_png(tmp_path, mode)
    with Image.open(path) as img:
        assert img.mode == mode and ("A" in img.getbands() or "transparency" in img.info)
        hf = convert_to_rgb(img, return_numpy=True)  # what the HF image processors do to a PIL image
    got = load_image(path)
    assert got.mode == "RGB"
    assert np.asarray(got).tolist() == [[list(px) for px in row] for row in TRANSPARENT[mode][2]]
    assert np.array_equal(np.asarray(got), hf)


def test_processed_pixels_equal_the_hf_processor_on_the_transparent_file(proc, tmp_path):
    rgba = np.zeros((32, 32, 4), dtype=np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, np.arange(32, dtype=np.uint8)[:, None] * 8  # alpha 0..248 down the rows
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    rec = {**demo_records("train", ("image_digit",), limit=1)[0], "images": [str(tmp_path / "a.png")]}
    sample = proc(parse_record(rec, "test:1", tmp_path))
    hf = proc.specs["image"].hf_processor
    with Image.open(tmp_path / "a.png") as img:  # the processor given the file as inference would be
        expected = hf(images=[img], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(sample.inputs["vision"][0]["pixel_values"], expected)
    assert sample.inputs["vision"][0]["pixel_values"][:, 0, 0].tolist() == [1.0, 1.0, 1.0]  # alpha 0: white
