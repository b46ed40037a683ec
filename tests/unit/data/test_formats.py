"""Data formats (issue 13, item 3): each format round-trips the demo records to the RawSamples the JSONL gives
(media bytes equal to the files), bad records named with file and record/row, random access and pickling, and
the demo converted to Parquet trains the same first losses as the JSONL."""

from __future__ import annotations

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from plait.data.formats import format_of, open_source
from plait.data.formats.arrow import write_parquet
from plait.data.formats.llava import llava_record
from plait.data.sources import JsonlSource, MediaBytes, RawSample, SampleError, read_jsonl, sample_at
from tests.helpers.jobs import DEMO, tiny_config_dict, write_jsonl

DEMO_JSONL = DEMO / "train.jsonl"
N = 60  # demo records used: text, image and audio tasks mixed


def demo_rows(n: int = N) -> list[dict]:
    """The first ``n`` demo records as written (media paths relative to the demo folder)."""
    return [json.loads(line) for line in DEMO_JSONL.read_text().splitlines()[:n]]


def with_media_bytes(sample: RawSample) -> RawSample:
    """``sample`` with each media path replaced by that file's bytes, and no source label."""
    media = {m: tuple(open(p, "rb").read() for p in items) for m, items in sample.media.items()}
    return RawSample(sample.id, sample.task, sample.messages, media, "")


def unlabelled(sample: RawSample) -> RawSample:
    media = {m: tuple(bytes(x) if isinstance(x, bytes) else x for x in items) for m, items in sample.media.items()}
    return RawSample(sample.id, sample.task, sample.messages, media, "")


def to_llava(rec: dict) -> dict:
    """A demo text/image record in LLaVA's layout."""
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    turns = [{"from": role[m["role"]], "value": m["content"]} for m in rec["messages"]]
    out = {"id": rec["id"], "conversations": turns}
    if rec["images"]:
        out["image"] = rec["images"][0]
    return out


# --- JSONL as a RecordSource -----------------------------------------------------------------------------------

def test_jsonl_source_reads_rows_on_demand_like_read_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in demo_rows(5)]
    path.write_text("\ufeff" + lines[0] + "\n\n" + lines[1] + "\r\n  \n" + "\n".join(lines[2:]) + "\n")
    src = JsonlSource(path)
    assert len(src) == 5 and src.name == "d" and src.base_dir == tmp_path
    assert [src[i][1] for i in range(5)] == [f"{path}:{n}" for n in (1, 3, 5, 6, 7)]
    assert [src[i][0] for i in range(5)] == [json.loads(line) for line in lines] == [r for r, _, _ in read_jsonl(path)]
    assert [src[i] for i in (4, 0, 2)] == [pickle.loads(pickle.dumps(src))[i] for i in (4, 0, 2)]
    with pytest.raises(IndexError, match="row 5 is out of range"):
        src[5]


def test_identity_changes_when_the_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", demo_rows(2))
    before = JsonlSource(path).identity()
    assert before["format"] == "jsonl" and before["path"] == str(path.resolve())
    assert before["size"] == path.stat().st_size
    write_jsonl(path, demo_rows(3))
    assert JsonlSource(path).identity() != before


# --- LLaVA-style JSON ------------------------------------------------------------------------------------------

def test_llava_json_round_trips_to_the_jsonl_samples(tmp_path):
    recs = [r for r in demo_rows() if not r["audios"]]  # LLaVA records carry at most images
    assert {r["task"] for r in recs} == {"text", "image_digit"}
    (tmp_path / "img").mkdir()
    for r in recs:
        r["task"] = "default"  # LLaVA has no task
        for p in r["images"]:  # media relative to the data file's folder, as in the demo
            (tmp_path / p).write_bytes((DEMO / p).read_bytes())
    jsonl = JsonlSource(write_jsonl(tmp_path / "d.jsonl", recs))
    llava_path = tmp_path / "d.json"
    llava_path.write_text(json.dumps([to_llava(r) for r in recs], indent=1))
    src = open_source(llava_path)
    assert len(src) == len(recs) == len(jsonl)
    for i in range(len(src)):
        a, b = sample_at(jsonl, i), sample_at(src, i)
        assert unlabelled(a) == unlabelled(b)
        assert b.source == f"{llava_path}:record {i}"
    images = sum(len(sample_at(src, i).media["image"]) for i in range(len(src)))
    assert images == sum(len(r["images"]) for r in recs) > 0


