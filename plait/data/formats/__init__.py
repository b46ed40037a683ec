"""Data formats: open any data file as a :class:`plait.data.sources.RecordSource`.

===========  ===============================  ===========================================================
format       extensions                       reader
===========  ===============================  ===========================================================
``jsonl``    ``.jsonl``                       :class:`plait.data.sources.JsonlSource` (plait's record
                                              format, one per line; media paths relative to the file)
``llava``    ``.json``                        :class:`plait.data.formats.llava.LlavaSource` (one array of
                                              LLaVA records: ``conversations``, ``image``,
                                              ``video``, ``id``)
``parquet``  ``.parquet``                     :class:`plait.data.formats.arrow.ArrowSource` (one row per
                                              record, media bytes embedded)
``arrow``    ``.arrow``, ``.feather``         the same, Arrow IPC (memory-mapped)
===========  ===============================  ===========================================================

The format follows from the file's extension, or is given explicitly (``format`` of a ``[[data.sources]]``
entry).
"""

from __future__ import annotations

from pathlib import Path

from plait.data.formats.arrow import ArrowSource
from plait.data.formats.llava import LlavaSource
from plait.data.sources import JsonlSource, RecordSource

__all__ = ["FORMATS", "format_of", "open_source"]

FORMATS: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl",),
    "llava": (".json",),
    "parquet": (".parquet",),
    "arrow": (".arrow", ".feather"),
}
"""Format name -> the file extensions that select it."""


def format_of(path: str | Path, fmt: str | None = None) -> str:
    """The format of ``path``: ``fmt`` when given, else the one its extension selects (:data:`FORMATS`).

    Raises:
        ValueError: for an unknown ``fmt``, or an extension no format claims (naming the path).
    """
    if fmt:
        if fmt not in FORMATS:
            raise ValueError(f"unknown data format {fmt!r} for {path}; known formats: {', '.join(FORMATS)}")
        return fmt
    suffix = Path(path).suffix.lower()
    for name, extensions in FORMATS.items():
        if suffix in extensions:
            return name
    known = ", ".join(f"{e} ({n})" for n, exts in FORMATS.items() for e in exts)
    raise ValueError(f"cannot tell the format of data file {path} from its extension {suffix!r}: known {known}; "
                     "give the format explicitly")


def open_source(path: str | Path, fmt: str | None = None, name: str | None = None) -> RecordSource:
    """Open a data file as a :class:`RecordSource` of format ``fmt`` (default: from the extension).

    Args:
        path: the data file.
        fmt: a key of :data:`FORMATS`, or None.
        name: the source's name (per-source metrics); default: the file's stem.

    Raises:
        FileNotFoundError: when the file does not exist.
        ValueError: for an unknown format (:func:`format_of`) or a file the format's reader refuses.
    """
    kind = format_of(path, fmt)
    if kind == "jsonl":
        return JsonlSource(path, name=name)
    if kind == "llava":
        return LlavaSource(path, name=name)
    return ArrowSource(path, format=kind, name=name)
