"""Pipeline-parallel training: :class:`~plait.train.trainer.Trainer`'s loop over this rank's pipeline stages.

Layout: world size = DP x PP x CP, ranks laid out by :class:`~plait.parallel.dims.ParallelDims`: the CP axis is
innermost, so the CP group of each stage is a run of consecutive ranks, and without CP each pipeline is a run of
consecutive ranks. With ``parallel.cp`` > 1 every stage is replicated
over its CP group: encoder stages run whole on each CP rank, the LLM stages only on the CP rank's tokens (the
same ``plan_tokens`` assignment as the non-pipeline trainer, computed on every rank from the mask metadata),
each pipeline (one CP index) passing only those tokens' hidden states, and gradients are summed over the
DP x CP copies of each stage. With ``parallel.dp_shard`` > 1 (FSDP2, HSDP when ``parallel.dp`` > 1 too) every
shard rank runs its own pipeline on its own share of the batch, and each rank shards only its own stages'
trainable units over the ``dp x dp_shard`` ranks of its stage (:func:`plait.parallel.fsdp.apply_fsdp`; an
embedding tied to the head on another pipeline rank stays replicated): gathered once per step, reduced once after
each stage's last backward action (:mod:`plait.parallel.fsdp`, "Under pipeline parallelism"). The plan (:func:`build_pipeline_plan`) is ``plan_pipeline(model_units(model),
parallel.pp.layout, ...)`` with the even counts, explicit ``parallel.pp.splits`` and stage ranks of
:func:`plait.config.loader.pipeline_plan_kwargs`: stage ``i`` on pipeline rank ``i`` by default; with
``parallel.pp.virtual_stages = v`` > 1 the LLM's ``v p`` stages cyclic over its ``p`` ranks (interleaved 1F1B,
Narayanan et al., SC'21, section 2.2.2), and with ``parallel.pp.attach_encoders`` the encoder stages on the first
LLM rank: the placement ``plait.planner.search.plan_layout`` chooses for the same settings
(``pipeline_plan.stage_ranks``, one mapping for both). A rank then runs all its stages (``RankStages``) in the
order of ``schedules.interleaved_1f1b``.

Build: every rank composes the whole model on the meta device, materialises only its stages' units
(:func:`plait.models.init.materialize`: the per-(seed, FQN) init the single-process trainer uses too, or the
owned tensors of a pretrained composite / HF folders), then :func:`~plait.parallel.stages.build_rank_stages`
prunes it in place to this rank's stages; parameter names stay the full model's. There is no DDP wrapper:
``run_pipeline_step`` sums gradients over the DP group itself.

Optimizer: AdamW over this rank's trainable parameters (``None`` on a rank whose stages are frozen), with the
trainer's parameter groups (weight decay, per-branch ``lr_scale``). The LR schedule is driven directly
(:class:`~plait.train.optim.LRSchedule`, the same on every rank, so checkpoints hold one schedule state): before
each step its factor is applied to each group's base LR, as the single-process trainer's ``LRSchedule`` does on
its optimizer's groups (the one schedule; extended on resume by ``LRSchedule.load_state_dict``).

One step: every rank computes the same microbatch plan from the samples' metadata (no communication); this
DP replica's non-empty microbatches go through the pipeline (the same list on every rank of a pipeline, so
they agree on ``M``; schedules are built per ``M`` and cached), then ``clip_grad_norm_pipeline`` and the
optimizer step. The plan may defer a sample's LLM work to a later microbatch than its encoder work (issue 5):
the encoder stages then run the plan's encoder view, the LLM stages its LLM view, and the first LLM stage
buffers the deferred features (``FeatureRouting``, :mod:`plait.parallel.deferral`; the peak bytes go to the metrics as
``encoder_buffer_peak_bytes``). A replica left without samples (a last global batch smaller than DP) runs one
microbatch with its loss multiplied by 0, so it still joins the DP gradient sum with zeros.

Validation (:mod:`plait.train.evaluation`): through this rank's stages, no rank holding the whole model. The
validation samples are shared over the DP replicas; the teacher-forced loss runs forward-only pipeline passes
(``schedules.forward_only``, ``run_pipeline_forward``), the greedy answers repeated such passes without a KV cache
(one per new token, the next tokens agreed on by an all-reduce over the replica's pipeline x CP ranks); pipeline
rank 0 / CP rank 0 of each replica counts the target tokens and keeps the predictions, rank 0 scores them and
writes the predictions file. (:meth:`full_model` assembles the whole model from a checkpoint for export only.)

Checkpoints: each rank saves its owned parameters, its optimizer state (per-parameter keys) and its RNG, and
the checkpoint records the layout (:meth:`PipelineTrainer._checkpoint_layout`); resume restores them from a
checkpoint of any layout, pipeline or not (:mod:`plait.train.checkpoint`). Timeline: the measured events of
the last step of DP replica 0 are written at the end of :meth:`PipelineTrainer.fit` to
``<run_dir>/timeline.json`` (Chrome trace) and ``<run_dir>/timeline.png`` (Gantt chart) by rank 0, in the
simulator's format.
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
from plait.parallel.dims import ParallelDims
from plait.parallel.energy import build_energy_runtime
from plait.parallel.parallelize import PipelinePlace
from plait.parallel.pipeline import (
    build_pipeline_comm,
    clip_grad_norm_pipeline,
    gather_timeline,
    run_pipeline_step,
)
from plait.planner.microbatch import MicrobatchPlan
from plait.planner.pipeline_plan import PipelinePlan, plan_pipeline
from plait.planner.schedule_ir import Schedule
from plait.planner.schedules import build_schedule
from plait.planner.timeline import TimelineEvent
from plait.train.build import model_from_checkpoint
from plait.train.checkpoint import CheckpointLayout, checkpoint_dir
from plait.train.evaluation import EvalSide
from plait.train.loss import token_loss_sum, zero_loss
from plait.train.metrics import MetricsWriter
from plait.train.plots import plot_timeline, write_chrome_trace
from plait.train.replica_eval import PipelinePasses
from plait.train.step_run import unused_branches
from plait.train.optim import LRSchedule, build_optimizer, lr_factor, step_optimizer
from plait.train.trainer import Trainer

__all__ = ["PipelineTrainer", "build_pipeline_plan"]


def build_pipeline_plan(model: MultimodalModel, pp: PipelineConfig) -> PipelinePlan:
    """The pipeline plan ``[parallel.pp]`` describes for ``model`` (module docstring): ``plan_pipeline`` of the
    model's units with the counts, splits and stage ranks of :func:`plait.config.loader.pipeline_plan_kwargs`.

    Raises:
        ValueError: when the stage counts, splits or placement do not fit the model.
    """
    cuts = pipeline_plan_kwargs(pp, list(model.encoders))  # even counts, explicit splits, stage ranks
    return plan_pipeline(model_units(model), pp.layout, **cuts)


class PipelineTrainer(Trainer):
    """:class:`Trainer` for ``parallel.pp.degree`` > 1 (module docstring): same loop, losses, checkpoints and
    metrics; forward/backward through this rank's pipeline stage(s).

    Attributes (besides the trainer's):
        comm: this rank's PP/DP coordinates (``PipelineComm``).
        pp, pp_rank: pipeline degree and this rank's pipeline coordinate.
        plan: the pipeline plan (``PipelinePlan``; stage ranks from ``parallel.pp``, module docstring).
        stages: this rank's stages (``RankStages``); ``model`` is the pruned composite they run.
        last_events: this rank's measured timeline events (seconds since the epoch) of the last step.

    Raises:
        ValueError: when the world size is not a multiple of ``parallel.pp.degree`` x ``parallel.cp`` (or
            ``parallel.dp`` x degree x cp differs from it), ``parallel.pp.microbatches`` exceeds a DP replica's
            share of the global batch, or the stage counts and placement
            (``parallel.pp.stages``/``splits``/``virtual_stages``/``attach_encoders``) do not fit the model.
    """

    materializes_own_units = True

    # ------------------------------------------------------------------ setup
    @staticmethod
    def layout(cfg: JobConfig, world_size: int) -> ParallelDims:
        """The DP x PP x CP layout of ``cfg`` on ``world_size`` processes.

        Raises:
            ValueError: when the degrees do not fit the world size (:meth:`ParallelDims.from_world`).
        """
        par = cfg.parallel
        return ParallelDims.from_world(world_size, par.pp.degree, par.cp, par.dp, par.dp_shard, par.tp)

    def _setup_mesh(self) -> None:
        self.dims = PipelineTrainer.layout(self.cfg, self.info.world_size)
        self.comm = build_pipeline_comm(self.dims.pp, self.info.device, self.dims.cp, self.dims.dp, self.dims.dp_shard,
                                        self.dims.tp)
        self.dp, self.pp, self.cp, self.mesh = self.dims.batch, self.dims.pp, self.dims.cp, None  # DP: pipelines
        if self.dims.dp_shard * self.dims.tp > 1:  # FSDP2 and TP meshes are slices of the job's named mesh
            self.mesh = self.dims.build_mesh(self.info.device.type)
        self.dp_rank, self.pp_rank, self.cp_rank = self.comm.dp_rank, self.comm.pp_rank, self.comm.cp_rank
        self.cp_group = self.comm.cp_group

    def _setup_training(self) -> None:
        t, pp = self.cfg.train, self.cfg.parallel.pp
        self._check_microbatches()
        self._counts = super()._parameter_counts()  # the whole model, before pruning
        self.plan: PipelinePlan = build_pipeline_plan(self.model, pp)
        self._parallelize(PipelinePlace(self.plan, self.comm))
        self.optimizer = None
        if self.stages.trainable_parameters():
            scales = {name: enc.lr_scale for name, enc in self.cfg.model.encoders.items()}
            self.optimizer = build_optimizer(self.model, t.lr, t.weight_decay, t.betas, scales)
        self.scheduler = LRSchedule(t.lr, lr_factor(t.warmup_steps, self.total_steps, t.min_lr_ratio))
        self._schedules: dict[int, Schedule] = {}
        self._saved_step: int | None = None
        self.last_events: tuple[TimelineEvent, ...] = ()
        self.energy = build_energy_runtime(self.cfg.energy, self.pp_rank, self.dp_rank, self.dp, self.info.device)

    def _num_microbatches(self, samples: int) -> int:
        return self.cfg.parallel.pp.microbatches or super()._num_microbatches(samples)

    def _check_microbatches(self) -> None:
        """Refuse ``parallel.pp.microbatches`` above the samples a DP replica gets of a global batch: the extra
        microbatches would be empty and silently dropped (fewer microbatches than asked, a larger bubble).

        Raises:
            ValueError: naming ``parallel.pp.microbatches``, the global batch and the largest useful value.
        """
        t, wanted = self.cfg.train, self.cfg.parallel.pp.microbatches
        batch = min(t.global_batch_size, len(self.train_set))
        share = -(-batch // self.dp)
        if wanted > share:
            small = f"; the training set has only {len(self.train_set)}" if batch < t.global_batch_size else ""
            raise ValueError(
                f"parallel.pp.microbatches={wanted} is more than the {share} samples each of the {self.dp} DP "
                f"replica(s) gets of a global batch of {batch} samples (train.global_batch_size="
                f"{t.global_batch_size}{small}): at most {share} microbatches can hold a sample; set "
                f"parallel.pp.microbatches <= {share} (0: from train.microbatch_size)"
            )

    def _parameter_counts(self) -> tuple[int, int]:
        return self._counts

    def _report_setup(self, writer: MetricsWriter) -> None:
        super()._report_setup(writer)
        if not self.info.is_main:
            return
        pp = self.cfg.parallel.pp
        stages = "; ".join(f"{s.index}: {'+'.join(s.modules)} ({len(s.units)} units, rank {s.rank})"
                           for s in self.plan.stages)
        placement = f", {pp.virtual_stages} LLM stages per rank" if pp.virtual_stages > 1 else ""
        placement += ", encoders on the first LLM rank" if pp.attach_encoders else ""
        if self.dims.dp_shard > 1:  # self.dp counts every pipeline: dp replicas x dp_shard shard ranks
            hsdp = f", HSDP over {self.dims.dp} replicas" if self.dims.dp > 1 else ""
            placement += f", each stage's trainable units sharded (FSDP2) over {self.dims.dp_shard} ranks{hsdp}"
        print(f"plait: pipeline {pp.layout}, {self.plan.num_stages} stages on {self.pp} ranks{placement} x "
              f"{self.dp} {'pipelines' if self.dims.dp_shard > 1 else 'replica(s)'} x CP {self.cp}"
              f"{f' x TP {self.dims.tp}' if self.dims.tp > 1 else ''}, schedule {pp.schedule}; stages {stages}",
              flush=True)

    # ------------------------------------------------------------------ one step
    def schedule_for(self, num_microbatches: int) -> Schedule:
        """The configured schedule (``parallel.pp.schedule``) of the plan for ``num_microbatches`` microbatches
        (built once per count, then cached)."""
        if num_microbatches not in self._schedules:
            pp = self.cfg.parallel.pp
            options = {"cap": pp.cap} if pp.schedule == "memory_capped_1f1b" else {}
            self._schedules[num_microbatches] = build_schedule(self.plan, pp.schedule, num_microbatches, **options)
        return self._schedules[num_microbatches]

    def forward_backward(self, indices: Sequence[int], plan: MicrobatchPlan | None = None) -> tuple[float, int]:
        """Run this DP replica's microbatches of the global batch ``indices`` through the pipeline; gradients
        (summed over DP, scaled by 1 / global target tokens) accumulate in ``.grad`` of this rank's parameters.
        Collective over the job. Returns ``(global loss, global target tokens)``; sets
        ``encoder_buffer_peak_bytes`` (the largest over the job, 0 when the plan defers nothing).

        The step's batches, LLM keyword arguments and feature routing are planned first
        (:meth:`~plait.train.trainer.Trainer.plan_batches`); the runtime only executes them. When the plan defers
        samples, the encoder stages run the encoder view of the plan and the LLM stages its LLM view, joined by
        the :class:`~plait.planner.routing.FeatureRouting`; microbatches empty in both views are dropped (order
        kept). Without deferral both views are the same and the step runs without routing."""
        plan = plan or self.plan_step(indices)[0]
        metas = [self.train_set.sample_meta(i) for i in indices]
        global_targets = sum(m.target_tokens for m in metas)
        step, loss_fn = self.plan_batches(indices, plan), token_loss_sum
        routed = plan.deferred() and step.routing.num_microbatches > 0
        batches, kwargs = list(step.llm_batches), list(step.llm_kwargs)
        if not batches:  # fewer samples than replicas: join the DP reduction with a zero contribution
            batches, loss_fn = [self._collate([indices[0]])], zero_loss
            kwargs = [self._llm_kwargs(batches[0])]
        self.stages.train()
        res = run_pipeline_step(self.stages, self.schedule_for(len(batches)), batches, global_targets, self.comm,
                                loss_fn=loss_fn, autocast=self.autocast, llm_kwargs=kwargs,
                                routing=step.routing if routed else None,
                                encoder_batches=step.encoder_batches if routed else None,
                                frequency=self.energy.controller if self.energy is not None else None,
                                sharded=self.sharded)
        if self.sharded is not None:  # a branch no sample of the step uses keeps no gradient, as in one process
            self.sharded.drop_gradients(unused_branches(self.sharded, metas))
        self.last_events = res.events
        if self.energy is not None:
            self.energy.after_step(res.events)  # straggler reaction (collective)
        self.encoder_buffer_peak_bytes = self._job_max(res.buffered_peak_bytes) if plan.deferred() else 0
        return res.loss, global_targets

    def _job_max(self, value: int) -> int:
        """The largest ``value`` over every rank (collective when distributed)."""
        if not self.comm.distributed:
            return value
        peak = torch.tensor([value], dtype=torch.long, device=self.info.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak)

    def optimizer_step(self) -> tuple[float, float]:
        """Clip the whole pipeline's gradient norm (collective), step this rank's optimizer (if it trains) at the
        scheduled LR, advance the schedule. Returns ``(gradient norm before clipping, learning rate used)``."""
        clip = self.cfg.train.grad_clip
        grad_norm = clip_grad_norm_pipeline(self.stages, clip if clip > 0 else float("inf"), self.comm)
        lr = step_optimizer(self.optimizer, self.scheduler)
        self.step += 1
        return grad_norm, lr

    # ------------------------------------------------------------------ validation, checkpoints, timeline
    def _eval_side(self) -> EvalSide:
        """This rank's part in an evaluation through its stages (module docstring, "Validation"): loss and answers
        over the DP replicas, counted and recorded by pipeline rank 0 / CP rank 0 of each replica; the loss by
        forward-only pipeline passes, the answers by greedy decoding through them
        (:class:`~plait.train.replica_eval.PipelinePasses`, as ``plait launch``'s pipelines)."""
        group = max(2 * self.pp, self.cfg.parallel.pp.microbatches)
        lead = self.dims.coords(self.info.rank).tp == 0  # TP peers hold the same loss sums and answers
        first = self.pp_rank == 0 and self.cp_rank == 0 and lead
        stop = stop_token_ids(self.tokenizer, self.model.language_model.generation_config)
        passes = self._passes
        # a forward-only pass is collective over the pipeline: every rank runs it, only TP rank 0 reports its sums
        return EvalSide((self.dp, self.dp_rank), (self.dp, self.dp_rank), first, first, group,
                        lambda batches: [x for x in passes.forward(batches, token_loss_sum) if lead],
                        lambda batches: passes.answers(batches, self.tokenizer, stop, self.cfg.train.max_new_tokens,
                                                       self.processor.pad_id))

    def _eval_train_mode(self, train: bool) -> None:
        """Eval mode for the stages (no dropout); the replica's passes and process group (pipeline x CP ranks) are
        created on the first evaluation (collective: every rank evaluates)."""
        self.stages.train(train)
        if not hasattr(self, "_passes"):
            spans = self.pp * self.cp > 1 and self.comm.distributed
            group = (None if self.dp == 1 else self.dims.new_group(("pp", "cp"), self.info.rank)) if spans else False
            self._passes = PipelinePasses(self.stages, self.plan, self.comm, group, self.autocast, self._llm_kwargs)

    def full_model(self, path: str | Path | None = None) -> MultimodalModel:
        """The whole model with the weights of checkpoint ``path`` (default: the run's newest), on this rank's
        device, built in this process alone (no collective).

        It is built from the config like the trained model (same seed; the parts in no pipeline unit, such as
        a pooling head, are never trained or saved and keep their initial values), then loaded with DCP.

        Raises:
            FileNotFoundError: when there is no checkpoint.
        """
        model = model_from_checkpoint(self.cfg, self.tokenizer, self.run_dir, path, self.info.device)
        self._use_attention(model)
        return model

    def _checkpoint_layout(self) -> CheckpointLayout:
        """World size, DP/PP/CP degrees and the plan: per stage its modules, unit count and pipeline rank."""
        stages = "; ".join(f"{s.index}: {'+'.join(s.modules)} ({len(s.units)} units, rank {s.rank})"
                           for s in self.plan.stages)
        return CheckpointLayout(world_size=self.info.world_size, dp=self.dp, pp=self.pp, cp=self.cp,
                                plan=f"{self.plan.layout}, stages {stages}", tp=self.dims.tp,
                                dp_shard=self.dims.dp_shard)

    def save(self) -> Path:
        """Write a checkpoint of the current step (collective; once per step, however often it is called)."""
        if self._saved_step == self.step:
            return checkpoint_dir(self.run_dir, self.step)
        path = super().save()
        self._saved_step = self.step
        return path

    def write_timeline(self) -> Path | None:
        """Gather the last step's events of DP replica 0 (collective) and write ``timeline.json`` (Chrome trace)
        and ``timeline.png`` under the run directory on rank 0. Returns the JSON path on rank 0 (None elsewhere
        or when no step ran)."""
        events = gather_timeline(self.last_events, self.comm)
        if not (self.info.is_main and events):
            return None
        pp = self.cfg.parallel.pp
        path = write_chrome_trace(events, self.run_dir / "timeline.json", label="measured")
        m = len({e.microbatch for e in events})
        plot_timeline(events, self.run_dir / "timeline.png",
                      title=f"measured step {self.step}: {pp.layout}, {pp.schedule}, {m} microbatches")
        return path

    def fit(self, resume: bool | str = False, stop_after: int | None = None, overwrite: bool = False
            ) -> dict[str, Any]:
        """:meth:`Trainer.fit`, then the timeline of the last step (:meth:`write_timeline`); the result also
        holds ``"timeline"`` (the JSON path on rank 0, else None)."""
        result = super().fit(resume, stop_after, overwrite)
        result["timeline"] = self.write_timeline()
        if self.energy is not None:
            self.energy.close()
        return result
