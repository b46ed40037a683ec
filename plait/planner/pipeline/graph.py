"""The unit graph: which pipeline units train and which need an input gradient.

A model's pipeline units form a small graph: each encoder branch is a chain (``[embed, layers, post-norm,
projector]``), and every branch feeds the LLM's first unit (its token embedding, into whose output the
projected features are injected), after which the LLM is a chain too. ``trainable`` is a fact of a unit (it
owns a parameter with ``requires_grad``); ``needs_input_grad`` is derived from the graph, here and nowhere
else:

    a unit needs an input gradient when some unit upstream of it trains,

that is, for an encoder unit, an earlier unit of its own branch; for an LLM unit, an earlier LLM unit or any
encoder unit (projectors included).

Feature edges (:func:`feature_receivers`): an encoder's features enter the LLM's first unit (its placeholders in
the embedding) and, for an encoder with DeepStack features (Qwen3-VL), the first ``k`` LLM layer units too. Under a
pipeline, the additions of the receiving layers held by later LLM stages travel with the hidden states, so a stage
boundary after an LLM unit carries, per visual token, one feature of the LLM width for each receiving layer after
it (:func:`carried_features`); the cost model counts those bytes. Every reader (the analytic cost model, the model's own units, the
microbatch cost coefficients, the layout search, synthetic test models) builds its units with ``trainable``
only and takes the flags from :func:`consistent_units`; coarser readers take per-module flags from
:func:`module_flags`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from plait.planner.types import LLM_MODULE, Unit

__all__ = ["ModuleFlags", "carried_features", "check_grouping", "consistent_units", "feature_receivers",
           "module_flags"]


def check_grouping(units: Sequence[Unit], require_llm: bool = True) -> list[str]:
    """Module names of ``units`` in order, checking that the units form the graph above.

    Args:
        units: pipeline units, grouped by module, encoder branches before the LLM.
        require_llm: when False, a model without an ``"llm"`` unit (encoders alone) is accepted.

    Raises:
        ValueError: on an empty list, a module whose units are not contiguous, no ``"llm"`` unit (when
            ``require_llm``), or encoder units after the LLM's.
    """
    if not units:
        raise ValueError("units is empty: nothing to plan")
    modules: list[str] = []
    for unit in units:
        if not modules or modules[-1] != unit.module:
            if unit.module in modules:
                raise ValueError(f"units of module {unit.module!r} are not contiguous (see unit {unit.name!r})")
            modules.append(unit.module)
    if LLM_MODULE not in modules:
        if require_llm:
            raise ValueError(f"no unit belongs to module {LLM_MODULE!r}; a pipeline needs the language model")
        return modules
    if modules[-1] != LLM_MODULE:
        raise ValueError(f"the LLM's units must come after every encoder's; module order is {modules}")
    return modules


def consistent_units(units: Sequence[Unit], all_trainable: bool = False,
                     require_llm: bool = True) -> tuple[Unit, ...]:
    """``units`` with ``needs_input_grad`` derived from ``trainable`` by the one rule (module docstring).

    Args:
        units: pipeline units in model order; their ``needs_input_grad`` is ignored.
        all_trainable: mark every unit fully trainable first (the belief of a frozen-unaware planner; LoRA
            units' ``trainable_fraction`` becomes 1).
        require_llm: as :func:`check_grouping`.

    Returns:
        New units, same order and names, with consistent flags.

    Raises:
        ValueError: as :func:`check_grouping`.
    """
    check_grouping(units, require_llm)
    out: list[Unit] = []
    any_encoder = False
    upstream, module = False, None
    for unit in units:
        if unit.module != module:
            module = unit.module
            upstream = any_encoder if module == LLM_MODULE else False
        trainable = True if all_trainable else unit.trainable
        fraction = 1.0 if all_trainable else unit.trainable_fraction
        out.append(dataclasses.replace(unit, trainable=trainable, needs_input_grad=upstream,
                                       trainable_fraction=fraction))
        upstream |= trainable
        any_encoder |= trainable and module != LLM_MODULE
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class ModuleFlags:
    """Flags of a whole module (an encoder branch without its projector, or the LLM).

    Attributes:
        trainable: some unit of the module trains (its backward computes weight gradients).
        needs_input_grad: some unit of the module runs a backward, i.e. something at or upstream of the
            module trains (its backward computes input gradients somewhere).
    """

    trainable: bool
    needs_input_grad: bool


def module_flags(units: Sequence[Unit], skip_kinds: Sequence[str] = ("projector",)) -> dict[str, ModuleFlags]:
    """Per-module flags from units with consistent flags (:func:`consistent_units`), in module order.

    Args:
        units: units whose flags follow the rule.
        skip_kinds: unit kinds left out of their module's flags; by default the projectors, whose cost the
            microbatch planner does not count with their encoder (their training still reaches the LLM's
            flags through ``needs_input_grad``).
    """
    flags: dict[str, ModuleFlags] = {}
    for unit in units:
        if unit.kind in skip_kinds:
            continue
        old = flags.get(unit.module, ModuleFlags(False, False))
        flags[unit.module] = ModuleFlags(old.trainable or unit.trainable,
                                         old.needs_input_grad or unit.runs_backward)
    return flags


def feature_receivers(units: Sequence[Unit], deepstack: Mapping[str, int] | None = None) -> dict[str, tuple[str, ...]]:
    """Per encoder module of ``units`` (in order), the names of the LLM units its features enter: the LLM's first
    unit (the embedding: placeholders) and, when ``deepstack[encoder] = k`` (DeepStack), the first ``k`` LLM layer
    units (layers ``0 .. k-1``; Meng et al., arXiv 2406.04334).

    Raises:
        ValueError: as :func:`check_grouping`; for a negative ``k``, more receiving layers than the LLM has, or a
            ``deepstack`` key that is not an encoder of ``units``.
    """
    modules = check_grouping(units)
    encoders = [m for m in modules if m != LLM_MODULE]
    deepstack = dict(deepstack or {})
    unknown = sorted(set(deepstack) - set(encoders))
    if unknown:
        raise ValueError(f"deepstack names {unknown}, which are not encoders of the units ({encoders})")
    llm = [u for u in units if u.module == LLM_MODULE]
    layers = [u.name for u in llm if u.kind == "layer"]
    out: dict[str, tuple[str, ...]] = {}
    for encoder in encoders:
        k = deepstack.get(encoder, 0)
        if not 0 <= k <= len(layers):
            raise ValueError(f"encoder {encoder!r}: {k} DeepStack receivers, the LLM has {len(layers)} layer units")
        out[encoder] = (llm[0].name, *layers[:k])
    return out


def carried_features(units: Sequence[Unit], receivers: Mapping[str, Sequence[str]]) -> dict[str, dict[str, int]]:
    """Per LLM unit name, per encoder with receivers after it: how many of the encoder's receiving LLM units come
    after that unit, i.e. the features of the LLM width per visual token a stage boundary right after the unit
    carries on (module docstring). ``receivers``: :func:`feature_receivers`.

    Raises:
        ValueError: when a receiver is not an LLM unit of ``units``.
    """
    llm = [u.name for u in units if u.module == LLM_MODULE]
    position = {name: i for i, name in enumerate(llm)}
    out: dict[str, dict[str, int]] = {name: {} for name in llm}
    for encoder, names in receivers.items():
        missing = [n for n in names if n not in position]
        if missing:
            raise ValueError(f"encoder {encoder!r}: receivers {missing} are not LLM units")
        where = sorted(position[n] for n in names)
        for i, name in enumerate(llm):
            after = sum(1 for p in where if p > i)
            if after:
                out[name][encoder] = after
    return out
