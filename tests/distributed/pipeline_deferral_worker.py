"""Deferral test cases for the pipeline runtime (spawned by tests/distributed/test_pipeline_deferral.py): one-row
synthetic samples, a hierarchical microbatch plan that defers some samples' LLM work to a later microbatch, and
the per-rank check that a pipeline step with a :class:`FeatureRouting` equals one process training the same
global batch in arrival order (no deferral)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.attention.interface import use_plait_attention
from plait.data.collate import Batch
from plait.models.units import model_units
from plait.parallel.context import build_cp_shard
from plait.parallel.pipeline import build_pipeline_comm, run_pipeline_step
from plait.parallel.stages import build_rank_stages
from plait.planner.microbatch import MicrobatchPlan, MicrobatchPolicy, SampleCost, plan_microbatches
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.microbatch.routing import FeatureRouting
from plait.planner.pipeline.schedules import build_schedule
from tests.distributed.pipeline_worker import (
    AUD,
    COLOC,
    ENC_PAR,
    IMG,
    _check_coverage,
    _check_grads,
    _close,
    apply_mode,
    cp_assignment,
    mask_of,
    reference_cp_step,
    reference_step,
    tiny_model,
    with_items,
)
from plait.train.loss import token_loss_sum
from tests.distributed.spawning import gloo_group

# one sample per entry: media ("i": a 16x16 image, 4 features; "I": a 24x32 image, 12; "a": a 0.5 s clip, 7;
# "" text only) and text tokens. The planner costs (vision, audio, LLM work) make the hierarchical plan defer.
SAMPLES = (("i", 2), ("i", 20), ("a", 3), ("a", 18), ("Ia", 4), ("iI", 3), ("", 5))
FEATURES = {"i": 4, "I": 12, "a": 7}


def sample_costs() -> list[SampleCost]:
    """Synthetic per-module work of :data:`SAMPLES` (features per branch; text tokens for the LLM)."""
    out = []
    for k, (media, text) in enumerate(SAMPLES):
        vision = sum(FEATURES[c] for c in media if c in "iI")
        audio = sum(FEATURES[c] for c in media if c == "a")
        out.append(SampleCost(k, (vision, audio, text)))
    return out


def deferring_plan(dp: int, m: int, step: int) -> MicrobatchPlan:
    """The hierarchical plan of :data:`SAMPLES` (deferral allowed) for ``dp`` replicas of ``m`` microbatches."""
    return plan_microbatches(sample_costs(), MicrobatchPolicy(dp=dp, num_microbatches=m), step)


def make_sample(media: str, text: int, seed: int) -> Batch:
    """A one-row batch: one text token, the placeholders of ``media`` in order, then ``text - 1`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    placeholders: list[int] = []
    inputs: dict = {}
    for c in media:
        if c in "iI":
            h, w = (16, 16) if c == "i" else (24, 32)
            placeholders += [IMG] * FEATURES[c]
            inputs.setdefault("vision", {"pixel_values": []})["pixel_values"].append(torch.randn(3, h, w, generator=g))
        else:
            placeholders += [AUD] * FEATURES[c]
            inputs["audio"] = {"input_features": torch.randn(1, 80, 300, generator=g),
                               "num_samples": torch.tensor([8000])}
    words = torch.randint(1, 40, (max(text, 2),), generator=g).tolist()
    ids = torch.tensor([words[:1] + placeholders + words[1:]])
    labels = torch.roll(ids, -1, 1)
    labels[(labels == IMG) | (labels == AUD)] = -100
    labels[:, -1] = -100
    width = ids.shape[1]
    return Batch(ids, labels, torch.ones_like(ids), torch.arange(width).unsqueeze(0), torch.zeros_like(ids),
                 torch.full_like(ids, -1), inputs, ())


def stack(samples: list[Batch]) -> Batch:
    """One-row batches as one right-padded batch; media inputs in row-major order."""
    width = max(b.input_ids.shape[1] for b in samples)

    def cat(name: str, value: int) -> torch.Tensor:
        return torch.cat([F.pad(getattr(b, name), (0, width - b.input_ids.shape[1]), value=value) for b in samples])

    inputs: dict = {}
    pixels = [p for b in samples for p in b.modality_inputs.get("vision", {}).get("pixel_values", [])]
    if pixels:
        inputs["vision"] = {"pixel_values": pixels}
    clips = [b.modality_inputs["audio"] for b in samples if "audio" in b.modality_inputs]
    if clips:
        inputs["audio"] = {"input_features": torch.cat([c["input_features"] for c in clips]),
                           "num_samples": torch.cat([c["num_samples"] for c in clips])}
    return Batch(cat("input_ids", 0), cat("labels", -100), cat("attention_mask", 0), cat("position_ids", 0),
                 cat("document_ids", -1), cat("item_ids", -1), inputs, ())


def routed_microbatches(plan: MicrobatchPlan, rank: int, samples: list[Batch]) -> tuple[list, FeatureRouting, list]:
    """DP replica ``rank``'s LLM batches (None when empty), the routing of its encoder view (sample keys are
    positions in the global batch) and the encoder view's batches (None when empty)."""
    enc, llm = plan.microbatches[rank], plan.llm_microbatches(rank)
    features = {k: {"vision": sum(FEATURES[c] for c in media if c in "iI"),
                    "audio": sum(FEATURES[c] for c in media if c == "a")} for k, (media, _) in enumerate(SAMPLES)}
    routing = FeatureRouting(enc, llm, features)
    return ([stack([samples[k] for k in mb]) if mb else None for mb in llm], routing,
            [stack([samples[k] for k in mb]) if mb else None for mb in enc])


def buffered_bytes(plan: MicrobatchPlan, rank: int, hidden: int = 32) -> int:
    """Peak bytes of fp32 features ``[rows, hidden]`` the first LLM stage holds across a microbatch boundary,
    from the plan alone: after LLM microbatch ``k``, every encoder microbatch ``i <= k`` that a later LLM
    microbatch still reads (all its branches' rows)."""
    rows = [sum(FEATURES[c] for k in mb for c in SAMPLES[k][0]) for mb in plan.microbatches[rank]]
    last = [max(js, default=-1) for js in plan.llm_microbatch[rank]]
    held = [sum(rows[i] for i in range(k + 1) if last[i] > k) for k in range(plan.num_microbatches)]
    return max(held) * hidden * 4


@dataclass(frozen=True)
class DeferralCase:
    """A pipeline configuration (as :class:`tests.distributed.pipeline_worker.Case`) trained for ``steps`` steps on
    the global batch :data:`SAMPLES` (new data per step) with the hierarchical plan of ``m`` microbatches per
    replica; the reference runs the same samples in arrival order in ``m * dp`` microbatches."""

    name: str
    layout: str
    stages_per_module: dict
    ranks: tuple[int, ...]
    schedule: str
    mode: str
    m: int
    steps: int = 2
    options: dict = field(default_factory=dict)
    cp: int = 1


# run on 4 processes; the first five as PP 2 x DP 2 (encoder_parallel: vision 2 stages, audio 1, LLM 2 on ranks 0,1,0,1,0), 2 hierarchical
# microbatches per replica; each replica defers one sample, so one encoder microbatch feeds both LLM microbatches
# and one LLM microbatch reads both encoder microbatches
CASES = (
    DeferralCase("encpar-1f1b-all", **ENC_PAR, schedule="1f1b", mode="all", m=2),
    DeferralCase("encpar-gpipe-all", **ENC_PAR, schedule="gpipe", mode="all", m=2),
    DeferralCase("encpar-1f1b-projectors", **ENC_PAR, schedule="1f1b", mode="projectors", m=2),
    DeferralCase("encpar-gpipe-projectors", **ENC_PAR, schedule="gpipe", mode="projectors", m=2),
    DeferralCase("coloc-1f1b-all-split-backward", **COLOC, schedule="1f1b", mode="all", m=2,
                 options={"split_backward": True, "defer_weight_grad": True}),
    # PP 2 x CP 2 (one replica, 3 microbatches, 3 deferred samples): plait attention, each CP rank's LLM tokens
    DeferralCase("pp2xcp2-encpar-1f1b-all", **ENC_PAR, schedule="1f1b", mode="all", m=3, cp=2),
)


def run_case(case: DeferralCase) -> None:
    """Train ``case`` on this rank and on a private single-process reference (SGD), checking the loss and every
    trainable parameter's gradient each step, that the plan defers and that deferred features were buffered."""
    pp = 1 + max(case.ranks)
    comm = build_pipeline_comm(pp, cp_size=case.cp)
    model = apply_mode(tiny_model(), case.mode)
    if case.cp > 1:
        use_plait_attention(model.language_model, "sdpa")
    ref = copy.deepcopy(model)
    plan = plan_pipeline(model_units(model), case.layout, stages_per_module=case.stages_per_module, ranks=case.ranks)
    stages = build_rank_stages(model, plan, comm.pp_rank)
    schedule = build_schedule(plan, case.schedule, case.m, **case.options)
    params = [p for _, p in stages.trainable_parameters()]
    opt = torch.optim.SGD(params, lr=0.5) if params else None
    ref_opt = torch.optim.SGD([p for _, p in ref.trainable_parameters()], lr=0.5)
    covered: set[str] = set()
    needed: set[str] = set()
    first_llm = plan.llm_stages[0]
    for step in range(case.steps):
        where = f"{case.name} step {step} rank {dist.get_rank()}"
        mb_plan = deferring_plan(comm.dp_size, case.m, step)
        assert any(r == comm.dp_rank for _, r, _, _ in mb_plan.deferred()), f"{where}: the plan defers nothing"
        samples = [make_sample(media, text, 100 * step + k) for k, (media, text) in enumerate(SAMPLES)]
        batches, routing, enc_batches = routed_microbatches(mb_plan, comm.dp_rank, samples)
        assert routing.defers
        targets = sum(b.target_tokens for b in samples)
        per = -(-len(samples) // (case.m * comm.dp_size))
        arrival = [stack(samples[k : k + per]) for k in range(0, len(samples), per)]
        if case.cp > 1:  # multimodal mask metadata; each LLM microbatch's tokens LPT-spread over the CP ranks
            batches = [None if b is None else with_items(b) for b in batches]

            def llm_kwargs(batch: Batch) -> dict:
                shard = build_cp_shard(cp_assignment(batch, case.cp), comm.cp_rank, comm.cp_group)
                return {"plait_mask": mask_of(batch), "plait_cp": shard}

            kwargs = [{} if b is None else llm_kwargs(b) for b in batches]
            res = run_pipeline_step(stages, schedule, batches, targets, comm, routing=routing, llm_kwargs=kwargs,
                                    encoder_batches=enc_batches, loss_fn=token_loss_sum)
            expected_loss = reference_cp_step(ref, [with_items(b) for b in arrival])
        else:
            res = run_pipeline_step(stages, schedule, batches, targets, comm, routing=routing,
                                    encoder_batches=enc_batches, loss_fn=token_loss_sum)
            expected_loss = reference_step(ref, arrival)
        _close(res.loss, expected_loss, f"{where}: loss")
        covered.update(_check_grads(stages, ref, where))
        needed.update(n for n, p in ref.trainable_parameters() if p.grad is not None)
        expected = buffered_bytes(mb_plan, comm.dp_rank) if plan.stages[first_llm].rank == comm.pp_rank else 0
        assert res.buffered_peak_bytes == expected, f"{where}: {res.buffered_peak_bytes} bytes buffered, not {expected}"
        for o in (opt, ref_opt):
            if o is not None:
                o.step()
                o.zero_grad(set_to_none=True)
    _check_coverage(covered, needed, case.name)


def worker(rank: int, world: int, port: int) -> None:
    """Entry point of one spawned process: run every case of :data:`CASES`."""
    with gloo_group(rank, world, port):
        for case in CASES:
            run_case(case)


# ----- PipelineTrainer (run under torchrun by the test) ----------------------------------------------------------
def trainer_main(config_path: str, out_prefix: str) -> None:
    """Train a job (config JSON) with ``PipelineTrainer`` (``parallel.pp.degree`` > 1) or ``Trainer``: first the
    gradients of the first global batch (positions ``0..global_batch_size-1``, unshuffled) by its plan, then
    ``fit``. Each rank writes ``<out_prefix>.<rank>.pt``: its owned gradients and final parameters, the losses,
    the plan's deferred samples and the job's peak buffered bytes of that first step."""
    import json

    from plait.config.loader import config_from_dict
    from plait.train.pipeline_trainer import PipelineTrainer
    from plait.train.trainer import Trainer

    cfg = config_from_dict(json.loads(open(config_path).read()))
    trainer = PipelineTrainer.build(cfg) if cfg.parallel.pp.degree > 1 else Trainer.build(cfg)
    first = list(range(cfg.train.global_batch_size))
    plan, _ = trainer.plan_step(first)
    trainer.forward_backward(first, plan)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    buffered = trainer.encoder_buffer_peak_bytes
    if trainer.optimizer is not None:
        trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.fit()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save({"losses": result["losses"], "params": params, "grads": grads, "deferred": plan.deferred(),
                "dp": plan.dp, "buffered": buffered}, f"{out_prefix}.{trainer.info.rank}.pt")
    if trainer.info.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    trainer_main(sys.argv[1], sys.argv[2])