@pytest.mark.parametrize("record, error", [
    ({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
     "conversations[1].from is 'bot'; expected one of human, gpt, system"),
    ({"id": "a", "conversations": [{"from": "human"}]}, "conversations[0] needs 'from' and 'value'"),
    ({"id": "a", "conversations": [{"from": "human", "value": 3}]}, "conversations[0].value must be a string"),
    ({"id": "a", "conversations": []}, "'conversations' must be a non-empty list of {from, value} turns"),
    ({"id": "a", "image": "x.png", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
     "0 <image> placeholder(s) in conversations but 1 image(s) in 'image'"),
    ({"id": "a", "image": "x.png", "conversations": [{"from": "human", "value": "<image>"},
                                                    {"from": "gpt", "value": "<image>"}]},
     "conversations[1] (gpt) holds <image>; only human turns may"),
    ({"id": "a", "image": 5, "conversations": [{"from": "human", "value": "<image>"}]},
     "'image' must be a file path or a list of file paths, got 5"),
    ({"id": "a", "images": ["x.png"], "conversations": []},
     "unknown field 'images'; a LLaVA record's fields are id, image, video, conversations, model"),
    ([1, 2], "record is not a JSON object"),
])
def test_bad_llava_records_are_named_by_index_and_field(tmp_path, record, error):
    good = to_llava(demo_rows(1)[0])
    path = tmp_path / "l.json"
    path.write_text(json.dumps([good, record]))
    src = open_source(path)
    assert src[0] == (llava_record(good), f"{path}:record 0", None)
    assert src[1] == (None, f"{path}:record 1", error)
    with pytest.raises(SampleError) as info:
        sample_at(src, 1)
    assert str(info.value) == f"{path}:record 1: {error}"


def test_llava_non_utf8_record_and_broken_array(tmp_path):
    path = tmp_path / "l.json"
    good = json.dumps(to_llava(demo_rows(1)[0])).encode()
    path.write_bytes(b"[" + good + b",\n" + good.replace(b"Which", b"Wh\xffich") + b"]")
    src = open_source(path)
    assert src[0][2] is None and src[1][0] is None
    at = good.index(b"Which") + 2
    assert src[1][2] == f"not valid UTF-8: byte 0xff at byte offset {at} of the record; the data file must be UTF-8"
    path.write_bytes(b"[" + good + b", {\"id\": 2,}]")
    with pytest.raises(ValueError, match=r"l\.json: invalid JSON in record 1 at byte \d+: Expecting property name"):
        open_source(path)
    path.write_bytes(b'{"id": 1}')
    with pytest.raises(ValueError, match="one array of records; it does not start with '\\['"):
        open_source(path)


# --- Parquet / Arrow -------------------------------------------------------------------------------------------

def test_parquet_round_trips_to_the_jsonl_samples_with_media_bytes(tmp_path):
    recs = demo_rows()
    path = write_parquet(recs, tmp_path / "d.parquet", DEMO, row_group_size=7)
    assert pq.ParquetFile(path).metadata.num_row_groups == 9
    jsonl, src = JsonlSource(DEMO_JSONL), open_source(path)
    assert len(src) == N and src.name == "d"
    order = [37, 0, 59, 8, 7, 36, 1]  # random access across row groups
    for i in order + list(range(N)):
        a, b = sample_at(jsonl, i), sample_at(src, i)
        assert with_media_bytes(a) == unlabelled(b)
        assert b.source == f"{path}:row {i}"
    image = next(sample_at(src, i) for i in range(N) if recs[i]["images"]).media["image"][0]
    audio = next(sample_at(src, i) for i in range(N) if recs[i]["audios"]).media["audio"][0]
    assert isinstance(image, MediaBytes) and isinstance(audio, MediaBytes)
    assert str(image).startswith(f"images[0] of {path}:row ") and str(image).endswith(f"(embedded, {len(image)} bytes)")
    assert [pickle.loads(pickle.dumps(src))[i] for i in order] == [src[i] for i in order]


def hf_style_table(recs: list[dict]) -> pa.Table:
    """The records as Hugging Face ``datasets`` exports them: messages as JSON text, media as {bytes, path}."""
    item = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [{"id": r["id"], "task": r["task"], "messages": json.dumps(r["messages"]),
             "images": [{"bytes": (DEMO / p).read_bytes(), "path": None} for p in r["images"]],
             "audios": [{"bytes": None, "path": str(DEMO / p)} for p in r["audios"]]} for r in recs]
    schema = pa.schema([("id", pa.string()), ("task", pa.string()), ("messages", pa.string()),
                        ("images", pa.list_(item)), ("audios", pa.list_(item))])
    return pa.Table.from_pylist(rows, schema=schema)


@pytest.mark.parametrize("kind", ["parquet", "arrow-file", "arrow-stream"])
def test_hf_style_columns_in_parquet_and_arrow_files(tmp_path, kind):
    recs = demo_rows()
    table = hf_style_table(recs)
    path = tmp_path / ("d.parquet" if kind == "parquet" else "d.arrow")
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=16)
    else:
        with pa.OSFile(str(path), "wb") as f:
            new = pa.ipc.new_file if kind == "arrow-file" else pa.ipc.new_stream
            with new(f, table.schema) as writer:
                writer.write_table(table, max_chunksize=16)
    src, jsonl = open_source(path), JsonlSource(DEMO_JSONL)
    assert len(src) == N
    for i in range(N):
        a, b = sample_at(jsonl, i), sample_at(src, i)
        assert a.messages == b.messages and a.id == b.id and a.task == b.task
        assert b.media["audio"] == a.media["audio"]  # {bytes: null, path}: the path
        assert list(b.media["image"]) == [open(p, "rb").read() for p in a.media["image"]]


def test_bad_parquet_rows_are_named_by_file_and_row(tmp_path):
    recs = demo_rows(4)
    table = hf_style_table(recs).to_pylist()
    table[1]["messages"] = "[{\"role\": \"user\""
    table[2]["images"] = [{"bytes": None, "path": None}]
    table[3]["id"] = None
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(table, schema=hf_style_table(recs).schema), path)
    src = open_source(path)
    assert src[0][2] is None
    assert src[1] == (None, f"{path}:row 1", "column 'messages' is not valid JSON text: Expecting ',' delimiter at "
                                               "character 16")
    assert src[2] == (None, f"{path}:row 2", "column images[0] is empty: neither bytes nor a path")
    with pytest.raises(SampleError, match=rf"^record at {path}:row 3: no 'id'; every record needs an 'id'"):
        sample_at(src, 3)


