"""The one needs_input_grad rule (plait.planner.pipeline.graph) and the places that take their flags from it."""

import pytest

from plait.planner.pipeline.graph import ModuleFlags, check_grouping, consistent_units, module_flags
from plait.planner.pipeline.plan import synthetic_units
from plait.planner.types import Unit


def _unit(name, module, trainable, kind="layer"):
    return Unit(name, module, kind, trainable, False)


def test_rule_encoder_chains_feed_the_llm_first_unit():
    units = [
        _unit("v.0", "vision", False, "embed"), _unit("v.1", "vision", True), _unit("v.2", "vision", False),
        _unit("a.0", "audio", False, "embed"), _unit("a.1", "audio", False),
        _unit("l.0", "llm", False, "embed"), _unit("l.1", "llm", False),
    ]
    flags = [(u.trainable, u.needs_input_grad) for u in consistent_units(units)]
    assert flags == [(False, False), (True, False), (False, True), (False, False), (False, False),
                     (False, True), (False, True)]
    unaware = consistent_units(units, all_trainable=True)
    assert [u.needs_input_grad for u in unaware] == [False, True, True, False, True, True, True]


def test_rule_frozen_encoders_leave_llm_embedding_without_input_grad():
    units = [_unit("v.0", "vision", False, "embed"), _unit("v.1", "vision", False, "projector"),
             _unit("l.0", "llm", True, "embed"), _unit("l.1", "llm", False)]
    assert [u.needs_input_grad for u in consistent_units(units)] == [False, False, False, True]


def test_module_flags_leave_projectors_out():
    units = consistent_units([_unit("v.0", "vision", False, "embed"), _unit("v.1", "vision", True, "projector"),
                              _unit("l.0", "llm", False, "embed")])
    assert module_flags(units) == {"vision": ModuleFlags(False, False), "llm": ModuleFlags(False, True)}


def test_synthetic_units_follow_the_rule():
    units = synthetic_units({"v": [False, True, False]}, [False, False])
    assert units == consistent_units(units)
    assert [u.needs_input_grad for u in units] == [False, False, True, True, True]


def test_grouping_errors():
    with pytest.raises(ValueError, match="empty"):
        check_grouping([])
    with pytest.raises(ValueError, match="not contiguous"):
        check_grouping([_unit("v.0", "v", True), _unit("l.0", "llm", True), _unit("v.1", "v", True)])
    with pytest.raises(ValueError, match="no unit belongs"):
        check_grouping([_unit("v.0", "v", True)])
    assert check_grouping([_unit("v.0", "v", True)], require_llm=False) == ["v"]
    with pytest.raises(ValueError, match="after every encoder"):
        check_grouping([_unit("l.0", "llm", True), _unit("v.0", "v", True)])
