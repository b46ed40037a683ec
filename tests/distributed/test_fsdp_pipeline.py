"""FSDP2 under pipeline parallelism: PP=2 x ``parallel.dp_shard=2`` under torchrun (gloo, 4 processes) equals one
process on the same global batches: losses (rel 1e-5), first-step gradients and final parameters after AdamW steps
(``assert_same_training``, the tolerances of ``test_fsdp.py``), with frozen encoders + trainable projectors (deferral
on: hierarchical plans that defer; validation through the sharded stages equals one process's too, and
its checkpoint resumes in one process) and with everything trainable (encoders on the first LLM rank, the LLM cut in
two stages with its embedding tied to the head on the other rank, activation checkpointing, a pipeline whose share
of the batch holds no image, then a step whose global batch holds no audio: the audio branch's parameters and AdamW
state (weight decay 0.1) stay as one process leaves them); and the runtime alone with a split-backward schedule
(``W`` actions) on 2 shard ranks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from plait.models.units import model_units, unit_specs
from plait.parallel.fsdp import apply_fsdp
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.schedules import build_schedule
from plait.train.loss import token_loss_sum
from plait.train.metrics import read_metrics
from tests.helpers.jobs import ROOT, demo_records, write_jsonl
from tests.distributed.pipeline_worker import apply_mode, make_batch, reference_step, tiny_model
from tests.distributed.spawning import free_port, gloo_group, spawn_and_wait
from tests.helpers.fsdp import assert_equal_runs, assert_same_params, assert_untouched_without, job, run
from tests.helpers.stages import SPLIT, on_one_rank

WORKER = ROOT / "tests" / "distributed" / "fsdp_pipeline_worker.py"


def pipeline(**pp) -> dict:
    """``[parallel.pp]`` of degree 2, 1F1B (``pp`` updates it)."""
    return {"degree": 2, "layout": "encoders_colocated", "schedule": "1f1b", **pp}


def with_validation(cfg: dict, tmp_path) -> dict:
    """``cfg`` validating 5 demo samples (loss and 3-token answers) after its second step."""
    cfg["data"]["val"] = str(write_jsonl(tmp_path / "val.jsonl", demo_records("val", limit=5)))
    cfg["train"].update(eval_every=2, max_new_tokens=3)
    return cfg


def val_loss(tmp_path, name: str) -> float:
    """The validation loss run ``name`` wrote to its metrics."""
    return next(r["val_loss"] for r in read_metrics(tmp_path / f"run_{name}" / "metrics.jsonl") if "val_loss" in r)


def test_pp2_fsdp2_frozen_encoders_trainable_projectors_with_deferral(tmp_path):
    single = run(with_validation(job(tmp_path, True), tmp_path), tmp_path, "single", 1, WORKER)
    both = run(with_validation(job(tmp_path, True, dp_shard=2, pp=pipeline()), tmp_path), tmp_path, "pp_fsdp", 4,
               WORKER)
    assert val_loss(tmp_path, "pp_fsdp") == pytest.approx(val_loss(tmp_path, "single"), rel=1e-5)  # gathered
    assert both["sharded"] and both["dp"] == 2 and both["world"] == 4
    assert len(both["deferred"]) >= 1  # encoder features buffered on the first LLM stage, sharded projectors
    encoders, llm = both["groups"][0], both["groups"][1]  # ranks: (shard x 2 + pipeline rank)
    assert (both["groups"][2], both["groups"][3]) == (encoders, llm)  # both shard ranks of a stage shard alike
    assert any("projector" in g for g in encoders) and not any(".encoder." in g for g in encoders)  # frozen
    assert not any(g.startswith("language_model.") for g in encoders)  # each rank shards only its own stages
    assert sum(".layers." in g for g in llm) == 2 and not any(g.startswith("encoders.") for g in llm)
    assert_equal_runs(single, both)
    # its step-1 checkpoint (sharded stages) resumed by one process: DCP reshards, the last step repeats exactly
    resumed = run(job(tmp_path, True), tmp_path, "resumed", 1, resume_from=str(
        tmp_path / "run_pp_fsdp" / "checkpoints" / "step_000001"))
    assert resumed["start"] == 1
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(single["losses"][1:]), rtol=1e-5, atol=0)
    assert_same_params(single, resumed)


def test_pp2_fsdp2_all_trainable_tied_embeddings_and_a_pipeline_without_images(tmp_path):
    images = demo_records("train", ("image_digit",), limit=3)
    others = demo_records("train", ("audio_transcribe",), limit=3) + demo_records("train", ("text",), limit=2)
    train = {"microbatch_policy": "arrival", "activation_checkpointing": "full", "weight_decay": 0.1}
    cfg = job(tmp_path, False, images + others, train)
    cfg["model"]["llm"]["config"]["tie_word_embeddings"] = True
    single = run(cfg, tmp_path, "single", 1, WORKER, step_without="audio")
    pp = pipeline(attach_encoders=True, stages={"vision": 1, "audio": 1, "llm": 2})
    both = run(job(tmp_path, False, images + others, train, dp_shard=2, pp=pp) | {"model": cfg["model"]}, tmp_path,
               "pp_fsdp", 4, WORKER, step_without="audio")
    assert both["sharded"] and both["dp"] == 2
    assert min(both["images_per_rank"]) == 0 < max(both["images_per_rank"])  # its encoder groups reduce zeros
    embed = "language_model.model.embed_tokens"
    assert embed not in " ".join(both["groups"][0]) and "lm_head" not in " ".join(both["groups"][1])  # replicated
    assert any(".encoder.layers." in g for g in both["groups"][0])  # encoder layers sharded on pipeline rank 0
    assert len(both["tied_head"]) == 2  # the head's copy, on pipeline rank 1 of both shard pipelines
    for head in both["tied_head"]:  # stays equal to the embedding (gradients summed over the two copies)
        torch.testing.assert_close(head, both["params"][embed + ".weight"], rtol=0, atol=0)
    assert_equal_runs(single, both)
    assert_untouched_without(single, both, 2)  # a step without audio: the audio groups' zeros dropped, as unused


def _split_backward_worker(rank: int, port: int, out: str) -> None:
    """Shard rank ``rank`` of dp_shard=2: every stage of a 5-stage plan on its one pipeline rank, a split-backward
    schedule (``W`` actions: weight gradients by ``autograd.grad`` on the gathered parameters), its own share of
    the batch (rank 1: no audio, so the audio encoder's groups reduce zeros); rank 0 saves every full gradient."""
    with gloo_group(rank, 2, port):
        model = apply_mode(tiny_model(tied=True), "all")
        plan = on_one_rank(plan_pipeline(model_units(model), "encoder_parallel", stages_per_module=SPLIT))
        specs = unit_specs(model)
        stages = build_rank_stages(model, plan, 0)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        sharded = apply_fsdp(model, specs, mesh, "cpu")
        comm = build_pipeline_comm(1, "cpu", 1, 0, 2)
        batches = [make_batch(k, i) for i, k in enumerate(SHARES[rank])]
        targets = sum(make_batch(k, i).target_tokens for share in SHARES for i, k in enumerate(share))
        schedule = build_schedule(plan, "1f1b", len(batches), split_backward=True)
        res = run_pipeline_step(stages, schedule, batches, targets, comm, loss_fn=token_loss_sum, sharded=sharded)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in stages.trainable_parameters() if p.grad is not None}
        if rank == 0:
            torch.save({"grads": grads, "loss": res.loss, "groups": list(sharded.names)}, out)


