"""The keys a job's ``[model.encoders.<name>.processor]`` table may set: those its Hugging Face processor class knows.

transformers' image processors and feature extractors take any keyword and keep an unknown one as an attribute
that nothing reads, so a misspelt key (``max_pixel`` for Qwen2.5-VL's ``max_pixels``) would train with the default
silently. :func:`check_processor_table` refuses such a key when the job is built, with the close matches.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

__all__ = ["PLAIT_KEYS", "processor_keys", "check_processor_table"]

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
            ``difflib.get_close_matches`` (or the known keys when none is close); the caller prefixes the branch.
    """
    known = processor_keys(type(processor)) | PLAIT_KEYS
    for key in table:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
        hint = (f"did you mean {' or '.join(close)}?" if close
                else f"its settings: {', '.join(sorted(k for k in known if not k.startswith('_')))}")
        raise ValueError(f"processor.{key}: {type(processor).__name__} has no such setting ({hint})")