def test_a_corrupt_embedded_image_is_named_by_row_and_item(tmp_path):
    from plait.data.processing import load_image

    recs = [r for r in demo_rows() if r["images"]][:1]
    table = hf_style_table(recs).to_pylist()
    table[0]["images"] = [{"bytes": b"\x89PNG broken", "path": None}]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(table, schema=hf_style_table(recs).schema), path)
    [image] = sample_at(open_source(path), 0).media["image"]
    with pytest.raises(SampleError) as info:
        load_image(image)
    assert str(info.value) == (f"cannot decode image images[0] of {path}:row 0 (embedded, 11 bytes): cannot identify "
                               "image file the embedded bytes")


@pytest.mark.parametrize("columns, error", [
    ({"id": pa.array(["a"]), "messages": pa.array(["[]"]), "image": pa.array([b"x"])},
     "unknown column 'image'; a data file's columns are id, task, messages, images, audios, videos, meta"),
    ({"messages": pa.array(["[]"])}, "no 'id' column; every data file needs id and messages"),
    ({"id": pa.array(["a"]), "messages": pa.array(["[]"]), "images": pa.array([b"x"])},
     "column 'images' has type binary; expected list<binary>, list<string> or list<struct<bytes: binary, "
     "path: string>> (plait.data.formats.arrow)"),
    ({"id": pa.array([1.5]), "messages": pa.array(["[]"])},
     "column 'id' has type double; expected a string or an integer (plait.data.formats.arrow)"),
])
def test_a_parquet_file_with_wrong_columns_is_refused_naming_the_column(tmp_path, columns, error):
    path = tmp_path / "w.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(ValueError) as info:
        open_source(path)
    assert str(info.value) == f"{path}: {error}"


