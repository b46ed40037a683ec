"""Records in the common conversation format (JSONL) -> validated raw samples.

One record per line (UTF-8, lines ending at ``\\n``; see :func:`read_jsonl`)::

    {"id": "img-1", "task": "image_digit",
     "messages": [{"role": "user", "content": "<image>\\nWhich digit is this?"},
                  {"role": "assistant", "content": "seven"}],
     "images": ["img/0001.png"], "audios": []}

Media paths are relative to the JSONL file's folder (absolute paths are kept). ``id`` (a non-empty string or
an integer, unique in the file) and ``messages`` are required; ``task`` is optional (``"default"``);
``images``/``audios`` default to none; ``meta`` is free-form and ignored. Any other field is an error
(:data:`RECORD_FIELDS`), so a misspelt key such as ``"image"`` cannot silently drop the media.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RawSample", "SampleError", "read_jsonl", "parse_record", "record_id", "path_note", "ROLES",
           "RECORD_FIELDS"]

ROLES = ("system", "user", "assistant")
RECORD_FIELDS = ("id", "task", "messages", "images", "audios", "meta")
"""The fields a record may have (module docstring)."""
_UTF8_BOM = b"\xef\xbb\xbf"


class SampleError(ValueError):
    """A record that cannot be used; the message names the record id and its file and line."""


@dataclass(frozen=True)
class RawSample:
    """One validated conversation with absolute media paths.

    Attributes:
        id: record id (an integer id as its decimal string).
        task: task name used to group validation accuracy.
        messages: ``({"role": ..., "content": ...}, ...)``; roles in :data:`ROLES`, last one is the assistant.
        media: per modality (``"image"``, ``"audio"``) the absolute file paths, in placeholder order.
        source: ``"<jsonl path>:<line>"`` for error messages.
    """

    id: str
    task: str
    messages: tuple[dict[str, str], ...]
    media: dict[str, tuple[str, ...]]
    source: str


def path_note(path: str | Path) -> str:
    """For a "does not exist" message: ``" (relative to the working directory <cwd>)"`` when ``path`` is
    relative (job-file paths are resolved against the working directory), else ``""``."""
    return "" if Path(path).is_absolute() else f" (relative to the working directory {os.getcwd()})"


def read_jsonl(path: str | Path) -> list[tuple[dict[str, Any] | None, str, str | None]]:
    """Lines of a JSONL file as ``(record or None, "file:line", error or None)``, blank lines skipped.

    Lines end at ``\\n`` only (a trailing ``\\r`` is dropped, so ``\\r\\n`` files read the same): JSON allows
    raw U+2028, U+2029 and U+0085 inside strings, and ``str.splitlines`` would cut a record there. Each line
    is decoded on its own, so a byte that is not UTF-8 makes that one line a bad record (its error gives the
    byte and its offset) instead of stopping the whole file; a UTF-8 byte-order mark at the start of the
    file is ignored.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist{path_note(path)}")
    rows = []
    offset = 0  # byte offset of the current line in the file
    with path.open("rb") as f:  # binary iteration splits on b"\n" only
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(_UTF8_BOM):
                raw, start = raw[len(_UTF8_BOM):], start + len(_UTF8_BOM)
            row = _parse_line(raw.rstrip(b"\r\n"), start, f"{path}:{lineno}")
            if row is not None:
                rows.append(row)
    return rows


def _parse_line(raw: bytes, start: int, where: str) -> tuple[dict[str, Any] | None, str, str | None] | None:
    """One line's ``(record or None, where, error or None)``; ``None`` for a blank line. ``start``: the
    line's byte offset in the file (for the error of an undecodable byte)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, where, (f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at byte offset {exc.start} of the "
                             f"line ({start + exc.start} of the file); the data file must be UTF-8")
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, where, f"invalid JSON: {exc.msg}"
    if not isinstance(obj, dict):
        return None, where, "record is not a JSON object"
    return obj, where, None


def parse_record(obj: dict[str, Any], where: str, base_dir: str | Path) -> RawSample:
    """Validate one record and resolve its media paths against ``base_dir``.

    Raises:
        SampleError: for a missing or malformed ``id``, a field not in :data:`RECORD_FIELDS`, an empty or
            malformed conversation, an unknown role, a non-string content, no assistant turn at the end, or a
            malformed media list; the message names the record (when it has an id) and its file and line.
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
    for modality, key in (("image", "images"), ("audio", "audios")):
        paths = obj.get(key, []) or []
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise SampleError(f"{label}: {key!r} must be a list of file paths")
        media[modality] = tuple(str(Path(base_dir) / p) for p in paths)
    return RawSample(rid, str(obj.get("task", "default")), tuple(clean), media, where)


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
