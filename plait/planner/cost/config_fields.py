"""Reading fields of a model config: a Hugging Face config object or a plain dict alike (``arch``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MISSING", "config_field", "config_model_type", "config_pair", "positive_field"]

MISSING = object()
"""The default of :func:`config_field`: the field is required."""


def config_model_type(config: Any) -> str:
    """The config's ``model_type`` (``""`` when absent)."""
    value = config.get("model_type", "") if isinstance(config, Mapping) else getattr(config, "model_type", "")
    return str(value or "")


def config_field(config: Any, name: str, default: Any = MISSING) -> Any:
    """``config.name`` for a config object or ``config[name]`` for a dict; ``default`` when absent or None.

    Raises:
        ValueError: when the field is absent (or None) and no default is given.
    """
    if isinstance(config, Mapping):
        value = config.get(name, None)
    else:
        try:
            value = getattr(config, name, None)
        except AttributeError:
            value = None
    if value is None:
        if default is MISSING:
            raise ValueError(f"config (model_type {config_model_type(config)!r}) lacks required field {name!r}")
        return default
    return value


def config_pair(value: Any, name: str) -> tuple[int, int]:
    """An int or a pair of ints (``patch_size``, ``image_size``) as a pair.

    Raises:
        ValueError: on a sequence that is not a pair.
    """
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"config field {name!r} must be an int or a pair, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def positive_field(config: Any, name: str, default: Any = MISSING) -> int:
    """:func:`config_field` as an int > 0.

    Raises:
        ValueError: when absent without a default, or not > 0.
    """
    value = int(config_field(config, name, default))
    if value <= 0:
        raise ValueError(f"config (model_type {config_model_type(config)!r}) field {name!r} must be > 0, got {value}")
    return value
