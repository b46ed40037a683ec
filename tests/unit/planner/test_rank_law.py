"""MARS laws (plait/planner/ranks/rank_law.py): recovery of known parameters from synthetic data, convergence time of
hand-made loss curves, alignment/pruning and selection on laws with hand-computed answers, the TOML tables."""

from __future__ import annotations

import json
import math
import tomllib

import numpy as np
import pytest

from plait.planner.ranks.rank_law import (
    align_ranks, choose_ranks, convergence_samples, fit_power_law, lora_at_rank, lora_toml, plan_calibration,
    predict_combo_loss,
)
from plait.planner.ranks.types import CalibrationRun, PowerLaw, RankChoice


def _grid():
    d, r = np.meshgrid([64.0, 128.0, 256.0], [2.0, 4.0, 8.0, 16.0])
    return d.ravel(), r.ravel()


def test_fit_recovers_known_law_exactly():
    d, r = _grid()
    y = 20.0 + 3.0 * d ** 0.6 * r ** -0.4
    law = fit_power_law(d, r, y, offset_grid=400)
    assert law.offset == pytest.approx(20.0, abs=0.5)
    assert law.scale == pytest.approx(3.0, rel=0.05)
    assert law.data_exp == pytest.approx(0.6, abs=0.01)
    assert law.rank_exp == pytest.approx(-0.4, abs=0.01)
    assert law.r2 > 0.9999 and max(abs(x) for x in law.residuals) < 0.5
    assert law.predict(1200, 8) == pytest.approx(20.0 + 3.0 * 1200 ** 0.6 * 8 ** -0.4, rel=1e-3)


def test_fit_with_noise_recovers_exponents_within_tolerance():
    rng = np.random.default_rng(0)
    d, r = _grid()
    y = 5.0 + 2.0 * d ** 0.8 * r ** 0.3 * np.exp(rng.normal(0, 0.02, d.size))
    law = fit_power_law(d, r, y)
    assert law.data_exp == pytest.approx(0.8, abs=0.05) and law.rank_exp == pytest.approx(0.3, abs=0.05)
    assert 0.95 < law.r2 <= 1.0 and len(law.residuals) == d.size


def test_fit_with_one_rank_fixes_its_exponent_at_zero():
    law = fit_power_law([10, 20, 40], [4, 4, 4], [2.0, 4.0, 8.0])
    assert law.rank_exp == 0.0 and law.data_exp == pytest.approx(1.0, abs=0.02)
    assert law.solve_rank(5.0, 30) is None


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match=">= 3 observations"):
        fit_power_law([1, 2], [1, 2], [1, 2])
    with pytest.raises(ValueError, match="positive and finite"):
        fit_power_law([1, 2, 3], [1, 2, 3], [1, 0, 2])


def test_solve_rank_inverts_the_law():
    law = PowerLaw(10.0, 2.0, 0.5, -0.5, 1.0, ())
    t = law.predict(400, 8)  # 10 + 2 * 20 / sqrt(8)
    assert law.solve_rank(t, 400) == pytest.approx(8.0)
    assert law.solve_rank(9.0, 400) is None  # below the offset: no real rank


def test_convergence_samples_hand_curve():
    # EMA beta 0.5: 10, 7, 4.5, 3.25, 2.625, 2.3125; gap 7.6875, level 2.3125 + 0.2 * 7.6875 = 3.85 -> step 4.
    assert convergence_samples([10, 4, 2, 2, 2, 2], batch=8) == 32.0
    assert convergence_samples([1.0, 1.5, 2.0], batch=4) == 12.0  # no fall: all samples
    assert convergence_samples([10, 4, 2, 2, 2, 2], batch=8, beta=0.0, fraction=0.5) == 16.0  # 2 + 4 = 6 >= 4
    with pytest.raises(ValueError, match="at least 2 finite"):
        convergence_samples([1.0], 4)


