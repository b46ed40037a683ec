"""LLaVA-style JSON: one JSON array of conversation records, as LLaVA's instruction sets ship them::

    [{"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
      "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                        {"from": "gpt", "value": "The bus is white and red."}]},
     {"id": "sharegpt-17", "model": "", "conversations": [...]}]

Mapping to plait's record (:mod:`plait.data.sources`): ``id`` -> ``id``; each turn ``from`` ``human`` / ``gpt`` /
``system`` -> ``role`` ``user`` / ``assistant`` / ``system``, ``value`` -> ``content`` (``<image>`` stays the
placeholder); ``image`` (one path, or a list of paths, relative to the JSON file's folder) -> ``images``;
``video`` (the same) -> ``videos`` with ``<video>`` placeholders; ``model`` is ignored (LLaVA's text-only records
carry it); any other field is an error. The ``<image>`` (``<video>``) placeholders of the human turns must match the
images (videos) in number, and no other turn may hold one. A record with videos, no images and no ``<video>``
placeholder whose ``<image>`` placeholders match its videos in number (LLaVA-Video's convention) has them read as
``<video>``. ``task`` is ``"default"``. A row is labelled ``"<path>:record <index>"`` (0-based index in the array)
and its errors name the field (``conversations[3].from``).
"""

from __future__ import annotations

import json
import mmap
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from plait.data.sources import ByteRanges, FileSource, Row, check_index

__all__ = ["LlavaSource", "llava_record", "LLAVA_FIELDS", "LLAVA_ROLES"]

LLAVA_FIELDS = ("id", "image", "video", "conversations", "model")
"""The fields a LLaVA record may have (``model`` is ignored)."""
LLAVA_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""LLaVA's ``from`` -> plait's ``role``."""
IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class LlavaSource(FileSource):
    """A LLaVA-style JSON file (module docstring) as a :class:`plait.data.sources.RecordSource`.

    Construction scans the array once for each record's byte range (a sliding window of the memory-mapped file,
    16 MiB at a time); a record is read, parsed and mapped when it is asked for.

    Args:
        path: the JSON file.
        name: the source's name (default: the file's stem).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file is not one JSON array (naming the byte offset and the record where it breaks).
    """

    format = "llava"

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        super().__init__(path, name)
        self._ranges = ByteRanges(self.path, *_index_array(self.path))

    def __len__(self) -> int:
        return len(self._ranges)

    def __getitem__(self, index: int) -> Row:
        check_index(index, len(self), self.path)
        raw, _ = self._ranges.read(index)
        where = f"{self.path}:record {index}"
        try:
            return llava_record(json.loads(raw.decode("utf-8"))), where, None
        except UnicodeDecodeError as exc:
            return None, where, (f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset {exc.start} of the "
                                 "record; the data file must be UTF-8")
        except ValueError as exc:
            return None, where, str(exc)


_WINDOW = 1 << 24  # bytes of the file decoded at a time by the index scan (16 MiB; doubled for a longer record)


class _Window:
    """A stretch of a memory-mapped file decoded as Latin-1 (one character per byte, so string offsets are byte
    offsets; UTF-8's multi-byte sequences never contain JSON's structural characters)."""

    def __init__(self, data: mmap.mmap | bytes, size: int) -> None:
        self.data, self.size, self.width = data, size, _WINDOW
        self.load(0)

    def load(self, base: int) -> None:
        self.base = base
        self.text = self.data[base : base + self.width].decode("latin-1")

    @property
    def at_eof(self) -> bool:
        return self.base + len(self.text) >= self.size

    def skip(self, pos: int) -> int:
        return _WHITESPACE.match(self.text, pos).end()


class _Short(Exception):
    """A record, or what follows it, runs past the end of the decoded window."""


def _index_array(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets and byte lengths of the elements of the JSON array in ``path``, scanned with the standard
    decoder's ``raw_decode`` over a sliding window of the memory-mapped file (memory: the window, not the file).

    Raises:
        ValueError: when the file is not a JSON array (naming the byte offset and the record where it breaks).
    """
    size = path.stat().st_size
    with path.open("rb") as f, (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else _empty()) as data:
        win = _Window(data, size)
        pos = win.skip(3 if win.text.startswith("\xef\xbb\xbf") else 0)
        if not win.text.startswith("[", pos):
            raise ValueError(f"{path}: a LLaVA-style JSON file is one array of records; it does not start with '[' "
                             "(one record per line is JSONL: name the file .jsonl or give format = \"jsonl\")")
        pos = win.skip(pos + 1)
        starts, lengths = array("q"), array("q")
        if win.text.startswith("]", pos):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        decoder = json.JSONDecoder()
        while True:
            try:
                _, end = decoder.raw_decode(win.text, pos)
                after = win.skip(end)
                if after >= len(win.text):
                    raise _Short
            except (json.JSONDecodeError, _Short) as exc:
                if not win.at_eof:  # the record runs past the window: move the window to its start (and widen it)
                    win.width *= 2 if pos == 0 else 1
                    win.load(win.base + pos)
                    pos = 0
                    continue
                at = win.base + (exc.pos if isinstance(exc, json.JSONDecodeError) else len(win.text))
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "the file ends before the closing ']'"
                raise ValueError(f"{path}: invalid JSON in record {len(starts)} at byte {at}: {reason}") from exc
            starts.append(win.base + pos)
            lengths.append(end - pos)
            if win.text[after] == "]":
                return np.frombuffer(starts, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64)
            if win.text[after] != ",":
                raise ValueError(f"{path}: expected ',' or ']' after record {len(starts) - 1} at byte "
                                 f"{win.base + after}")
            pos = win.skip(after + 1)


