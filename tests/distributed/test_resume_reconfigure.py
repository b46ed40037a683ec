"""``plait train --resume`` with another parallel layout continues the run exactly (reconfiguration).

One uninterrupted single-process run of 5 steps (checkpoint every step) is the reference. A chain of resumes
changes the layout at every link; each link trains to step 5 and its losses and learning rates must equal the
reference's at the same steps:

- single process (step 1) -> PP 2, interleaved (4 LLM stages on 2 ranks, encoders attached to rank 0; the
  tied input/output embeddings live on different ranks, so rank 1 needs the output embedding's optimizer
  state, which the single-process optimizer keys by the input embedding's name);
- that PP run (step 2) -> PP 2 with another plan (encoders on rank 0, the whole LLM on rank 1: same world size);
- that PP run (step 3) -> one process (in this process: final parameters and AdamW step counts are compared
  with the reference too) and -> DP 2, whose step 4 -> one process again (compared the same way);
- single process (step 2) -> CP 2.

Tolerance: losses rel 1e-5 (fp32; another layout sums gradients in another order), learning rates rel 1e-12
(the schedule is recomputed, not reloaded), final parameters rtol 1e-4 / atol 1e-5 (as
``tests/distributed/test_pipeline_training.py``; key-projection biases, whose gradient is zero in exact
arithmetic, left out).
"""

from __future__ import annotations

import torch

from plait.config.loader import config_from_dict
from plait.train.metrics import read_metrics
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import job_dict, torchrun_train

STEPS = 5
LOSS_RTOL = 1e-5


def resumable_job(tmp_path, run: str) -> dict:
    """The pipeline-training test's job (8 samples of every modality, batch 4, vision at 3x the LR) with tied
    embeddings, 5 steps of cosine decay, a checkpoint every step and no validation."""
    job = job_dict(tmp_path, run)
    job["model"]["llm"]["config"]["tie_word_embeddings"] = True
    job["train"].update(steps=STEPS, min_lr_ratio=0.1)
    job["checkpoint"] = {"every": 1, "keep": STEPS}
    job["data"]["val"] = None
    return job