SHARES = (("iva", "t"), ("i", "it"))


def test_fsdp2_with_a_split_backward_schedule_equals_one_process(tmp_path):
    model = apply_mode(tiny_model(tied=True), "all")
    batches = [make_batch(k, i) for r in SHARES for i, k in enumerate(r)]
    loss = reference_step(model, batches)
    out = tmp_path / "split.pt"
    spawn_and_wait(_split_backward_worker, (free_port(), str(out)), 2, 120, "FSDP2 split-backward pipeline")
    got = torch.load(out)
    assert sum(".layers." in g for g in got["groups"]) >= 6 and got["loss"] == pytest.approx(loss, rel=1e-5)
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(ref) and len(ref) > 30
    for name, grad in ref.items():
        tol = 1e-5 * float(grad.abs().max()) + 1e-9
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=tol, msg=name)


def test_pp2_fsdp2_numbered_pipeline_outermost_equals_one_process(tmp_path):
    """``parallel.rank_order = "pp_outer"``: ranks 0, 1 are pipeline rank 0's two shard ranks (one node's FSDP2 group
    on consecutive ranks), ranks 2, 3 pipeline rank 1's; training equals one process as under the default order."""
    single = run(job(tmp_path, True), tmp_path, "single", 1, WORKER)
    cfg = job(tmp_path, True, dp_shard=2, pp=pipeline())
    cfg["parallel"]["rank_order"] = "pp_outer"
    both = run(cfg, tmp_path, "pp_outer", 4, WORKER)
    assert both["sharded"] and both["dp"] == 2 and both["world"] == 4
    groups = both["groups"]  # per global rank: the FSDP2 groups it shards
    assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2]
    assert any("projector" in g for g in groups[0]) and all(g.startswith("language_model.") for g in groups[2])
    assert_equal_runs(single, both)
