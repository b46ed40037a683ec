"""Parquet and Arrow files with the media bytes embedded, read with ``pyarrow``.

One row per record. Columns (the names of plait's record fields, :mod:`plait.data.sources`):

==============  ======================================================================================  ========
column          Arrow type                                                                              required
==============  ======================================================================================  ========
``id``          string or integer                                                                       yes
``messages``    ``list<struct<role: string, content: string>>``, or a string holding the JSON list      yes
``images``      ``list<binary>`` (encoded files: PNG, JPEG, ...), ``list<string>`` (paths relative to    no
                the data file), or ``list<struct<bytes: binary, path: string>>`` (Hugging Face
                ``datasets``' ``Image`` feature: the bytes, else the path)
``audios``      as ``images`` (WAV, FLAC, OGG bytes; ``datasets``' ``Audio`` feature)                    no
``videos``      as ``images`` (MP4, WebM, MKV, ... bytes or paths: :mod:`plait.data.video`)               no
``task``        string                                                                                  no
``meta``        any (ignored)                                                                           no
==============  ======================================================================================  ========

Any other column is an error when the file is opened. A row is labelled ``"<path>:row <index>"`` (0-based over
the whole file).

Random access without reading the file into memory: a Parquet file is read one row group at a time, when a
row in it is asked for (the last row group read is kept, per process), so write training sets with small row
groups (:func:`write_parquet`: 256 rows); an Arrow IPC file (``.arrow``, file or stream format: what
``datasets.Dataset.save_to_disk`` writes) is memory-mapped and any row is read without copying its batch.
``pyarrow`` rather than Hugging Face ``datasets``: it reads both formats directly, where ``datasets`` first
converts a Parquet file into a second on-disk Arrow copy and brings a dozen dependencies; its files
(Parquet exports and ``save_to_disk`` Arrow files with ``Image``/``Audio`` features) are read here as they are.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from plait.data.sources import FileSource, Row, check_index

__all__ = ["ArrowSource", "ARROW_COLUMNS", "write_parquet"]

ARROW_COLUMNS = ("id", "task", "messages", "images", "audios", "videos", "meta")
"""The columns a Parquet/Arrow data file may have (module docstring)."""
_REQUIRED = ("id", "messages")
_MEDIA = ("images", "audios", "videos")


class ArrowSource(FileSource):
    """A Parquet (``format="parquet"``) or Arrow IPC (``format="arrow"``) file as a
    :class:`plait.data.sources.RecordSource` (module docstring: the columns and how rows are read).

    Args:
        path: the data file.
        format: ``"parquet"`` or ``"arrow"``.
        name: the source's name (default: the file's stem).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file cannot be read as that format, or a column is unknown, missing or of a
            type the mapping does not accept (naming the file and the column).
    """

    def __init__(self, path: str | Path, format: str = "parquet", name: str | None = None) -> None:
        if format not in ("parquet", "arrow"):
            raise ValueError(f"ArrowSource reads 'parquet' or 'arrow', got {format!r}")
        super().__init__(path, name)
        self.format = format
        self._pid, self._reader, self._cached = -1, None, (-1, None)
        schema, sizes = self._open()
        _check_schema(schema, self.path)
        self._offsets = [0]
        for n in sizes:
            self._offsets.append(self._offsets[-1] + n)

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index: int) -> Row:
        check_index(index, len(self), self.path)
        group = bisect.bisect_right(self._offsets, index) - 1
        row = self._group(group).slice(index - self._offsets[group], 1).to_pylist()[0]
        where = f"{self.path}:row {index}"
        try:
            return _record(row), where, None
        except ValueError as exc:
            return None, where, str(exc)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_reader": None, "_cached": (-1, None)}

    def _open(self) -> tuple[pa.Schema, list[int]]:
        """Open the file in this process: ``(schema, rows per row group / record batch)``."""
        try:
            if self.format == "parquet":
                self._reader = pq.ParquetFile(self.path)
                meta = self._reader.metadata
                sizes = [meta.row_group(k).num_rows for k in range(meta.num_row_groups)]
                schema = self._reader.schema_arrow
            else:
                self._reader = _arrow_batches(self.path)
                sizes = [b.num_rows for b in self._reader]
                schema = self._reader[0].schema if self._reader else pa.schema([])
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"cannot read {self.path} as {self.format}: {exc}") from exc
        self._pid = os.getpid()
        return schema, sizes

    def _group(self, group: int) -> pa.RecordBatch | pa.Table:
        """Row group (Parquet, read now unless it is the last one read) or record batch ``group``."""
        if self._pid != os.getpid():  # a DataLoader worker opens its own reader
            self._open()
            self._cached = (-1, None)
        if self.format == "arrow":
            return self._reader[group]
        if self._cached[0] != group:
            self._cached = (group, self._reader.read_row_group(group))
        return self._cached[1]


def _arrow_batches(path: Path) -> list[pa.RecordBatch]:
    """The record batches of a memory-mapped Arrow IPC file (file format, else stream format); zero-copy."""
    source = pa.memory_map(str(path), "r")
    try:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(k) for k in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        source.seek(0)
        return list(pa.ipc.open_stream(source))


def _check_schema(schema: pa.Schema, path: Path) -> None:
    """Raises ValueError naming the column for an unknown, missing or mistyped column."""
    unknown = [n for n in schema.names if n not in ARROW_COLUMNS]
    if unknown:
        raise ValueError(f"{path}: unknown column {unknown[0]!r}; a data file's columns are {', '.join(ARROW_COLUMNS)}")
    missing = [n for n in _REQUIRED if n not in schema.names]
    if missing:
        raise ValueError(f"{path}: no {missing[0]!r} column; every data file needs {' and '.join(_REQUIRED)}")
    checks = {"id": _is_id, "task": _is_text, "messages": _is_messages, "images": _is_media, "audios": _is_media,
              "videos": _is_media}
    for name, ok in checks.items():
        if name in schema.names and not ok(schema.field(name).type):
            raise ValueError(f"{path}: column {name!r} has type {schema.field(name).type}; "
                             f"expected {_EXPECTED[name]} (plait.data.formats.arrow)")


_EXPECTED = {
    "id": "a string or an integer",
    "task": "a string",
    "messages": "list<struct<role: string, content: string>> or a JSON string",
    "images": "list<binary>, list<string> or list<struct<bytes: binary, path: string>>",
    "audios": "list<binary>, list<string> or list<struct<bytes: binary, path: string>>",
    "videos": "list<binary>, list<string> or list<struct<bytes: binary, path: string>>",
}


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_id(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_integer(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_messages(t: pa.DataType) -> bool:
    if _is_text(t):
        return True
    if not (_is_list(t) and pa.types.is_struct(t.value_type)):
        return False
    names = {t.value_type.field(k).name for k in range(t.value_type.num_fields)}
    return {"role", "content"} <= names


def _is_media(t: pa.DataType) -> bool:
    if not _is_list(t):
        return False
    item = t.value_type
    if pa.types.is_binary(item) or pa.types.is_large_binary(item) or _is_text(item):
        return True
    return pa.types.is_struct(item) and {item.field(k).name for k in range(item.num_fields)} <= {"bytes", "path"}


def _record(row: dict[str, Any]) -> dict[str, Any]:
    """One row (``to_pylist``) as a plait record: JSON-text messages parsed, media as bytes or paths, null
    optional fields dropped.

    Raises:
        ValueError: for messages text that is not JSON, or a null media item.
    """
    record = {k: v for k, v in row.items() if v is not None and k != "meta"}
    if isinstance(record.get("messages"), str):
        try:
            record["messages"] = json.loads(record["messages"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"column 'messages' is not valid JSON text: {exc.msg} at character {exc.pos}") from exc
    for key in _MEDIA:
        if key in record:
            record[key] = [_media_item(item, f"{key}[{j}]") for j, item in enumerate(record[key])]
    return record


def _media_item(item: Any, label: str) -> bytes | str:
    """A media cell: bytes, a path, or a ``{bytes, path}`` struct (its bytes, else its path)."""
    if isinstance(item, dict):
        item = item.get("bytes") if item.get("bytes") is not None else item.get("path")
    if not isinstance(item, (bytes, str)) or not item:
        raise ValueError(f"column {label} is empty: neither bytes nor a path")
    return item


def write_parquet(records: Iterable[dict[str, Any]], path: str | Path, base_dir: str | Path,
                  row_group_size: int = 256) -> Path:
    """Write plait records (the JSONL format) to a Parquet file with their media files' bytes embedded.

    Columns ``id``, ``task``, ``messages`` (list of structs), ``images``, ``audios`` and ``videos`` (list of
    binary); ``meta`` is left out. Row groups of ``row_group_size`` rows keep random access cheap
    (:class:`ArrowSource`).

    Args:
        records: plait records (dicts), media paths relative to ``base_dir`` (or absolute).
        path: the Parquet file to write.
        base_dir: the folder the records' media paths are relative to (the JSONL file's folder).
        row_group_size: rows per row group.

    Raises:
        FileNotFoundError: when a media file does not exist.
    """
    rows = [{"id": str(r["id"]), "task": str(r.get("task", "default")),
             "messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]],
             "images": [(Path(base_dir) / p).read_bytes() for p in r.get("images", []) or []],
             "audios": [(Path(base_dir) / p).read_bytes() for p in r.get("audios", []) or []],
             "videos": [(Path(base_dir) / p).read_bytes() for p in r.get("videos", []) or []]} for r in records]
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.string()), ("task", pa.string()), ("messages", pa.list_(message)),
                        ("images", pa.list_(pa.binary())), ("audios", pa.list_(pa.binary())),
                        ("videos", pa.list_(pa.binary()))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)
    return Path(path)