def records_of(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def assert_continues(run_dir, ref: dict[int, dict], first: int) -> float:
    """Steps ``first``..5 of ``run_dir`` have the reference's losses and LRs; returns the largest relative loss
    difference."""
    got = records_of(run_dir)
    assert sorted(got) == list(range(first, STEPS + 1)), sorted(got)
    worst = 0.0
    for step in got:
        assert abs(got[step]["lr"] - ref[step]["lr"]) <= 1e-12 * ref[step]["lr"], (step, got[step], ref[step])
        diff = abs(got[step]["loss"] - ref[step]["loss"]) / abs(ref[step]["loss"])
        assert diff <= LOSS_RTOL, (run_dir.name, step, got[step]["loss"], ref[step]["loss"])
        worst = max(worst, diff)
    return worst


def test_resume_across_layouts_continues_the_uninterrupted_run(tmp_path, capsys):
    reference = Trainer.build(config_from_dict(resumable_job(tmp_path, "single")))
    reference.fit()
    ref = records_of(tmp_path / "single")
    assert len({round(r["lr"], 12) for r in ref.values()}) == STEPS  # the LR changes every step

    # single process -> PP 2 interleaved, tied embeddings split over the two ranks
    job = resumable_job(tmp_path, "pp_interleaved")
    job["parallel"]["pp"] = {"degree": 2, "virtual_stages": 2, "attach_encoders": True, "schedule": "interleaved_1f1b"}
    proc = torchrun_train(job, tmp_path, "pp_interleaved", f"--resume={tmp_path / 'single/checkpoints/step_000001'}")
    assert ("plait: resuming step 1 written with 1 process (DP 1 x PP 1 x CP 1), now 2 processes (DP 1 x PP 2 x "
            "CP 1; encoder_parallel, stages 0: vision") in proc.stdout
    assert proc.stdout.count("RNG streams were re-derived") == 1  # rank 0 only
    worst = {"single->pp_interleaved": assert_continues(tmp_path / "pp_interleaved", ref, 2)}

    # PP 2 -> PP 2 with another plan (same world size: the RNG streams are re-derived all the same)
    job = resumable_job(tmp_path, "pp_colocated")
    job["parallel"]["pp"] = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}
    proc = torchrun_train(job, tmp_path, "pp_colocated",
                          f"--resume={tmp_path / 'pp_interleaved/checkpoints/step_000002'}")
    assert "now 2 processes (DP 1 x PP 2 x CP 1; encoders_colocated, stages 0: vision+audio" in proc.stdout
    assert "RNG streams were re-derived" in proc.stdout
    worst["pp_interleaved->pp_colocated"] = assert_continues(tmp_path / "pp_colocated", ref, 3)

    # PP 2 -> one process
    capsys.readouterr()
    job = resumable_job(tmp_path, "single_again")
    single = Trainer.build(config_from_dict(job))
    single.fit(resume=str(tmp_path / "pp_colocated/checkpoints/step_000003"))
    out = capsys.readouterr().out
    assert "resuming step 3 written with 2 processes (DP 1 x PP 2" in out and "now 1 process (DP 1" in out
    assert "RNG streams were re-derived" in out
    worst["pp_colocated->single"] = assert_continues(tmp_path / "single_again", ref, 4)
    param_diff = {"pp_colocated->single": _assert_same_model(single, reference)}

    # PP 2 -> DP 2 -> one process
    job = resumable_job(tmp_path, "dp")
    proc = torchrun_train(job, tmp_path, "dp", f"--resume={tmp_path / 'pp_colocated/checkpoints/step_000003'}")
    assert "now 2 processes (DP 2 x PP 1 x CP 1)" in proc.stdout
    worst["pp_colocated->dp"] = assert_continues(tmp_path / "dp", ref, 4)
    single = Trainer.build(config_from_dict(resumable_job(tmp_path, "single_from_dp")))
    single.fit(resume=str(tmp_path / "dp/checkpoints/step_000004"))
    assert "written with 2 processes (DP 2 x PP 1 x CP 1), now 1 process" in capsys.readouterr().out
    worst["dp->single"] = assert_continues(tmp_path / "single_from_dp", ref, 5)
    param_diff["dp->single"] = _assert_same_model(single, reference)

    # one process -> CP 2 (plait's attention with K/V gathered over the two ranks)
    job = resumable_job(tmp_path, "cp")
    job["parallel"]["cp"] = 2
    proc = torchrun_train(job, tmp_path, "cp", f"--resume={tmp_path / 'single/checkpoints/step_000002'}")
    assert "now 2 processes (DP 1 x PP 1 x CP 2)" in proc.stdout
    worst["single->cp"] = assert_continues(tmp_path / "cp", ref, 3)
    with capsys.disabled():
        print("\nmax relative loss difference to the uninterrupted run: "
              + ", ".join(f"{name} {value:.1e}" for name, value in worst.items())
              + "; max absolute final parameter difference: "
              + ", ".join(f"{name} {value:.1e}" for name, value in param_diff.items()))

    # the same layout again: the saved RNG streams come back, nothing is re-derived
    capsys.readouterr()
    Trainer.build(config_from_dict(resumable_job(tmp_path, "single"))).resume(tmp_path / "single/checkpoints/step_000004")
    out = capsys.readouterr().out
    assert "resuming step 4 written with 1 process (DP 1 x PP 1 x CP 1), now 1 process" in out
    assert "re-derived" not in out


def _assert_same_model(resumed: Trainer, reference: Trainer) -> float:
    """Equal parameters after the last step (the moments and step counts carried over the layout changes
    shape every AdamW update) and equal AdamW step counts; returns the largest absolute parameter difference."""
    ref_params = dict(reference.model.named_parameters())
    compared, largest = 0, 0.0
    for name, param in resumed.model.named_parameters():
        if not name.endswith("k_proj.bias"):
            torch.testing.assert_close(param, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
            largest = max(largest, float((param - ref_params[name]).abs().max()))
            compared += 1
    assert compared > 50
    ref_opt = {n: reference.optimizer.state[p] for n, p in reference.model.named_parameters()
               if p in reference.optimizer.state}
    got = {n: resumed.optimizer.state[p] for n, p in resumed.model.named_parameters() if p in resumed.optimizer.state}
    assert set(got) == set(ref_opt)
    assert {n: float(s["step"]) for n, s in got.items()} == {n: float(s["step"]) for n, s in ref_opt.items()}
    return largest
