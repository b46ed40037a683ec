"""TOML text of plain data: the one writer of plan snippets, LoRA rank tables and job files.

:func:`toml_text` writes a mapping as TOML lines, optionally under a ``[table]`` header: nested mappings as dotted
keys (``train.steps = 1``) or, with ``inline``, as inline tables (``splits = { llm = ["llm.4"] }``); ``None``
values are left out. :func:`toml_value` writes one value (TOML 1.0: basic strings, integers, floats, booleans,
arrays, inline tables). Pure: no files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["toml_key", "toml_text", "toml_value"]


def toml_key(key: str) -> str:
    """A bare key when TOML allows one (letters, digits, ``_``, ``-``), else a quoted key."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def toml_value(value: Any, *, floats: bool = False) -> str:
    """TOML text of a bool, an int, a string, a list or tuple, or a mapping (inline table) of them; finite floats
    too with ``floats`` (``repr``, which TOML reads back exactly).

    Raises:
        ValueError: on another type (a float without ``floats``, None) or a float that is not finite.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and floats:
        if not math.isfinite(value):
            raise ValueError(f"no TOML form for {value!r} here")
        return repr(float(value))
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string (ASCII, escaped) is a TOML basic string
    if isinstance(value, Mapping):
        items = ", ".join(f"{toml_key(k)} = {toml_value(v, floats=floats)}" for k, v in value.items())
        return f"{{ {items} }}" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, floats=floats) for v in value) + "]"
    raise ValueError(f"no TOML form for {value!r} here")


def toml_text(data: Mapping[str, Any], *, table: str | None = None, inline: bool = False) -> str:
    """``data`` as TOML lines (each ending in a newline), under a ``[table]`` header when ``table`` is given.

    Nested non-empty mappings become dotted keys (``a.b = 1``), or inline tables with ``inline``; an empty mapping
    is ``{}``; ``None`` values are left out; floats are written (``toml_value(floats=True)``).

    Raises:
        ValueError: on a value ``toml_value`` has no form for.
    """
    lines = [f"[{table}]"] if table is not None else []
    lines += _lines(data, "", inline)
    return "".join(line + "\n" for line in lines)


def _lines(data: Mapping[str, Any], prefix: str, inline: bool) -> list[str]:
    out = []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, Mapping) and value and not inline:
            out += _lines(value, f"{prefix}{toml_key(key)}.", inline)
        else:
            out.append(f"{prefix}{toml_key(key)} = {toml_value(value, floats=True)}")
    return out
