"""``plait plan`` on a LoRA job: the LLM's layers are LoRA units (frozen base + adapters) and the plan says so."""

from __future__ import annotations

import io
from pathlib import Path

from plait.commands.plan.command import plan_command

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"


def test_plan_shows_lora_units():
    out = io.StringIO()
    plan_command(DEMO, 2, overrides=["--model.llm.lora.r=4"], device="cpu-preset", dp_degrees=[1], out=out)
    text = out.getvalue()
    lines = [line for line in text.splitlines() if line.startswith("LoRA ")]
    assert len(lines) == 1 and lines[0].startswith("LoRA llm: ")
    assert "backward = dX through the base + the adapters' dW" in lines[0]