def test_plan_calibration_counts_steps_and_respects_budget():
    runs = plan_calibration(["vision", "llm"], [2, 4], [32, 64, 128], epochs=1.0, batch=16, train_samples=1000)
    assert len(runs) == 12 and {r.steps for r in runs} == {2, 4, 8}
    assert runs[0] == CalibrationRun("vision", 2, 32, 2, 16) and runs[0].name == "vision_r2_d32"
    assert sum(r.steps * r.batch for r in runs) == 4 * (32 + 64 + 128)
    small = plan_calibration(["vision", "llm"], [2, 4], [32, 64, 128], 1.0, 16, 1000, budget=400)
    assert {r.samples for r in small} == {32, 64}
    with pytest.raises(ValueError, match="--budget 100 samples"):
        plan_calibration(["vision", "llm"], [2, 4], [32, 64], 1.0, 16, 1000, budget=100)
    with pytest.raises(ValueError, match="LoRA on the LLM and on at least one encoder"):
        plan_calibration(["vision"], [2, 4], [32, 64], 1.0, 16, 1000)
    with pytest.raises(ValueError, match="exceeds the 50 training samples"):
        plan_calibration(["vision", "llm"], [2, 4], [32, 64], 1.0, 16, 50)


def _laws():
    # LLM: t = 100 * r^-1 (r 2..16 -> 50, 25, 12.5, 6.25); vision: t = 25 * r^-1 (12.5, 6.25, 3.125, 1.5625).
    return {"llm": PowerLaw(0.0, 100.0, 0.0, -1.0, 1.0, ()), "vision": PowerLaw(0.0, 25.0, 0.0, -1.0, 1.0, ())}


def test_align_ranks_pairs_equal_times_and_prunes():
    combos = align_ranks(_laws(), [2, 4, 8, 16], samples=1000, tolerance=1.01)
    pairs = [(c.ranks["vision"], c.ranks["llm"]) for c in combos]
    assert pairs == [(2, 8), (4, 16)]  # r_vision = r_llm / 4 exactly
    assert combos[0].solved["vision"] == pytest.approx(2.0) and combos[0].mismatch == pytest.approx(1.0)
    loose = align_ranks(_laws(), [2, 4, 8, 16], samples=1000, tolerance=2.0)
    assert [(c.ranks["vision"], c.ranks["llm"]) for c in loose] == [(2, 4), (2, 8), (4, 16)]
    assert loose[0].mismatch == pytest.approx(2.0)


def test_align_ranks_falls_back_to_nearest_when_nothing_aligns():
    laws = {"llm": PowerLaw(0.0, 100.0, 0.0, -1.0, 1.0, ()), "vision": PowerLaw(200.0, 1.0, 0.0, -1.0, 1.0, ())}
    combos = align_ranks(laws, [2, 4], samples=10, tolerance=1.5)
    # vision (t ~ 200) is always slower than the LLM (50, 25): each LLM rank keeps its best-aligned vision rank
    assert [(c.ranks["vision"], c.ranks["llm"]) for c in combos] == [(4, 2), (4, 4)]
    assert combos[0].solved["vision"] is None


def test_choose_ranks_takes_lowest_predicted_loss_and_round_trips():
    perf = {"llm": PowerLaw(1.0, 1.0, 0.0, -1.0, 1.0, ()), "vision": PowerLaw(1.0, 0.5, 0.0, -1.0, 1.0, ())}
    # base 2: (2, 8): 2 * (1.25 / 2) * (1.125 / 2) = 0.703125; (4, 16): 2 * (1.125 / 2) * (1.0625 / 2) = 0.59765625
    assert predict_combo_loss(perf, {"vision": 2, "llm": 8}, 1000, 2.0) == pytest.approx(0.703125)
    choice = choose_ranks(_laws(), perf, [2, 4, 8, 16], 1000, base=2.0, tolerance=1.01)
    assert choice.chosen == {"llm": 16, "vision": 4}
    assert choice.predicted_loss == pytest.approx((0.703125, 0.59765625))
    with pytest.raises(ValueError, match="must be > 0"):
        predict_combo_loss(perf, {"llm": 2}, 1000, 0.0)
    assert RankChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice


