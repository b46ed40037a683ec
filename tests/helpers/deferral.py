"""Helpers of several test modules, taken from tests/unit/train/test_deferral.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import pytest

from tests.helpers.data_parallel import assert_same_gradients_and_parameters
from tests.helpers.jobs import demo_records


# (task, index among that task's demo records, extra answer words): a mix whose LLM lengths fight the encoder
# balance (long answers on samples with encoder work, no text-only sample to fill light microbatches), so the
# hierarchical planner defers LLM work to later microbatches.
MIX = [("image_digit", 2, 30), ("image_audio", 2, 30), ("image_digit", 3, 0), ("audio_transcribe", 0, 15),
       ("image_digit", 1, 0), ("image_digit", 2, 0), ("image_audio", 0, 15), ("audio_transcribe", 1, 0)]


def deferral_records() -> list[dict]:
    """The eight records of ``MIX``: demo samples, some with an answer lengthened by ``extra`` words."""
    pools = {task: demo_records("train", (task,), limit=4) for task in {t for t, _, _ in MIX}}
    out = []
    for k, (task, i, extra) in enumerate(MIX):
        rec = dict(pools[task][i], id=f"mix-{k}")
        if extra:
            user, answer = rec["messages"][0], rec["messages"][1]
            words = " ".join(["seven", "two", "nine"] * extra)[: 6 * extra]
            rec["messages"] = [user, {"role": "assistant", "content": answer["content"] + " " + words}]
        out.append(rec)
    return out


def assert_same_training(ref: dict, other: dict) -> None:
    """Equal losses, gradients and (where the exact gradient is not zero) parameters, within fp32 tolerance."""
    assert other["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_same_gradients_and_parameters(ref, other, min_grads=10)
