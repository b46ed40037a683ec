"""Microbatch cost coefficients of a live LoRA model (plait/train/cost_coeffs.py): a module with adapters pays dX and
only its adapters' share of dW (the rule of UnitCost.backward_s), with the share counted here from the parameters."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.models.registry import build_model, load_tokenizer
from plait.planner.pipeline.graph import ModuleFlags
from plait.train.cost_coeffs import microbatch_cost_coeffs, pass_work
from tests.helpers.jobs import tiny_config_dict


def _model(lora: bool):
    job = tiny_config_dict("unused.jsonl")
    if lora:
        job["model"]["llm"]["lora"] = {"r": 4}
        job["model"]["encoders"]["vision"]["lora"] = {"r": 2}
    cfg = config_from_dict(job)
    return build_model(cfg.model, load_tokenizer(tokenizer_dir(cfg.data, cfg.model)), device="meta")


def _share(module) -> float:
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad) / sum(p.numel() for p in params)


def test_pass_work_follows_the_unit_rule():
    assert pass_work(ModuleFlags(True, True)) == 3.0
    assert pass_work(ModuleFlags(True, True), 0.25) == 2.25
    assert pass_work(ModuleFlags(False, True), 0.25) == 2.0
    assert pass_work(ModuleFlags(False, False)) == 1.0


def test_lora_modules_pay_their_trained_share_of_dw():
    plain, adapted = _model(False), _model(True)
    full, lora = microbatch_cost_coeffs(plain), microbatch_cost_coeffs(adapted)
    for name, part in (("llm", lambda m: m.language_model), ("vision", lambda m: m.encoders["vision"].encoder)):
        f = _share(part(adapted))
        assert 0 < f < 0.2
        assert lora[name].trainable and lora[name].needs_input_grad
        for n in (1, 17, 64):
            assert lora[name].cost(n) / full[name].cost(n) == pytest.approx((2 + f) / 3, rel=1e-12), name
    # The audio encoder trains fully in both jobs: its coefficients do not change.
    assert lora["audio"].cost(10) == full["audio"].cost(10)
