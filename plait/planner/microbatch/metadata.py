"""``SampleCost`` of every sample from the loader's per-sample metadata and the modules' cost coefficients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from plait.planner.microbatch.types import ModuleCostCoeffs, SampleCost, check_int

__all__ = [
    "module_order",
    "sample_costs_from_metadata",
]


def module_order(coeffs: Mapping[str, ModuleCostCoeffs], llm: str = "llm") -> tuple[str, ...]:
    """Module names in ``SampleCost.work`` order: the encoders in ``coeffs`` order, then ``llm`` last.

    Raises:
        ValueError: when ``coeffs`` has no entry named ``llm``.
    """
    if llm not in coeffs:
        raise ValueError(f"coeffs needs an entry for the LLM {llm!r}, got {sorted(coeffs)}")
    return tuple(name for name in coeffs if name != llm) + (llm,)


def _meta_field(meta: Any, name: str, position: int) -> Any:
    if isinstance(meta, Mapping):
        if name not in meta:
            raise ValueError(f"sample {position}: metadata lacks {name!r}")
        return meta[name]
    if not hasattr(meta, name):
        raise ValueError(f"sample {position}: metadata lacks {name!r}")
    return getattr(meta, name)


def _item_tokens(item: Any, position: int, coeffs: Mapping[str, ModuleCostCoeffs]) -> tuple[str, int, int]:
    """(encoder, placeholder tokens, encoder tokens) of one item: ``(encoder, placeholders)`` or
    ``(encoder, placeholders, encoder_tokens)``."""
    if not isinstance(item, Sequence) or isinstance(item, str) or len(item) not in (2, 3):
        raise ValueError(
            f"sample {position}: item {item!r} must be (encoder, placeholders[, encoder_tokens])"
        )
    name, placeholders = item[0], item[1]
    if name not in coeffs:
        raise ValueError(f"sample {position}: encoder {name!r} has no cost coefficients")
    check_int(f"sample {position} item {name!r}", "placeholders", placeholders, 0)
    tokens = item[2] if len(item) == 3 else coeffs[name].encoder_tokens(placeholders)
    check_int(f"sample {position} item {name!r}", "encoder_tokens", tokens, 0)
    return name, int(placeholders), int(tokens)


def sample_costs_from_metadata(
    meta_list: Sequence[Any], coeffs: Mapping[str, ModuleCostCoeffs], llm: str = "llm"
) -> tuple[SampleCost, ...]:
    """Per-sample module costs from loader metadata.

    Args:
        meta_list: one entry per sample of the global batch (its position is ``SampleCost.index``): a
            ``plait.data.processing.SampleMeta``, or any mapping/object with ``text_tokens`` (tokens that
            are not placeholders) and ``items`` (``(encoder, placeholders)`` per image/clip, the number of
            LLM placeholder tokens it fills, or ``(encoder, placeholders, encoder_tokens)`` when the
            encoder's own token count is known). An optional ``length`` (LLM tokens) is checked.
        coeffs: cost coefficients per module name: one per encoder and one for ``llm``.
        llm: the name of the LLM entry in ``coeffs``.

    Returns:
        One ``SampleCost`` per sample; ``work`` follows ``module_order(coeffs, llm)``: per encoder the sum of
        its items' costs, for the LLM ``coeffs[llm].cost(L)`` with ``L = text_tokens + placeholders``
        (``SampleCost.tokens = L``).

    Raises:
        ValueError: on a missing field, an unknown encoder, a negative token count, a ``length`` that is
            not ``L``, or no ``llm`` entry.
    """
    order = module_order(coeffs, llm)
    slot = {name: k for k, name in enumerate(order)}
    out = []
    for position, meta in enumerate(meta_list):
        text = _meta_field(meta, "text_tokens", position)
        check_int(f"sample {position}", "text_tokens", text, 0)
        parts: list[list[float]] = [[] for _ in order]
        length = int(text)
        for item in _meta_field(meta, "items", position):
            name, placeholders, tokens = _item_tokens(item, position, coeffs)
            if name == llm:
                raise ValueError(f"sample {position}: item encoder {name!r} is the LLM")
            parts[slot[name]].append(coeffs[name].cost(tokens))
            length += placeholders
        _check_length(meta, position, length)
        parts[-1].append(coeffs[llm].cost(length))
        has = tuple(bool(p) for p in parts[:-1]) + (True,)
        work = tuple(math.fsum(p) for p in parts)
        out.append(SampleCost(index=position, work=work, tokens=length, has=has))
    return tuple(out)


def _check_length(meta: Any, position: int, length: int) -> None:
    given = meta.get("length") if isinstance(meta, Mapping) else getattr(meta, "length", None)
    if given is not None and given != length:
        raise ValueError(f"sample {position}: length={given} but text_tokens + placeholders = {length}")