def test_format_by_extension_or_explicit(tmp_path):
    assert [format_of(p) for p in ("a.jsonl", "b.JSON", "c.parquet", "d.arrow", "e.feather")] == \
        ["jsonl", "llava", "parquet", "arrow", "arrow"]
    assert format_of("data.txt", "jsonl") == "jsonl"
    with pytest.raises(ValueError, match=r"cannot tell the format of data file data\.txt from its extension '\.txt'"):
        format_of("data.txt")
    with pytest.raises(ValueError, match=r"unknown data format 'csv' for a\.csv; known formats: jsonl, llava"):
        format_of("a.csv", "csv")
    path = write_jsonl(tmp_path / "records.txt", demo_rows(2))
    assert len(open_source(path, "jsonl", name="mine")) == 2 and open_source(path, "jsonl", name="mine").name == "mine"


# --- the same training on Parquet ------------------------------------------------------------------------------

def test_the_demo_as_parquet_trains_the_same_first_losses_as_the_jsonl(tmp_path):
    from plait.config.loader import config_from_dict
    from plait.train.trainer import Trainer

    recs = demo_rows(24)
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({**r, "images": [str(DEMO / p) for p in r["images"]],
                                         "audios": [str(DEMO / p) for p in r["audios"]]}) + "\n" for r in recs))
    parquet = write_parquet(recs, tmp_path / "d.parquet", DEMO)
    losses = []
    for path in (jsonl, parquet):
        cfg = config_from_dict(tiny_config_dict(str(path), None, str(tmp_path / f"run-{path.suffix[1:]}"),
                                                train={"steps": 3}))
        losses.append(Trainer.build(cfg).fit()["losses"])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


@pytest.mark.parametrize("window", [7, 100, 1 << 24])
def test_the_llava_index_scan_slides_its_window_over_records_of_any_length(tmp_path, monkeypatch, window):
    import plait.data.formats.llava as llava

    monkeypatch.setattr(llava, "_WINDOW", window)
    turns = [{"from": "gpt", "value": "x"}]
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "é" * (i * 37 % 301)}] + turns}
            for i in range(60)] + [5, [1, 2], None]
    path = tmp_path / "l.json"
    path.write_text(" \n" + json.dumps(recs, indent=2, ensure_ascii=False) + "\n")
    src = open_source(path)
    assert [src[i][0] for i in range(60)] == [llava_record(r) for r in recs[:60]]
    assert [src[i] for i in (60, 61, 62)] == [(None, f"{path}:record {i}", "record is not a JSON object")
                                              for i in (60, 61, 62)]
    for text, error in [('[{"id": 1},', r"invalid JSON in record 1 at byte 11: Expecting value"),
                        ('[{"id": 1}', r"invalid JSON in record 0 at byte 10: the file ends before the closing '\]'"),
                        ('[{"id": 1} {"id": 2}]', r"expected ',' or '\]' after record 0 at byte 11")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^{path}: {error}$"):
            open_source(path)
    path.write_text("[ ]")
    assert len(open_source(path)) == 0
