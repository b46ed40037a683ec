"""Deferred encoder outputs in the pipeline runtime (issue 5, Build 3): a hierarchical microbatch plan that runs some
samples' LLM work in a later microbatch than their encoder work gives the same loss and gradients as one process
on the same global batch in arrival order; a plan without deferral runs exactly as before. Cases and checks in
tests/distributed/pipeline_deferral_worker.py."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from plait.models.units import model_units
from plait.parallel.pipeline import run_pipeline_step
from plait.planner.microbatch.routing import FeatureRouting
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from tests.helpers.jobs import tiny_config_dict, write_jsonl
from tests.distributed import pipeline_deferral_worker as w
from tests.distributed.pipeline_worker import apply_mode, reference_step, tiny_model
from tests.distributed.spawning import free_port, spawn_and_wait
from plait.train.loss import token_loss_sum
from tests.helpers.deferral import assert_same_training, deferral_records
from tests.helpers.pipeline_deferral import deferral_train


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models gain nothing from two, and on shared cores two can be 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _one_rank(layout: dict, mode: str, m: int):
    """A model, its reference copy and all its pipeline stages on pipeline rank 0 (one process)."""
    model = apply_mode(tiny_model(), mode)
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), layout["layout"], stages_per_module=layout["stages_per_module"])
    plan = plan.replace(stages=tuple(dataclasses.replace(s, rank=0) for s in plan.stages))
    return build_rank_stages(model, plan, 0), ref, plan


def _grads(stages) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in stages.trainable_parameters() if p.grad is not None}


def test_the_deferring_plan_defers_and_reads_features_only_from_earlier_encoder_microbatches():
    plan = w.deferring_plan(1, 3, 0)
    deferred = plan.deferred()
    assert deferred and all(j > i for _, _, i, j in deferred)
    _, routing, _ = w.routed_microbatches(plan, 0, [w.make_sample(m, t, k) for k, (m, t) in enumerate(w.SAMPLES)])
    for j, sources in enumerate(routing.sources):
        assert all(i <= j for i in sources)
    # the features of an encoder microbatch are the concatenation of its samples' rows, per branch
    for i, keys in enumerate(routing.encoder_samples):
        for branch in ("vision", "audio"):
            spans = [routing.rows[k][branch] for k in keys if branch in routing.rows[k]]
            assert [a for a, _ in spans] == [sum(b - a for a, b in spans[:n]) for n in range(len(spans))]


@pytest.mark.parametrize("mode", ["all", "projectors"])
def test_one_process_deferral_equals_arrival_order(mode):
    stages, ref, plan = _one_rank(w.ENC_PAR, mode, 3)
    mb_plan = w.deferring_plan(1, 3, 0)
    samples = [w.make_sample(m, t, k) for k, (m, t) in enumerate(w.SAMPLES)]
    batches, routing, enc_batches = w.routed_microbatches(mb_plan, 0, samples)
    targets = sum(b.target_tokens for b in samples)
    res = run_pipeline_step(stages, build_schedule(plan, "1f1b", 3), batches, targets, routing=routing,
                            encoder_batches=enc_batches, loss_fn=token_loss_sum)
    expected = reference_step(ref, [w.stack(samples[k : k + 3]) for k in range(0, 7, 3)])
    assert abs(res.loss - expected) <= 1e-5 * abs(expected)
    ref_params = dict(ref.named_parameters())
    grads = _grads(stages)
    assert grads.keys() == {n for n, p in ref_params.items() if p.grad is not None}
    largest = max(float(g.abs().max()) for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-5, atol=1e-5 * largest)
    # encoder microbatch 0 is read by LLM microbatches 0 and 2: its features stay buffered across boundaries 0, 1
    assert routing.users[0] == (0, 2) and res.buffered_peak_bytes == w.buffered_bytes(mb_plan, 0) > 0


def test_identity_routing_runs_exactly_like_no_routing():
    """A plan without deferral: the routed path (encoder view = LLM view) gives bit-identical results."""
    samples = [w.make_sample(m, t, k) for k, (m, t) in enumerate(w.SAMPLES)]
    groups = ((0, 1, 2), (3, 4), (5, 6))
    batches = [w.stack([samples[k] for k in g]) for g in groups]
    features = {k: {"vision": sum(w.FEATURES[c] for c in m if c in "iI"), "audio": 7 * m.count("a")}
                for k, (m, _) in enumerate(w.SAMPLES)}
    routing = FeatureRouting(groups, groups, features)
    assert not routing.defers
    results = []
    for use in (None, routing):
        stages, _, plan = _one_rank(w.ENC_PAR, "all", 3)
        res = run_pipeline_step(stages, build_schedule(plan, "1f1b", 3), batches, 50, routing=use,
                                encoder_batches=batches if use else None, loss_fn=token_loss_sum)
        results.append((res.loss, _grads(stages), res.buffered_peak_bytes))
    assert results[0][0] == results[1][0] and results[0][1].keys() == results[1][1].keys()
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])
    assert results[1][2] == 0  # nothing is held across a microbatch boundary


def test_pipeline_deferral_with_pp2xdp2_and_pp2xcp2_equals_one_process():
    """4 gloo processes, PP 2 x DP 2: 1F1B and GPipe, trainable encoders and frozen encoders + LLM with trainable
    projectors, split backward (colocated encoders); then PP 2 x CP 2 with trainable encoders."""
    spawn_and_wait(w.worker, (4, free_port()), 4, 240, "pipeline deferral test with 4 processes")


def test_pipeline_trainer_defers_and_trains_like_one_process_in_arrival_order(tmp_path):
    """``plait train`` with PP = 2 and the hierarchical plan (deferral on) equals one process with arrival order."""
    data = write_jsonl(tmp_path / "train.jsonl", deferral_records())
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"), data={"shuffle": False},
                           train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2, "threads": 1,
                                  "microbatch_policy": "arrival"}, parallel={"timeout_s": 60})
    single = deferral_train(cfg, tmp_path, "single", 1)
    cfg["train"]["microbatch_policy"] = "hierarchical"
    cfg["parallel"]["pp"] = {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b"}
    pp = deferral_train(cfg, tmp_path, "pp", 2)
    assert not single["deferred"] and single["buffered"] == 0
    assert len(pp["deferred"]) >= 1 and pp["buffered"] > 0
    assert any(n.startswith("encoders.vision.encoder") for n in single["grads"])  # encoders train
    assert_same_training(single, pp)
    metrics = [json.loads(line) for line in (tmp_path / "run_pp" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "loss" in r]
    assert steps and all(r["deferred_samples"] >= 1 and r["encoder_buffer_peak_bytes"] > 0 for r in steps)