class _empty:
    """Context manager standing in for the mmap of an empty file."""

    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *exc: object) -> None:
        return None


def llava_record(obj: Any) -> dict[str, Any]:
    """One LLaVA record as a plait record (module docstring: the mapping).

    Raises:
        ValueError: naming the field: not an object, an unknown field, no ``conversations`` list, a turn
            without ``from``/``value``, an unknown ``from``, a non-string ``value``, a malformed ``image``, or
            ``<image>`` / ``<video>`` placeholders that do not match the images / videos (count, or one outside a
            human turn).
    """
    if not isinstance(obj, dict):
        raise ValueError("record is not a JSON object")
    unknown = [k for k in obj if k not in LLAVA_FIELDS]
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; a LLaVA record's fields are {', '.join(LLAVA_FIELDS)}")
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError("'conversations' must be a non-empty list of {from, value} turns")
    messages = [_turn(turn, i) for i, turn in enumerate(turns)]
    images, videos = _paths(obj.get("image"), "image"), _paths(obj.get("video"), "video")
    if videos and not images and not _count(messages, VIDEO_TOKEN) and _count(messages, IMAGE_TOKEN) == len(videos):
        messages = [{**m, "content": m["content"].replace(IMAGE_TOKEN, VIDEO_TOKEN)} for m in messages]
    _check_placeholders(turns, messages, IMAGE_TOKEN, len(images), "image")
    _check_placeholders(turns, messages, VIDEO_TOKEN, len(videos), "video")
    record = {"messages": messages, "images": images, **({"videos": videos} if videos else {})}
    if "id" in obj:
        record = {"id": obj["id"], **record}
    return record


def _turn(turn: Any, i: int) -> dict[str, str]:
    """``conversations[i]`` as ``{"role", "content"}``."""
    if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
        raise ValueError(f"conversations[{i}] needs 'from' and 'value'")
    if turn["from"] not in LLAVA_ROLES:
        raise ValueError(f"conversations[{i}].from is {turn['from']!r}; expected one of {', '.join(LLAVA_ROLES)}")
    if not isinstance(turn["value"], str):
        raise ValueError(f"conversations[{i}].value must be a string")
    return {"role": LLAVA_ROLES[turn["from"]], "content": turn["value"]}


def _paths(value: Any, key: str) -> list[str]:
    """The ``image`` / ``video`` field ``key`` (absent, one path, or a list of paths) as a list of paths."""
    if value is None:
        return []
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and all(isinstance(p, str) and p for p in value):
        return list(value)
    raise ValueError(f"'{key}' must be a file path or a list of file paths, got {json.dumps(value)[:80]}")


def _count(messages: list[dict[str, str]], token: str) -> int:
    return sum(m["content"].count(token) for m in messages)


def _check_placeholders(turns: list[dict], messages: list[dict[str, str]], token: str, n_items: int,
                        key: str) -> None:
    """``token`` appears only in human turns, as often as there are items in field ``key``."""
    count = 0
    for i, msg in enumerate(messages):
        n = msg["content"].count(token)
        if n and msg["role"] != "user":
            raise ValueError(f"conversations[{i}] ({turns[i]['from']}) holds {token}; only human turns may")
        count += n
    if count != n_items:
        raise ValueError(f"{count} {token} placeholder(s) in conversations but {n_items} {key}(s) in '{key}'")
