"""The pipelined step runner of :class:`~plait.train.trainer.Trainer` (``parallel.pp.degree`` > 1): forward/backward
of a step, validation and the timeline through this rank's pipeline stages.

Layout: world size = DP x PP x CP, ranks laid out by :class:`~plait.parallel.dims.ParallelDims`: the CP axis is
innermost, so the CP group of each stage is a run of consecutive ranks, and without CP each pipeline is a run of
consecutive ranks. With ``parallel.cp`` > 1 every stage is replicated over its CP group: encoder stages run whole on
each CP rank, the LLM stages only on the CP rank's tokens (the same ``plan_tokens`` assignment as the flat runner),
each pipeline (one CP index) passing only those tokens' hidden states, and gradients are summed over the DP x CP
copies of each stage. With ``parallel.dp_shard`` > 1 (FSDP2, HSDP when ``parallel.dp`` > 1 too) every shard rank
runs its own pipeline on its own share of the batch, and each rank shards only its own stages' trainable units over
the ``dp x dp_shard`` ranks of its stage (an embedding tied to the head on another pipeline rank stays replicated):
gathered once per step, reduced once after each stage's last backward action (:mod:`plait.parallel.fsdp`).

The plan (:func:`build_pipeline_plan`) is ``plan_pipeline(model_units(model), parallel.pp.layout, ...)`` with the
counts, splits and stage ranks of :func:`plait.config.loader.pipeline_plan_kwargs`: stage ``i`` on pipeline rank
``i`` by default; with ``parallel.pp.virtual_stages = v`` > 1 the LLM's ``v p`` stages cyclic over its ``p`` ranks
(interleaved 1F1B, Narayanan et al., SC'21, section 2.2.2), and with ``parallel.pp.attach_encoders`` the encoder
stages on the first LLM rank: the placement ``plait.planner.search.layout.plan_layout`` chooses for the same settings. A
rank runs all its stages (``RankStages``) in the order of the configured schedule. The model is built on the meta
device and only the rank's units materialised (:func:`plait.parallel.parallelize.parallelize`).

One step: every rank computes the same microbatch plan from the samples' metadata (no communication); this DP
replica's non-empty microbatches go through the pipeline (the same list on every rank of a pipeline, so they agree
on ``M``; schedules are built per ``M`` and cached). The plan may defer a sample's LLM work to a later microbatch
than its encoder work: the encoder stages then run the plan's encoder view, the LLM stages its LLM view, and the
first LLM stage buffers the deferred features (``FeatureRouting``, :mod:`plait.parallel.deferral`). A replica left
without samples (a last global batch smaller than DP) runs one microbatch with its loss multiplied by 0, so it still
joins the DP gradient sum with zeros.

Validation (:mod:`plait.train.replica_eval`): through this rank's stages, no rank holding the whole model. The
teacher-forced loss runs forward-only pipeline passes, the greedy answers repeated such passes without a KV cache
(one per new token, agreed on by an all-reduce over the replica's pipeline x CP ranks); pipeline rank 0 / CP rank 0
of each replica counts the target tokens and keeps the predictions. Timeline: the measured events of the last step
of DP replica 0 are written after the run to ``<run_dir>/timeline.json`` (Chrome trace) and ``timeline.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from plait.config.loader import pipeline_plan_kwargs
from plait.config.schema import JobConfig, PipelineConfig
from plait.models.generation import stop_token_ids
from plait.models.multimodal import MultimodalModel
from plait.models.units import model_units
from plait.parallel.energy import build_energy_runtime
from plait.parallel.pipeline import gather_timeline, run_pipeline_step
from plait.planner.microbatch import MicrobatchPlan
from plait.planner.pipeline.plan import plan_pipeline
from plait.planner.pipeline.types import PipelinePlan, Stage, TimelineEvent
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.schedules import build_schedule
from plait.train.evaluation import EvalSide
from plait.train.loss import token_loss_sum, zero_loss
from plait.train.plots import encoder_stage_modules, plot_timeline, write_chrome_trace
from plait.train.replica_eval import PipelinePasses
from plait.train.step_run import unused_branches

__all__ = ["PipelineRunner", "build_pipeline_plan", "check_pipeline_microbatches", "describe_stages"]


def build_pipeline_plan(model: MultimodalModel, pp: PipelineConfig) -> PipelinePlan:
    """The pipeline plan ``[parallel.pp]`` describes for ``model`` (module docstring): ``plan_pipeline`` of the
    model's units with the counts, splits and stage ranks of :func:`plait.config.loader.pipeline_plan_kwargs`.

    Raises:
        ValueError: when the stage counts, splits or placement do not fit the model.
    """
    cuts = pipeline_plan_kwargs(pp, list(model.encoders))  # even counts, explicit splits, stage ranks
    return plan_pipeline(model_units(model), pp.layout, **cuts)


def check_pipeline_microbatches(cfg: JobConfig, dp: int, samples: int) -> None:
    """Refuse ``parallel.pp.microbatches`` above the samples each of ``dp`` DP replicas gets of a global batch (of a
    training set of ``samples`` samples): the extra microbatches would be empty and silently dropped (fewer
    microbatches than asked, a larger bubble).

    Raises:
        ValueError: naming ``parallel.pp.microbatches``, the global batch and the largest useful value.
    """
    t, wanted = cfg.train, cfg.parallel.pp.microbatches
    batch = min(t.global_batch_size, samples)
    share = -(-batch // dp)
    if wanted > share:
        small = f"; the training set has only {samples}" if batch < t.global_batch_size else ""
        raise ValueError(
            f"parallel.pp.microbatches={wanted} is more than the {share} samples each of the {dp} DP "
            f"replica(s) gets of a global batch of {batch} samples (train.global_batch_size="
            f"{t.global_batch_size}{small}): at most {share} microbatches can hold a sample; set "
            f"parallel.pp.microbatches <= {share} (0: from train.microbatch_size)"
        )


def describe_stages(plan: PipelinePlan) -> str:
    """Per stage its modules, unit count and pipeline rank (and which replica of a replicated encoder stage, or which
    TP rank of a tensor-parallel one, it is), as the setup line and checkpoints record them."""
    return "; ".join(f"{s.index}: {'+'.join(s.modules)} ({len(s.units)} units, rank {s.rank}"
                     f"{f', {_copy_noun(s)} {s.replica + 1} of {s.replicas}' if s.replicas > 1 else ''})"
                     for s in plan.stages)


def _copy_noun(stage: Stage) -> str:
    """``"TP rank"`` for a copy of a tensor-parallel encoder stage, ``"replica"`` for a data-parallel one."""
    return "TP rank" if stage.tensor_parallel else "replica"


class PipelineRunner:
    """The step, validation and timeline of a pipeline rank (module docstring), on the trainer's planned batches.

    Args:
        trainer: the :class:`~plait.train.trainer.Trainer` (its ``stages``, ``plan``, ``comm``, ``dims``,
            ``sharded``, the step's planning ``plan_batches`` / ``_collate`` / ``_llm_kwargs`` and ``autocast``).

    Attributes:
        last_events: this rank's measured timeline events (seconds since the epoch) of the last step.
        energy: the ``[energy]`` runtime (frequency plan, straggler reaction), or None.
    """

    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        self.schedules: dict[int, Schedule] = {}
        self.last_events: tuple[TimelineEvent, ...] = ()
        self.energy = build_energy_runtime(trainer.cfg.energy, trainer.pp_rank, trainer.dp_rank, trainer.dp,
                                           trainer.info.device)
        self._passes: PipelinePasses | None = None

    def schedule_for(self, num_microbatches: int) -> Schedule:
        """The configured schedule (``parallel.pp.schedule``) of the plan for ``num_microbatches`` microbatches
        (built once per count, then cached)."""
        if num_microbatches not in self.schedules:
            pp = self.t.cfg.parallel.pp
            options = {"cap": pp.cap} if pp.schedule == "memory_capped_1f1b" else {}
            self.schedules[num_microbatches] = build_schedule(self.t.plan, pp.schedule, num_microbatches, **options)
        return self.schedules[num_microbatches]

    def forward_backward(self, indices: Sequence[int], plan: MicrobatchPlan) -> tuple[float, int, int]:
        """Run this DP replica's microbatches of the global batch ``indices`` through the pipeline; gradients
        (summed over DP, scaled by 1 / global target tokens) accumulate in ``.grad`` of this rank's parameters.
        Collective over the job. Returns ``(global loss, global target tokens, the largest bytes of deferred encoder
        outputs any rank kept, 0 when the plan defers nothing)``. Microbatches empty in both views are dropped
        (order kept); without deferral the step runs without routing."""
        t = self.t
        metas = [t.train_set.sample_meta(i) for i in indices]
        global_targets = sum(m.target_tokens for m in metas)
        step, loss_fn = t.plan_batches(indices, plan), token_loss_sum
        routed = plan.deferred() and step.routing.num_microbatches > 0
        batches, kwargs = list(step.llm_batches), list(step.llm_kwargs)
        if not batches:  # fewer samples than replicas: join the DP reduction with a zero contribution
            batches, loss_fn = [t._collate([indices[0]])], zero_loss
            kwargs = [t._llm_kwargs(batches[0])]
        if t.experts is not None:  # the MoE all-to-alls need the same microbatches on EP ranks
            t.experts.check_microbatches(len(batches), sum(b is None for b in batches))
        t.stages.train()
        res = run_pipeline_step(t.stages, self.schedule_for(len(batches)), batches, global_targets, t.comm,
                                loss_fn=loss_fn, autocast=t.autocast, llm_kwargs=kwargs,
                                routing=step.routing if routed else None,
                                encoder_batches=step.encoder_batches if routed else None,
                                frequency=self.energy.controller if self.energy is not None else None,
                                sharded=t.sharded, sync=t.sync)
        if t.sharded is not None:  # a branch no sample of the step uses keeps no gradient, as in one process
            t.sharded.drop_gradients(unused_branches(t.sharded, metas))
        self.last_events = res.events
        if self.energy is not None:
            self.energy.after_step(res.events)  # straggler reaction (collective)
        return res.loss, global_targets, self._job_max(res.buffered_peak_bytes) if plan.deferred() else 0

    def _job_max(self, value: int) -> int:
        """The largest ``value`` over every rank (collective when distributed)."""
        if not self.t.comm.distributed:
            return value
        peak = torch.tensor([value], dtype=torch.long, device=self.t.info.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak)

    def eval_side(self) -> EvalSide:
        """This rank's part in an evaluation through its stages (module docstring, "Validation"): loss and answers
        over the DP replicas, counted and recorded by pipeline rank 0 / CP rank 0 of each replica; the loss by
        forward-only pipeline passes, the answers by greedy decoding through them
        (:class:`~plait.train.replica_eval.PipelinePasses`, as ``plait launch``'s pipelines)."""
        t = self.t
        group = max(2 * t.pp, t.cfg.parallel.pp.microbatches)
        lead = t.dims.coords(t.info.rank).tp == 0  # TP peers hold the same loss sums and answers
        first = t.pp_rank == 0 and t.cp_rank == 0 and lead
        stop = stop_token_ids(t.tokenizer, t.model.language_model.generation_config)
        passes = self._passes
        # a forward-only pass is collective over the pipeline: every rank runs it, only TP rank 0 reports its sums
        return EvalSide((t.dp, t.dp_rank), (t.dp, t.dp_rank), first, first, group,
                        lambda batches: [x for x in passes.forward(batches, token_loss_sum) if lead],
                        lambda batches: passes.answers(batches, t.tokenizer, stop, t.cfg.train.max_new_tokens,
                                                       t.processor.pad_id))

    def train_mode(self, train: bool) -> None:
        """Eval mode for the stages (no dropout); the replica's passes and process group (pipeline x CP ranks) are
        created on the first evaluation (collective: every rank evaluates)."""
        t = self.t
        t.stages.train(train)
        if self._passes is None:
            spans = t.pp * t.cp > 1 and t.comm.distributed
            group = (None if t.dp == 1 else t.dims.new_group(("pp", "cp"), t.info.rank)) if spans else False
            self._passes = PipelinePasses(t.stages, t.plan, t.comm, group, t.autocast, t._llm_kwargs)

    def write_timeline(self) -> Path | None:
        """Gather the last step's events of DP replica 0 (collective) and write ``timeline.json`` (Chrome trace)
        and ``timeline.png`` under the run directory on rank 0. Returns the JSON path on rank 0 (None elsewhere
        or when no step ran)."""
        t = self.t
        events = gather_timeline(self.last_events, t.comm)
        if not (t.info.is_main and events):
            return None
        pp = t.cfg.parallel.pp
        path = write_chrome_trace(events, t.run_dir / "timeline.json", label="measured")
        m = len({e.microbatch for e in events})
        plot_timeline(events, t.run_dir / "timeline.png",
                      title=f"measured step {t.step}: {pp.layout}, {pp.schedule}, {m} microbatches",
                      modules=encoder_stage_modules(t.plan))
        return path

    def after_fit(self, result: dict[str, Any]) -> None:
        """After the run: the timeline of the last step (``result["timeline"]``: the JSON path on rank 0, else
        None; collective) and the energy runtime closed."""
        result["timeline"] = self.write_timeline()
        if self.energy is not None:
            self.energy.close()

    def describe(self) -> str:
        """The setup line of the pipeline: layout, stages and ranks, placement, replicas, schedule."""
        t, pp = self.t, self.t.cfg.parallel.pp
        placement = f", {pp.virtual_stages} LLM stages per rank" if pp.virtual_stages > 1 else ""
        placement += ", encoders on the first LLM rank" if pp.attach_encoders else ""
        placement += ", encoders in the bubbles of the last LLM ranks" if pp.encoders_in_bubble else ""
        if t.dims.dp_shard > 1:  # dp counts every pipeline: dp replicas x dp_shard shard ranks
            hsdp = f", HSDP over {t.dims.dp} replicas" if t.dims.dp > 1 else ""
            placement += f", each stage's trainable units sharded (FSDP2) over {t.dims.dp_shard} ranks{hsdp}"
        return (f"plait: pipeline {pp.layout}, {t.plan.num_stages} stages on {t.pp} ranks{placement} x "
                f"{t.dp} {'pipelines' if t.dims.dp_shard > 1 else 'replica(s)'} x CP {t.cp}"
                f"{f' x TP {t.dims.tp}' if t.dims.tp > 1 else ''}, schedule {pp.schedule}; stages "
                f"{describe_stages(t.plan)}")
