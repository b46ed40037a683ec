"""Helpers of several test modules, taken from tests/unit/parallel/test_checkpointing.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

from tests.distributed.pipeline_worker import tiny_model


# freezing modes: (encoders frozen, projectors frozen, LLM frozen)
MODES = {
    "all": (False, False, False),
    "frozen-encoders": (True, False, False),  # trainable projectors and LLM
    "frozen-llm": (False, False, True),  # trainable encoders and projectors
    "projectors-only": (True, False, True),
}


def frozen_model(mode: str):
    encoders, projectors, llm = MODES[mode]
    model = tiny_model()
    model.set_frozen("encoder", encoders)
    model.set_frozen("projector", projectors)
    model.set_frozen("llm", llm)
    return model
