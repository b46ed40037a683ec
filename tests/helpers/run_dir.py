"""Helpers of several test modules, taken from tests/unit/train/test_run_dir.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import json


def toml_text(data: dict, prefix: str = "") -> str:
    """``data`` (nested dicts of TOML values; None dropped) as TOML text."""
    scalars = {k: v for k, v in data.items() if v is not None and not isinstance(v, dict)}
    lines = [f"[{prefix}]"] if prefix and scalars else []
    lines += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    text = "\n".join(lines) + "\n" if lines else ""
    for k, v in data.items():
        if isinstance(v, dict):
            text += toml_text(v, f"{prefix}.{k}" if prefix else k)
    return text
