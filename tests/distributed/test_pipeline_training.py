"""``plait train`` with pipeline parallelism: PP=2 (gloo; ranks started with torchrun's variables) equals one
process, writes a measured timeline, checkpoints, validation accuracies and the whole final model, and resumes
exactly.

Layout of the PP job: ``encoders_colocated`` with the default stage counts (both encoders on stage 0, the LLM
on stage 1), 1F1B, 2 microbatches per step. The single-process reference is the plain ``Trainer`` in this
process on the same job without ``[parallel.pp]``.
"""

from __future__ import annotations

import json

import pytest
import torch

from plait.config.loader import config_from_dict, pipeline_stage_counts, validate
from plait.config.schema import PipelineConfig
from plait.models.multimodal import MultimodalModel
from plait.train.metrics import read_metrics
from plait.train.plots import read_chrome_trace
from plait.train.trainer import Trainer
from tests.helpers.jobs import demo_records, tiny_config_dict
from tests.helpers.pipeline_training import GLOBAL_BATCH, MICROBATCH, job_dict, losses_of, torchrun_train


def test_pp2_trains_like_one_process_writes_timeline_and_resumes(tmp_path):
    single = Trainer.build(config_from_dict(job_dict(tmp_path, "single")))
    initial = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    ref = single.fit()

    job = job_dict(tmp_path, "pp")
    job["parallel"]["pp"] = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}
    proc = torchrun_train(job, tmp_path, "pp")
    run = tmp_path / "pp"
    losses = losses_of(run)
    assert sorted(losses) == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([losses[s] for s in (1, 2, 3)]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)

    # validation by the whole model, assembled on rank 0 from the pipeline checkpoint
    evals = [r["eval"] for r in read_metrics(run / "metrics.jsonl") if "eval" in r]
    assert evals == [ref["eval"]] and set(ref["eval"]) == {r["task"] for r in demo_records("val", limit=4)}
    assert "validation exact match" in proc.stdout
    _check_final_model(MultimodalModel.from_pretrained(run / "final", "eager"), single.model, initial)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_00000{s}" for s in (1, 2, 3)]

    _check_timeline(run)
    assert "pipeline timeline" in proc.stdout and str(run / "timeline.json") in proc.stdout

    # resume from step 1 into a fresh run directory: steps 2 and 3 as in the uninterrupted run
    job["metrics"]["run_dir"] = str(tmp_path / "resumed")
    torchrun_train(job, tmp_path, "resumed", f"--resume={run / 'checkpoints' / 'step_000001'}")
    resumed = losses_of(tmp_path / "resumed")
    assert sorted(resumed) == [2, 3]
    torch.testing.assert_close(torch.tensor([resumed[2], resumed[3]]), torch.tensor([losses[2], losses[3]]),
                               rtol=1e-5, atol=0)


def _check_final_model(final: MultimodalModel, ref: MultimodalModel, initial: dict) -> None:
    """The PP run's final model equals the single-process model after the same steps (trained parameters
    moved away from their initial values, so a model loaded from the wrong place fails). Key-projection
    biases are skipped: their gradient is zero in exact arithmetic (softmax is shift-invariant), and AdamW
    turns rounding noise there into full-size updates."""
    ref_params = dict(ref.named_parameters())
    compared = moved = 0
    for name, param in final.named_parameters():
        if name.endswith("k_proj.bias"):
            continue
        torch.testing.assert_close(param, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
        compared += 1
        moved += int(float((ref_params[name].detach() - initial[name]).abs().max()) > 1e-4)
    assert compared == len(ref_params) - sum(n.endswith("k_proj.bias") for n in ref_params)
    assert moved > 0.5 * compared


def _check_timeline(run) -> None:
    """Chrome trace of the last step: both ranks, F and B of both microbatches per rank, 1F1B order (the last
    stage alternates F0 B0 F1 B1; the first one warms up with one forward: F0 F1 B0 B1)."""
    trace = json.loads((run / "timeline.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    events = read_chrome_trace(run / "timeline.json")["measured"]
    m = GLOBAL_BATCH // MICROBATCH
    order = {r: [f"{e.kind}{e.microbatch}" for e in sorted(events, key=lambda e: e.start_s) if e.rank == r]
             for r in (0, 1)}
    assert order == {0: ["F0", "F1", "B0", "B1"], 1: ["F0", "B0", "F1", "B1"]} and m == 2
    assert all(e.stage == e.rank and e.end_s >= e.start_s for e in events)
    assert (run / "timeline.png").read_bytes()[:4] == b"\x89PNG"


# ----- configuration (no processes) ------------------------------------------------------------
@pytest.mark.parametrize("pp, expected", [
    (PipelineConfig(degree=4), {"vision": 1, "audio": 1, "llm": 2}),
    (PipelineConfig(degree=4, stages={"vision": 2}), {"vision": 2, "audio": 1, "llm": 1}),
    (PipelineConfig(degree=2, layout="encoders_colocated"), {"vision": 1, "audio": 1, "llm": 1}),
    (PipelineConfig(degree=5, layout="encoders_colocated", stages={"audio": 2}), {"vision": 2, "audio": 2, "llm": 3}),
])
def test_stage_counts_fill_in_defaults(pp, expected):
    assert pipeline_stage_counts(pp, ["vision", "audio"]) == expected


@pytest.mark.parametrize("pp, cp, message", [
    ({"degree": 0}, 1, "parallel.pp.degree must be >= 1"),
    ({"degree": 2}, 1, "leaving none for the LLM"),
    ({"degree": 3, "stages": {"llm": 2}}, 1, "give 4 stages"),
    ({"degree": 4, "stages": {"speech": 1}}, 1, "unknown module(s) ['speech']"),
    ({"degree": 4, "stages": {"llm": 0}}, 1, "parallel.pp.stages.llm must be an integer >= 1"),
    ({"degree": 4, "layout": "encoders_colocated", "stages": {"vision": 1, "audio": 2}}, 1, "same stage count"),
    ({"degree": 4, "schedule": "zb"}, 1, "parallel.pp.schedule must be one of"),
    ({"degree": 4, "schedule": "memory_capped_1f1b"}, 1, "parallel.pp.cap must be >= 1"),
    ({"degree": 4, "cap": 2}, 1, "only used by schedule 'memory_capped_1f1b'"),
])
def test_bad_pipeline_configs_are_refused(tmp_path, pp, cp, message):
    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel={"cp": cp, "pp": pp}))
    with pytest.raises(ValueError) as err:
        validate(cfg)
    assert message in str(err.value)


def test_pipeline_trainer_needs_a_multiple_of_the_degree_in_processes(tmp_path):
    from plait.train.pipeline_trainer import PipelineTrainer

    cfg = config_from_dict(tiny_config_dict("train.jsonl", parallel={"pp": {"degree": 2}}))
    with pytest.raises(ValueError, match="does not fit the world size 1"):
        PipelineTrainer.build(cfg)
    with pytest.raises(ValueError, match="pipeline jobs run with PipelineTrainer"):
        Trainer.build(cfg)
