"""Deferral in the trainer: a sample's LLM work runs in a later microbatch than its encoder work (detached-leaf
re-injection of the buffered encoder outputs). Training with the hierarchical assignment (deferral on) must
equal arrival-order training on the same global batches (the loss normalisation makes gradients independent
of grouping), with trainable encoders (the deferred encoder backward path) and with frozen ones."""

from __future__ import annotations

import json

import pytest

from plait.train.trainer import Trainer
from tests.helpers.deferral import assert_same_training, deferral_records


def train(tiny_job, policy: str, frozen: bool, steps: int = 3) -> dict:
    """``steps`` optimizer steps on the whole (fixed-order) set as one global batch of 4 microbatches.
    Returns the first step's plan, gradients and buffered bytes, the per-step losses and the parameters."""
    cfg = tiny_job(deferral_records(), data={"shuffle": False},
                   train={"steps": steps, "global_batch_size": 8, "microbatch_size": 2, "microbatch_policy": policy})
    if frozen:
        for enc in cfg.model.encoders.values():
            enc.freeze, enc.freeze_projector = True, True
    trainer = Trainer.build(cfg)
    batch = list(range(8))
    plan, _ = trainer.plan_step(batch)
    trainer.forward_backward(batch, plan)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    buffered = trainer.encoder_buffer_peak_bytes
    trainer.optimizer.zero_grad(set_to_none=True)
    results = [trainer.train_step(batch) for _ in range(steps)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"plan": plan, "grads": grads, "buffered": buffered, "losses": [r.loss for r in results],
            "results": results, "params": params, "trainer": trainer}


def deferred_bytes(run: dict) -> int:
    """Peak bytes of encoder outputs kept across a microbatch boundary, recomputed from the plan: per boundary,
    the full output rows (every branch) of each encoder microbatch that a later LLM microbatch still reads."""
    trainer, plan = run["trainer"], run["plan"]
    hidden = trainer.model.language_model.get_input_embeddings().embedding_dim
    rows = []
    for mb in plan.microbatches[0]:
        ids = [trainer.train_set[i].input_ids for i in mb]
        rows.append(sum(int((x == pid).sum()) for x in ids for pid in trainer.model.placeholder_ids.values()))
    last = [max(js, default=-1) for js in plan.llm_microbatch[0]]
    peaks = [sum(rows[i] for i in range(len(rows)) if i <= k < last[i]) for k in range(plan.num_microbatches)]
    return max(peaks) * hidden * 4  # fp32


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable-encoders", "frozen-encoders"])
def test_deferred_training_equals_arrival_order(tiny_job, frozen):
    arrival = train(tiny_job, "arrival", frozen)
    deferred = train(tiny_job, "hierarchical", frozen)
    assert not arrival["plan"].deferred()
    assert len(deferred["plan"].deferred()) >= 1, "the mix must make the planner defer"
    encoder_grads = [n for n in deferred["grads"] if n.startswith("encoders.")]
    assert bool(encoder_grads) != frozen  # the leaf re-injection path runs exactly when encoders train
    assert_same_training(arrival, deferred)
    assert arrival["buffered"] == 0
    assert deferred["buffered"] == deferred_bytes(deferred) > 0
    assert deferred["results"][0].deferred_samples == len(deferred["plan"].deferred())


def test_metrics_hold_balance_and_buffer_figures(tiny_job, tmp_path):
    cfg = tiny_job(deferral_records(), data={"shuffle": False},
                   train={"steps": 2, "global_batch_size": 8, "microbatch_size": 2})
    trainer = Trainer.build(cfg)
    trainer.fit()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for rec in steps:
        assert set(rec["workload"]) == {"vision", "audio", "llm"}
        for module, stats in rec["workload"].items():
            assert stats["cv"] >= 0 and stats["max_over_mean"] >= 1.0, module
        assert rec["deferred_samples"] >= 1 and rec["encoder_buffer_peak_bytes"] > 0
    batch = trainer.train_set[0]
    with pytest.raises(ValueError, match="not both"):
        trainer.model(batch.input_ids[None], {"vision": {}}, features={})