def test_lora_toml_parses_into_the_job_tables():
    text = lora_toml({"llm": 8, "vision": 4}, {"llm": {"r": 2, "alpha": 16.0, "target_modules": ["q_proj"]},
                                               "vision": {"alpha": 8.0, "dropout": 0.0}})
    assert text.index("[model.encoders.vision.lora]") < text.index("[model.llm.lora]")
    parsed = tomllib.loads(text)
    assert parsed["model"]["llm"]["lora"] == {"r": 8, "alpha": 16.0, "target_modules": ["q_proj"]}
    assert parsed["model"]["encoders"]["vision"]["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.0}
    with pytest.raises(ValueError, match="rank of 'llm' must be >= 1"):
        lora_toml({"llm": 0})
    assert math.isfinite(PowerLaw(0, 1, 0, 0, 1, ()).predict(1, 1))


def test_lora_at_rank_keeps_the_jobs_alpha_over_r():
    job = {"r": 8, "alpha": 16.0, "dropout": 0.1, "target_modules": ["q_proj"]}
    assert lora_at_rank(job, 2) == {"r": 2, "alpha": 4.0, "dropout": 0.1, "target_modules": ["q_proj"]}
    assert lora_at_rank(job, 32) == {"r": 32, "alpha": 64.0, "dropout": 0.1, "target_modules": ["q_proj"]}
    for r in (1, 3, 8, 64):  # the adapter's scale alpha / r (peft's lora_alpha / r) is the job's 2.0 at every rank
        moved = lora_at_rank(job, r)
        assert moved["alpha"] / moved["r"] == 2.0
    assert job == {"r": 8, "alpha": 16.0, "dropout": 0.1, "target_modules": ["q_proj"]}  # not changed in place
    assert lora_at_rank({"r": 0, "alpha": 16.0}, 4) == {"r": 4, "alpha": 16.0}  # no adapter in the job: alpha as is
    assert lora_at_rank({"dropout": 0.0}, 4) == {"dropout": 0.0, "r": 4}
    with pytest.raises(ValueError, match="LoRA rank must be >= 1, got 0"):
        lora_at_rank(job, 0)
    text = lora_toml({"llm": 4}, {"llm": lora_at_rank(job, 4)})
    assert tomllib.loads(text)["model"]["llm"]["lora"] == {"r": 4, "alpha": 8.0, "dropout": 0.1,
                                                           "target_modules": ["q_proj"]}


def test_fit_recovers_a_rank_exponent_that_changes_with_the_data_size():
    d, r = _grid()  # sizes 64, 128, 256 (geometric mean 128); ranks 2..16
    y = 3.0 * d ** 0.9 * r ** (-0.1 - 0.2 * np.log(d / 128.0))  # -0.1 at D = 128, -0.3 at D = 384
    law = fit_power_law(d, r, y, offset_grid=50, rank_by_data=True)
    assert law.ref_samples == pytest.approx(128.0)
    assert law.rank_exp == pytest.approx(-0.1, abs=1e-3) and law.rank_data_exp == pytest.approx(-0.2, abs=1e-3)
    assert law.data_exp == pytest.approx(0.9, abs=1e-3) and law.offset < 1e-6 and law.r2 > 0.9999
    assert law.rank_exponent(128.0 * math.e) == pytest.approx(-0.3, abs=1e-3)
    assert law.predict(800, 8) == pytest.approx(3.0 * 800 ** 0.9 * 8 ** (-0.1 - 0.2 * math.log(800 / 128)), rel=1e-3)
    t = law.predict(800, 8)
    assert law.solve_rank(t, 800) == pytest.approx(8.0, rel=1e-6)
    assert "r^(-0.100 -0.200 ln(D/128))" in law.describe("t")
    assert PowerLaw.from_dict(json.loads(json.dumps(law.to_dict()))) == law
    # A single exponent cannot follow the change: worse fit, residuals of several samples.
    flat = fit_power_law(d, r, y, offset_grid=50)
    assert flat.rank_data_exp == 0.0 and flat.r2 < 0.999 < law.r2
    assert max(map(abs, flat.residuals)) > 10.0 and max(map(abs, law.residuals)) < 1e-6
    # Two sizes cannot tell a changing exponent from a constant one: it stays constant.
    two = d < 256
    assert fit_power_law(d[two], r[two], y[two], offset_grid=50, rank_by_data=True).rank_data_exp == 0.0
