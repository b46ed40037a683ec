"""Records in the common conversation format (JSONL) -> validated raw samples.

One record per line::

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

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist{path_note(path)}")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            rows.append((None, where, f"invalid JSON: {exc.msg}"))
            continue
        if not isinstance(obj, dict):
            rows.append((None, where, "record is not a JSON object"))
            continue
        rows.append((obj, where, None))
    return rows


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
