"""``parallel.plan = "auto"`` follows ``train.activation_checkpointing`` (issue 14, item 5): the chosen plan's
costs charge the recomputation and keep only the checkpointed layers' inputs."""

from __future__ import annotations

from transformers import AutoTokenizer

from plait.config.loader import config_from_dict
from plait.models.registry import build_model
from plait.models.units import model_units
from plait.planner.types import UnitCost
from plait.train.apply_plan import resolve_auto_plan
from tests.helpers.jobs import DEMO, tiny_config_dict


def test_auto_plan_charges_checkpointing():
    choices = {}
    for policy in ("none", "full"):
        job = tiny_config_dict("train.jsonl", train={"global_batch_size": 8, "microbatch_size": 2,
                                                     "activation_checkpointing": policy})
        job["parallel"] = {"plan": "auto"}
        cfg = config_from_dict(job)
        model = build_model(cfg.model, AutoTokenizer.from_pretrained(str(DEMO / "tokenizer")), device="meta")
        units = model_units(model)
        # every unit: 1 s forward, dX and dW, 1000 B parameters, 500 B saved, 20 B output (a layer's input)
        costs = [UnitCost(1.0, 1.0, 1.0, 1000, 500, 20) for _ in units]
        _, choices[policy] = resolve_auto_plan(cfg, 1, units, costs)
    layers = sum(1 for u in units if u.kind == "layer" and u.runs_backward)
    none, full = choices["none"], choices["full"]
    assert sum(none.stage_activation_bytes) - sum(full.stage_activation_bytes) == layers * (500 - 20)
    assert sum(full.stage_backward_s) - sum(none.stage_backward_s) == layers * 1.0
