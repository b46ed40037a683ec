"""Records in the common conversation format (JSONL) -> validated raw samples.

One record per line (UTF-8, lines ending at ``\\n``; see :func:`read_jsonl`)::

    {"id": "img-1", "task": "image_digit",
     "messages": [{"role": "user", "content": "<image>\\nWhich digit is this?"},
                  {"role": "assistant", "content": "seven"}],
     "images": ["img/0001.png"], "audios": []}

Media paths are relative to the JSONL file's folder (absolute paths are kept). ``id`` (a non-empty string or
an integer, unique in the file) and ``messages`` are required; ``task`` is optional (``"default"``);
``images``/``audios``/``videos`` default to none (``videos`` fill ``<video>`` placeholders: :mod:`plait.data.video`);
``meta`` is free-form and ignored. Any other field is an error
(:data:`RECORD_FIELDS`), so a misspelt key such as ``"image"`` cannot silently drop the media. A media item
may also be the file's bytes (formats that embed media, such as Parquet: :mod:`plait.data.formats`); such an item
is kept as :class:`MediaBytes`.

Every data format is read through a :class:`RecordSource`: random access to rows ``(record or None, where,
error or None)`` without holding all records (or any media) in memory. :class:`JsonlSource` is this file's
format (byte offsets of its lines); :func:`plait.data.formats.open_source` opens any format by extension or
name. :func:`sample_at` turns row ``i`` of a source into a :class:`RawSample` (or a :class:`SampleError`).
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["RawSample", "SampleError", "MediaBytes", "Row", "RecordSource", "FileSource", "JsonlSource", "ByteRanges",
           "check_index", "file_identity", "sample_at", "read_jsonl", "parse_record", "record_id", "path_note",
           "ROLES", "RECORD_FIELDS"]

ROLES = ("system", "user", "assistant")
RECORD_FIELDS = ("id", "task", "messages", "images", "audios", "videos", "meta")
"""The fields a record may have (module docstring)."""
_UTF8_BOM = b"\xef\xbb\xbf"

Row = tuple[dict[str, Any] | None, str, str | None]
"""One row of a :class:`RecordSource`: ``(record or None, where, error or None)``. ``where`` labels the row in
errors (``"data.jsonl:12"``, ``"data.parquet:row 7"``, ``"llava.json:record 3"``); a row with an ``error`` (a
parse error) is a bad record and its record is ``None``."""


class SampleError(ValueError):
    """A record that cannot be used; the message names the record id and its file and line."""


@dataclass(frozen=True)
class RawSample:
    """One validated conversation with absolute media paths.

    Attributes:
        id: record id (an integer id as its decimal string).
        task: task name used to group validation accuracy.
        messages: ``({"role": ..., "content": ...}, ...)``; roles in :data:`ROLES`, last one is the assistant.
        media: per kind (``"image"``, ``"audio"``, ``"video"``) the items in placeholder order: absolute file paths, or
            :class:`MediaBytes` for media embedded in the data file.
        source: where the record is (``"<jsonl path>:<line>"``, :data:`Row`), for error messages.
    """

    id: str
    task: str
    messages: tuple[dict[str, str], ...]
    media: dict[str, tuple[str | MediaBytes, ...]]
    source: str


class MediaBytes(bytes):
    """The encoded bytes of one embedded media item (a PNG, a WAV, ...), labelled for error messages.

    It is ``bytes`` (equal to the same bytes; :func:`plait.data.processing.load_image` and ``load_audio`` decode
    it like a file); ``str()`` and f-strings give its label, e.g. ``"images[0] of data.parquet:row 7 (embedded,
    5120 bytes)"``, so an error that names a media path names an embedded item just as precisely.
    """

    label: str

    def __new__(cls, data: bytes, label: str) -> MediaBytes:
        obj = super().__new__(cls, data)
        obj.label = label
        return obj

    def __str__(self) -> str:
        return self.label

    __format__ = object.__format__  # f"{item}" -> str(item): the label

    def __repr__(self) -> str:
        return f"MediaBytes({self.label!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (MediaBytes, (bytes(self), self.label))


@runtime_checkable
class RecordSource(Protocol):
    """Random access to the records of one data file, without holding every record (or any media) in memory.

    Attributes:
        name: the source's name in per-source metrics and validation (the mixture entry's ``name``, else the
            file's stem).
        path: the data file.
        base_dir: the folder relative media paths in its records are resolved against (the file's folder).

    ``len(source)`` is the number of rows (blank lines are not rows); ``source[i]`` is row ``i`` as a :data:`Row`
    (raises ``IndexError`` outside ``[0, len)``); :meth:`identity` a JSON-able description of the file for cache
    keys (format, absolute path, size in bytes, mtime in ns: a changed file changes it). Sources are picklable
    (DataLoader workers): open file handles are per process and not pickled.
    """

    name: str
    path: Path
    base_dir: Path

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Row: ...

    def identity(self) -> dict[str, Any]: ...


def file_identity(path: Path, fmt: str) -> dict[str, Any]:
    """``{"format", "path" (absolute), "size" (bytes), "mtime_ns"}`` of a data file, for cache keys."""
    st = path.stat()
    return {"format": fmt, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sample_at(source: RecordSource, index: int) -> RawSample:
    """Row ``index`` of ``source`` as a validated :class:`RawSample` (media resolved against ``source.base_dir``).

    Raises:
        SampleError: for a bad row (``"<where>: <parse error>"``) or a record :func:`parse_record` refuses.
    """
    obj, where, error = source[index]
    if error is not None:
        raise SampleError(f"{where}: {error}")
    return parse_record(obj, where, source.base_dir)


def path_note(path: str | Path) -> str:
    """For a "does not exist" message: ``" (relative to the working directory <cwd>)"`` when ``path`` is
    relative (job-file paths are resolved against the working directory), else ``""``."""
    return "" if Path(path).is_absolute() else f" (relative to the working directory {os.getcwd()})"


class ByteRanges:
    """Reads byte ranges ``[starts[i], starts[i] + lengths[i])`` of one file on demand (``os.pread``); the
    file is opened once per process (a forked or spawned DataLoader worker opens its own; the open handle is
    not pickled). The index of a line- or record-oriented source.

    Args:
        path: the file.
        starts, lengths: ``[n]`` int64 byte offsets and byte lengths.
    """

    def __init__(self, path: Path, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.path, self.starts, self.lengths = path, starts, lengths
        self._fd: int | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, index: int) -> tuple[bytes, int]:
        """``(the bytes of range index, its start offset in the file)``."""
        start = int(self.starts[index])
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return os.pread(self._fd, int(self.lengths[index]), start), start

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_pid": -1}

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)


def check_index(index: int, size: int, path: Path) -> None:
    """Raises ``IndexError`` (naming ``path``) unless ``0 <= index < size``."""
    if not 0 <= index < size:
        raise IndexError(f"{path}: row {index} is out of range (the file has {size} rows)")


class FileSource:
    """What every file-backed :class:`RecordSource` shares: ``path``, ``name`` (default: the file's stem),
    ``base_dir`` (the file's folder, against which relative media paths resolve) and :meth:`identity`.
    Subclasses set ``format`` and index the file after ``super().__init__``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """

    format = ""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"data file {self.path} does not exist{path_note(self.path)}")
        self.name = name or self.path.stem
        self.base_dir = self.path.parent

    def identity(self) -> dict[str, Any]:
        """:func:`file_identity` of the file (format, absolute path, size, mtime), for cache keys."""
        return file_identity(self.path, self.format)


class JsonlSource(FileSource):
    """A JSONL file as a :class:`RecordSource`: one record per line, read on demand through the lines' byte
    offsets (found by one scan at construction; 24 bytes of index per line, nothing else kept).

    Lines end at ``\\n`` only (a trailing ``\\r`` is dropped, so ``\\r\\n`` files read the same): JSON allows
    raw U+2028, U+2029 and U+0085 inside strings, and ``str.splitlines`` would cut a record there. Each line
    is decoded on its own, so a byte that is not UTF-8 makes that one line a bad record (its error gives the
    byte and its offset) instead of stopping the whole file; a UTF-8 byte-order mark at the start of the
    file is ignored. Blank lines are not rows; ``where`` is ``"<path>:<line number>"``.

    Args:
        path: the JSONL file.
        name: the source's name (default: the file's stem).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """

    format = "jsonl"

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        super().__init__(path, name)
        starts, lengths, self._lines = _index_lines(self.path)
        self._ranges = ByteRanges(self.path, starts, lengths)

    def __len__(self) -> int:
        return len(self._ranges)

    def __getitem__(self, index: int) -> Row:
        check_index(index, len(self), self.path)
        raw, start = self._ranges.read(index)
        return _parse_line(raw, start, f"{self.path}:{int(self._lines[index])}")


def _index_lines(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offset, byte length (line end excluded) and 1-based line number of each non-blank line."""
    starts, lengths, lines = array("q"), array("q"), array("q")  # 8 bytes an entry while the file is scanned
    offset = 0  # byte offset of the current line in the file
    with path.open("rb") as f:  # binary iteration splits on b"\n" only
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(_UTF8_BOM):
                raw, start = raw[len(_UTF8_BOM):], start + len(_UTF8_BOM)
            body = raw.rstrip(b"\r\n")
            if not _blank(body):
                starts.append(start)
                lengths.append(len(body))
                lines.append(lineno)
    return tuple(np.frombuffer(a, dtype=np.int64) for a in (starts, lengths, lines))  # type: ignore[return-value]


def _blank(raw: bytes) -> bool:
    """Whether a line is blank as text (``str.strip`` leaves nothing); an undecodable line is not blank."""
    body = raw.strip()
    if not body:
        return True
    if body[0] < 0x80 and body[0] not in b"\x1c\x1d\x1e\x1f":  # ASCII, and not whitespace to str.strip
        return False
    try:
        return not raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def read_jsonl(path: str | Path) -> list[Row]:
    """All rows of a JSONL file, ``(record or None, "file:line", error or None)``, blank lines skipped (the
    rules of :class:`JsonlSource`).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    source = JsonlSource(path)
    return [source[i] for i in range(len(source))]


def _parse_line(raw: bytes, start: int, where: str) -> Row:
    """One non-blank line's :data:`Row`. ``start``: the line's byte offset in the file (for the error of an
    undecodable byte)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, where, (f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset {exc.start} of the "
                             f"line ({start + exc.start} of the file); the data file must be UTF-8")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, where, f"invalid JSON: {exc.msg}"
    if not isinstance(obj, dict):
        return None, where, "record is not a JSON object"
    return obj, where, None


def parse_record(obj: dict[str, Any], where: str, base_dir: str | Path) -> RawSample:
    """Validate one record and resolve its media paths against ``base_dir`` (a media item given as ``bytes``,
    from a format that embeds media, becomes :class:`MediaBytes`).

    Raises:
        SampleError: for a missing or malformed ``id``, a field not in :data:`RECORD_FIELDS`, an empty or
            malformed conversation, an unknown role, a non-string content, no assistant turn at the end, a
            malformed media list, or nothing to answer (no media and only empty messages before the answer); the
            message names the record (when it has an id) and its file and line.
    """
    rid = record_id(obj, where)
    label = f"record {rid!r} ({where})"
    unknown = [k for k in obj if k not in RECORD_FIELDS]
    if unknown:
        raise SampleError(f"{label}: unknown field {unknown[0]!r}; a record's fields are {', '.join(RECORD_FIELDS)}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SampleError(f"{label}: 'messages' must be a non-empty list")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise SampleError(f"{label}: message {i} needs 'role' and 'content'")
        if msg["role"] not in ROLES:
            raise SampleError(f"{label}: message {i} has unknown role {msg['role']!r}; expected one of {ROLES}")
        if not isinstance(msg["content"], str):
            raise SampleError(f"{label}: message {i} content must be a string")
        clean.append({"role": msg["role"], "content": msg["content"]})
    if clean[-1]["role"] != "assistant":
        raise SampleError(f"{label}: the last message must be the assistant's answer")
    media = {}
    for modality, key in (("image", "images"), ("audio", "audios"), ("video", "videos")):
        items = obj.get(key, []) or []
        if not isinstance(items, list) or not all(isinstance(p, (str, bytes)) for p in items):
            raise SampleError(f"{label}: {key!r} must be a list of file paths")
        media[modality] = tuple(_media_item(p, f"{key}[{j}] of {where}", base_dir) for j, p in enumerate(items))
    if not any(media.values()) and not any(m["content"].strip() for m in clean if m["role"] != "assistant"):
        raise SampleError(f"{label}: nothing to answer: every message before the answer is empty and the record has "
                          "no images, audios or videos")
    return RawSample(rid, str(obj.get("task", "default")), tuple(clean), media, where)


def _media_item(item: str | bytes, label: str, base_dir: str | Path) -> str | MediaBytes:
    """A path resolved against ``base_dir``, or embedded bytes as :class:`MediaBytes` labelled ``label``."""
    if isinstance(item, bytes):
        return item if isinstance(item, MediaBytes) else MediaBytes(item, f"{label} (embedded, {len(item)} bytes)")
    return str(Path(base_dir) / item)


def record_id(obj: dict[str, Any], where: str) -> str:
    """The record's ``id`` as a string.

    Raises:
        SampleError: when ``id`` is missing, empty, or not a string or an integer (naming ``where``).
    """
    rid = obj.get("id")
    if isinstance(rid, str) and rid.strip():
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool):
        return str(rid)
    got = "no 'id'" if "id" not in obj else f"'id' = {json.dumps(rid)}"
    raise SampleError(f"record at {where}: {got}; every record needs an 'id', a non-empty string or an integer")
