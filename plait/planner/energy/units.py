"""The one unit per quantity of ``plait energy``'s outputs (table, frontier plot, timeline titles): times in
milliseconds, energies in joules. Pure."""

from __future__ import annotations

__all__ = ["ENERGY_UNIT", "TIME_SCALE", "TIME_UNIT", "format_energy", "format_time"]

TIME_UNIT = "ms"
"""Unit of iteration and action times shown to people."""
TIME_SCALE = 1e3
"""``TIME_UNIT`` per second."""
ENERGY_UNIT = "J"
"""Unit of energies shown to people (joules: 1 W for 1 s)."""


def format_time(seconds: float) -> str:
    """``seconds`` in ``TIME_UNIT``, four significant digits: ``format_time(0.0002475) == "0.2475 ms"``."""
    return f"{seconds * TIME_SCALE:.4g} {TIME_UNIT}"


def format_energy(joules: float) -> str:
    """``joules`` in ``ENERGY_UNIT``, five significant digits: ``format_energy(1234.5) == "1234.5 J"``."""
    return f"{joules:.5g} {ENERGY_UNIT}"
