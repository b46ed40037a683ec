"""``plait tune-ranks`` end to end on a tiny job (LoRA on the LLM and the vision encoder): 2 candidate ranks x 2
subset sizes per module, 2-4 steps each; what it writes (runs, laws, plot, TOML) and a resume that reruns nothing."""

from __future__ import annotations

import json
import tomllib

import pytest

import plait.commands.tune_ranks as tune_ranks
from plait.cli import main
from plait.config.loader import load_config
from plait.planner.ranks.rank_law import convergence_samples
from plait.train.metrics import read_metrics
from tests.helpers.cli_tune_ranks import tune_job


def test_tune_ranks_chooses_writes_and_resumes(tmp_path, capsys, monkeypatch):
    job = tune_job(tmp_path)
    out = tmp_path / "search"
    args = ["tune-ranks", "--config", str(job), "--ranks", "2,4", "--sizes", "8,16", "--val-samples", "4",
            "--out-dir", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    search = json.loads((out / "search.json").read_text())
    assert search["compute"]["runs"] == 8 and search["compute"]["resumed"] == 0
    assert search["compute"]["steps"] == 4 * (2 + 4) and search["compute"]["samples"] == 4 * (8 + 16)
    assert search["compute"]["cpu_s"] > 0 and search["full_samples"] == 16
    assert set(search["chosen"]) == {"llm", "vision"} and set(search["chosen"].values()) <= {2, 4}
    assert "Law-C" in printed and "R^2" in printed and "chosen: " in printed
    assert (out / "laws.png").stat().st_size > 10_000
    # The number each kept combination carries is a ranking score, printed as such (not as a forecast of the
    # fine-tune's validation loss), beside the validation losses the calibration runs measured.
    assert "predicted final validation loss" not in printed and "predicted loss" not in printed
    assert "Law-P score" in printed and "not a forecast of the fine-tune's validation loss" in printed
    measured = [o["val_loss"] for o in search["observations"]]
    assert f"range {min(measured):.4f} to {max(measured):.4f}" in printed

    # Each observation is the convergence time of its own run's logged losses and its last validation loss.
    obs = {(o["module"], o["rank"], o["samples"]): o for o in search["observations"]}
    run = out / "runs" / "vision_r2_d16"
    rows = read_metrics(run / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4
    assert obs[("vision", 2, 16)]["convergence"] == convergence_samples(losses, 4)
    assert obs[("vision", 2, 16)]["val_loss"] == [r["val_loss"] for r in rows if "val_loss" in r][-1]
    # The run trained vision adapters only: the LLM had no LoRA and was frozen.
    run_cfg = load_config(run / "job.toml")
    assert run_cfg.model.encoders["vision"].lora.r == 2 and run_cfg.model.llm.lora.r == 0 and run_cfg.model.llm.freeze

    # The run keeps the job's alpha / r (8 / 4): alpha 4 at rank 2.
    assert run_cfg.model.encoders["vision"].lora.alpha == 4.0

    # The TOML tables parse and carry the job's alpha / r (alpha = 2 r; the job's alpha 8.0 at its rank 4).
    tables = tomllib.loads((out / "ranks.toml").read_text())
    assert tables["model"]["llm"]["lora"]["r"] == search["chosen"]["llm"]
    assert tables["model"]["encoders"]["vision"]["lora"]["alpha"] == 2.0 * search["chosen"]["vision"]
    assert tables["model"]["llm"]["lora"]["alpha"] == 2.0 * search["chosen"]["llm"]

    # Resume: every finished run is found on disk, nothing trains again, the same choice comes out.
    def refuse(*a, **k):
        raise AssertionError("a finished calibration run was trained again")

    monkeypatch.setattr(tune_ranks, "train_job", refuse)
    again = tune_ranks.tune_ranks_command(job, (), tune_ranks.SearchSettings(ranks=(2, 4), sizes=(8, 16), val_samples=4),
                                          out)
    assert again["compute"]["resumed"] == 8 and again["chosen"] == search["chosen"]
    assert again["observations"] == search["observations"]


def test_tune_ranks_refuses_a_job_without_lora(tmp_path, capsys):
    assert main(["tune-ranks", "--config", str(tune_job(tmp_path, lora=False)), "--out-dir", str(tmp_path / "s")]) == 2
    assert "LoRA on the LLM and on at least one encoder" in capsys.readouterr().err


def test_tune_ranks_refuses_bad_ranks(tmp_path, capsys):
    assert main(["tune-ranks", "--config", str(tune_job(tmp_path)), "--ranks", "2,x"]) == 2
    assert "--ranks takes comma-separated integers" in capsys.readouterr().err
