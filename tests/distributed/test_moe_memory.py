"""The planner's per-rank memory under expert parallelism (``planner.cost.sharding.rank_memory`` with ``ep = 2`` on
the job's units: ``bench/moe_measured.py``'s ``predicted``) within 15% of the bytes measured under torchrun (gloo,
fp32) on the tiny MoE MLLM of ``bench/moe_measured.py`` (issue 29, acceptance): parameters (a DTensor counted by its
local shard), gradients at the end of a step's backward and AdamW's state, for EP = 2 over 2 DP ranks and EP = 2 x
FSDP2 (``dp_shard = 2``) on the same 2 processes.

The planner charges the modules of the pipeline units only: the frozen SigLIP tower's post-norm and pooling head,
built but never run (outside every unit), are held by each rank but not predicted. They are 16% of this tiny model's
parameter bytes, 8% of its total: the test adds them back (measured from the model on the meta device) to check the
parameters within 0.1% (FSDP2's padding), and checks the total without them."""

from __future__ import annotations

import pytest

from bench.moe_measured import KINDS, job_dict, measure_moe, predicted
from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.models.registry import build_model, load_tokenizer
from plait.models.units import unit_specs

DEGREES = ("EP", "EP x FSDP2")


def outside_units_bytes() -> int:
    """fp32 bytes of the model's parameters in no pipeline unit (frozen, whole on every rank)."""
    cfg = config_from_dict(job_dict({}, 2, 1, "train.jsonl", "run"))
    model = build_model(cfg.model, load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template),
                        device="meta")
    modules = [m for spec in unit_specs(model) for m in spec.modules]
    outside = [p for n, p in model.named_parameters() if not any(n.startswith(m + ".") for m in modules)]
    assert outside and not any(p.requires_grad for p in outside)
    return 4 * sum(p.numel() for p in outside)


def test_planner_within_15_percent_of_measured_per_rank_under_ep():
    got = measure_moe(DEGREES, microbatch=2, steps=1)
    outside = outside_units_bytes()
    for label in DEGREES:
        measured = got[label]
        assert isinstance(measured, dict), (label, measured)
        pred = predicted(label)
        assert pred["experts"] == measured["experts"] > 0, label  # 4 of the 8 experts of each layer
        # exact but for FSDP2's padding of a dimension it does not divide evenly (256 bytes under EP x FSDP2)
        assert pred["parameters"] + outside == pytest.approx(measured["parameters"], rel=1e-3), label
        for kind in ("gradients", "optimizer"):
            assert pred[kind] == pytest.approx(measured[kind], rel=0.15), (label, kind, pred, measured)
        assert sum(pred[k] for k in KINDS) == pytest.approx(sum(measured[k] for k in KINDS), rel=0.15), label
    # EP x FSDP2 holds less than EP alone (the trained non-expert parameters sharded), in both
    assert sum(got["EP x FSDP2"][k] for k in KINDS) < sum(got["EP"][k] for k in KINDS)
    assert sum(predicted("EP x FSDP2")[k] for k in KINDS) < sum(predicted("EP")[k] for k in KINDS)
