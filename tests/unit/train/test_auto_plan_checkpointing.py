"""``parallel.plan = "auto"`` follows ``train.activation_checkpointing`` (issue 14, item 5): the chosen plan's
costs charge the recomputation and keep only the checkpointed layers' inputs; it searches per-encoder data-parallel
degrees as ``plait plan`` does, capped by the job's ``parallel.pp.encoder_dp``."""

from __future__ import annotations

from transformers import AutoTokenizer

from plait.config.loader import config_from_dict
from plait.models.registry import build_model
from plait.models.units import model_units
from plait.planner.types import UnitCost
from plait.train.apply_plan import auto_encoder_dp, resolve_auto_plan
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


def test_auto_plan_searches_encoder_replicas_unless_the_job_caps_them():
    """``parallel.plan = "auto"`` searches per-encoder DP degrees as ``plait plan`` does (each branch up to
    ``train.microbatch_size``); a branch the job names in ``parallel.pp.encoder_dp`` is capped at that degree."""
    found = {}
    for caps in ({}, {"vision": 1}):
        job = tiny_config_dict("train.jsonl", train={"global_batch_size": 8, "microbatch_size": 4})
        job["parallel"] = {"plan": "auto", **({"pp": {"encoder_dp": caps}} if caps else {})}
        cfg = config_from_dict(job)
        model = build_model(cfg.model, AutoTokenizer.from_pretrained(str(DEMO / "tokenizer")), device="meta")
        units = model_units(model)
        costs = [UnitCost(8.0 if u.module == "vision" else 1.0, 1.0, 1.0, 1000, 500, 20) for u in units]  # heavy
        found[bool(caps)] = (auto_encoder_dp(cfg, units), *resolve_auto_plan(cfg, 4, units, costs))
    bounds, resolved, choice = found[False]
    assert bounds == (("vision", 4), ("audio", 4))
    assert choice.encoder_dp == (("vision", 2), ("audio", 2)) and choice.dp * choice.plan.num_ranks == 4
    assert resolved.parallel.pp.encoder_dp == {"vision": 2, "audio": 2}
    bounds, resolved, capped = found[True]
    assert bounds == (("audio", 4),) and capped.encoder_dp == () and resolved.parallel.pp.encoder_dp == {}
    assert choice.iteration_s < capped.iteration_s  # 41.5 s against 52 s: the replicas win here
