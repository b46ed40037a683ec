"""The keys a job's ``[model.encoders.<name>.processor]`` table may set: those its Hugging Face processor class knows.

transformers' image processors and feature extractors take any keyword and keep an unknown one as an attribute
that nothing reads, so a misspelt key (``max_pixel`` for Qwen2.5-VL's ``max_pixels``) would train with the default
silently. :func:`check_processor_table` refuses such a key when the job is built, with the close matches, and a
value of the wrong type (``max_pixels = "abc"``) naming the field and the type the class declares
(:func:`processor_types`), before any family check does arithmetic on it.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["PLAIT_KEYS", "processor_keys", "processor_types", "expected_type", "check_processor_table"]

PLAIT_KEYS = frozenset({"class"})
"""Keys plait reads itself from the table (``class``: which transformers class to build)."""


def processor_keys(cls: type) -> frozenset[str]:
    """Every setting processor class ``cls`` knows: its typed ``valid_kwargs`` (transformers' image processors),
    the named parameters of every ``__init__`` in its MRO (feature extractors), and the attributes a default
    instance serialises (``to_dict``)."""
    keys: set[str] = set()
    valid = getattr(cls, "valid_kwargs", None)
    keys.update(getattr(valid, "__annotations__", {}) or {})
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is not None:
            keys.update(name for name, p in inspect.signature(init).parameters.items()
                        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    try:
        keys.update(cls().to_dict())
    except Exception:  # a class that needs arguments: its signature and valid_kwargs above are what it takes
        pass
    return frozenset(keys)


def check_processor_table(processor: Any, table: Mapping[str, Any]) -> None:
    """Refuse a key of ``table`` (a job's processor table) that ``processor``'s class does not know
    (:func:`processor_keys`) and plait does not read (:data:`PLAIT_KEYS`).

    Raises:
        ValueError: ``processor.<key>: <class> has no such setting (did you mean ...?)``, the close matches from
            ``difflib.get_close_matches`` (or the known keys when none is close); ``processor.<key>: expected an
            integer, got 'abc'`` for a value of another type than the class declares (:func:`expected_type`); the
            caller prefixes the branch.
    """
    known = processor_keys(type(processor)) | PLAIT_KEYS
    declared = processor_types(type(processor))
    for key in table:
        if key in known:
            wanted = expected_type(declared.get(key), table[key])
            if wanted is not None:
                raise ValueError(f"processor.{key}: expected {wanted}, got {table[key]!r}")
            continue
        close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        hint = (f"did you mean {' or '.join(close)}?" if close
                else f"its settings: {', '.join(sorted(k for k in known if not k.startswith('_')))}")
        raise ValueError(f"processor.{key}: {type(processor).__name__} has no such setting ({hint})")


def processor_types(cls: type) -> dict[str, Any]:
    """The type each setting of processor class ``cls`` declares: the annotations of its typed ``valid_kwargs``
    (transformers' image processors: ``max_pixels: int``), else of its ``__init__`` parameters, else the type of a
    parameter's ``bool``/``int``/``float``/``str`` default (feature extractors: ``hop_length=160``); the most derived
    class first. A setting with none is absent (not checked)."""
    found: dict[str, Any] = {}
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        for name, p in inspect.signature(init).parameters.items():
            if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in found:
                continue
            if p.annotation is not p.empty:
                found[name] = p.annotation
            elif type(p.default) in (bool, int, float, str):
                found[name] = type(p.default)
    valid = getattr(cls, "valid_kwargs", None)
    return found | dict(getattr(valid, "__annotations__", {}) or {})


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          tuple: "a list", dict: "a table"}


def expected_type(annotation: Any, value: Any) -> str | None:
    """None when ``value`` (a job's TOML value) fits ``annotation`` (a type, ``X | None``, ``Annotated[X, ...]``,
    ``list[int]``...) or the annotation is one plait cannot judge (a string, a forward reference, an enum, a
    class of its own); else what was expected, in words (``"an integer"``, ``"an integer or a list or a
    table"``): ``int`` takes no ``bool``, ``float`` takes an integer too, ``tuple`` takes a list (TOML has no
    tuple)."""
    options = _options(annotation)
    if options is None:
        return None
    if any(_fits(o, value) for o in options):
        return None
    words = list(dict.fromkeys(_NAMES[o] for o in options if o is not type(None)))
    return " or ".join(words) if words else None


def _options(annotation: Any) -> list[type] | None:
    """The plain types an annotation allows (``Annotated`` unwrapped, unions flattened, ``list[int]`` as
    ``list``), or None when one of them is not a plain TOML type (then nothing is checked)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _options(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        parts = [_options(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]  # type: ignore[union-attr]
    if origin is not None:
        annotation = origin
    if annotation is type(None) or annotation in _NAMES:
        return [annotation]
    return None  # Any, a string or forward reference, an enum, a class of its own


def _fits(kind: type, value: Any) -> bool:
    """Whether a TOML value is of the plain type ``kind`` (module rules of :func:`expected_type`)."""
    if kind is type(None):
        return value is None
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind in (list, tuple):
        return isinstance(value, (list, tuple))
    return isinstance(value, kind)
