"""Frozen-aware plans with LoRA: the demo model with LoRA on the LLM (r 8) and both encoders (r 4), 2-stage plans
on 2 gloo processes (both layouts, 1F1B). The profile marks every layer unit as an adapter unit (the simulator then
charges only the adapters' dW, ``Unit.trainable_fraction``) and the simulation and measurement cover both ranks.
The timing target (each rank's simulated work within 25% of its measured main-thread CPU time) is printed by
``bench/sim_vs_measured.py --lora``."""

from __future__ import annotations

from bench.sim_vs_measured import LAYOUTS, compare, lora_config


def test_lora_profile_marks_adapter_units_and_both_ranks_are_simulated(tmp_path):
    config = lora_config(tmp_path)
    results, profile = compare(config, steps=2, rounds=1, microbatches=4, microbatch_size=4, repeats=3,
                               clock="thread", out_dir=tmp_path / "out")
    layers = [u for u in profile.units if u.kind == "layer"]
    assert layers and all(u.adapter for u in layers)
    assert [c.layout for c in results] == list(LAYOUTS)
    for c in results:
        assert len(c.measured_cpu_s) == len(c.prediction.busy_s) == 2
        assert all(t > 0 for t in c.measured_cpu_s) and all(t > 0 for t in c.prediction.busy_s)
