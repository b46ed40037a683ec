"""One JSON round trip for the planner's frozen dataclasses.

A plan is data: it is cached on disk, compared in tests and read by the runtime, so every planner dataclass
turns into plain JSON values and back. Instead of a hand-written ``to_dict``/``from_dict`` pair per class,
both directions are driven by the class itself:

- :func:`dataclass_to_dict`: the fields in declaration order, recursively: a nested dataclass becomes its
  dict (its own ``to_dict`` if it has one), tuples and lists become lists, mappings keep their keys (``json``
  writes int keys as strings), numpy scalars become Python numbers. The result is what
  ``json.dumps(dataclasses.asdict(obj))`` writes, so files written before stay readable and byte-identical.
- :func:`dataclass_from_dict`: the inverse, guided by the fields' type hints: ``tuple[X, ...]``,
  ``tuple[X, Y]``, ``list[X]``, ``dict[K, V]`` (string keys turned back into ``int``/``float`` keys when
  ``K`` says so), ``X | None`` and other unions, and nested dataclasses (through their ``from_dict``).
  Scalars are passed as they are (JSON keeps ints and floats apart); the class's ``__post_init__`` then
  validates. Unknown and missing fields are named in a ``ValueError``.

To serialise a class, derive it from :class:`JsonDataclass` (and drop its own ``to_dict``/``from_dict``)::

    @dataclass(frozen=True)
    class Stage(JsonDataclass):
        index: int
        units: tuple[str, ...]

A class whose JSON form must differ from its fields (a renamed or derived key, a format version) keeps its
own methods and may still call the two functions for the plain part.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

__all__ = ["JsonDataclass", "dataclass_from_dict", "dataclass_to_dict", "to_json_value"]

T = TypeVar("T")


def dataclass_to_dict(obj: Any) -> dict[str, Any]:
    """JSON-ready dict of dataclass instance ``obj`` (module docstring), fields in declaration order.

    Raises:
        ValueError: when ``obj`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise ValueError(f"dataclass_to_dict needs a dataclass instance, got {type(obj).__name__}")
    return {f.name: to_json_value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def to_json_value(value: Any) -> Any:
    """``value`` as plain JSON data: dataclasses to dicts (their ``to_dict`` when they have one), tuples
    and lists to lists, mappings to dicts with the same keys, numpy scalars and arrays to Python values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_dict() if callable(to_dict) else dataclass_to_dict(value)
    if isinstance(value, Mapping):
        return {k: to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value


def dataclass_from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build dataclass ``cls`` from ``data`` (a :func:`dataclass_to_dict` result, possibly through JSON).

    Each field's value is converted by the field's type hint (module docstring); values already of the
    target type pass unchanged, so the function also accepts a dict of finished objects.

    Raises:
        ValueError: naming the unknown or missing fields of ``cls``, or when ``cls`` rejects the values
            (its ``__post_init__`` errors pass through).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{cls.__name__}: expected a JSON object (dict), got {type(data).__name__}")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{cls.__name__}: missing field(s) {missing}")
    hints = _hints(cls)
    kwargs = {name: _decode(hints.get(name, Any), value) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from exc


class JsonDataclass:
    """Mixin giving a dataclass ``to_dict``/``from_dict``/``to_json``/``from_json`` by the rules above."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields (:func:`dataclass_to_dict`)."""
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        """Inverse of ``to_dict`` (:func:`dataclass_from_dict`).

        Raises:
            ValueError: on unknown or missing fields, or values the class rejects.
        """
        return dataclass_from_dict(cls, data)

    def to_json(self, **kwargs: Any) -> str:
        """JSON text of ``to_dict()`` (``kwargs`` go to ``json.dumps``, e.g. ``indent=2``)."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        """Inverse of ``to_json``.

        Raises:
            ValueError: on invalid JSON or fields, as ``from_dict``.
        """
        return cls.from_dict(json.loads(text))  # type: ignore[attr-defined]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of ``cls``'s fields (``from __future__ import annotations`` strings included);
    empty when a hint names something its module does not define at run time (values then pass unchanged)."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        return {}


def _decode(hint: Any, value: Any) -> Any:
    """``value`` (JSON data) converted to the type ``hint`` describes, as far as its structure goes."""
    if value is None or hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _decode_union(args, value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint) or not isinstance(value, Mapping):
            return value
        from_dict = getattr(hint, "from_dict", None)
        return from_dict(value) if callable(from_dict) else dataclass_from_dict(hint, value)
    if origin is tuple or hint is tuple:
        return _decode_tuple(args, value)
    if origin is list and isinstance(value, (list, tuple)):
        return [_decode(args[0] if args else Any, v) for v in value]
    if origin in (dict, Mapping) and isinstance(value, Mapping):
        key, item = args if args else (Any, Any)
        return {_decode_key(key, k): _decode(item, v) for k, v in value.items()}
    return value


def _decode_union(args: tuple[Any, ...], value: Any) -> Any:
    """A union: the first member whose shape ``value`` has (object -> dataclass, array -> tuple/list)."""
    members = [a for a in args if a is not type(None)]
    if len(members) == 1:
        return _decode(members[0], value)
    for member in members:
        base = typing.get_origin(member) or member
        if isinstance(value, Mapping) and dataclasses.is_dataclass(base):
            return _decode(member, value)
        if isinstance(value, (list, tuple)) and base in (tuple, list):
            return _decode(member, value)
    return value


def _decode_tuple(args: tuple[Any, ...], value: Any) -> Any:
    """``tuple[X, ...]`` (every item ``X``), ``tuple[X, Y]`` (per position) or a bare ``tuple``."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v) for v in value)
    if args and len(args) == len(value):
        return tuple(_decode(a, v) for a, v in zip(args, value))
    return tuple(value)


def _decode_key(hint: Any, key: Any) -> Any:
    """A mapping key: JSON writes every key as a string, so ``int``/``float`` keys are parsed back."""
    if isinstance(key, str) and hint in (int, float):
        try:
            return hint(key)
        except ValueError:
            return key
    return key
