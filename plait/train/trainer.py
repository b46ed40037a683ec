"""The training loop: build (:meth:`Trainer.build`, parts from :mod:`plait.train.build`), step, validate,
checkpoint, resume.

Loss normalisation: the loss of a global batch is the sum of token cross-entropies
divided by the number of target tokens of the whole global batch (all microbatches, all DP ranks). Every
microbatch's loss sum is divided by that global count before its backward, so gradients do not depend on
how samples are grouped into microbatches or ranks.

One step: ``plan_microbatches`` assigns the global batch to DP ranks and
microbatches, deferral included; :meth:`Trainer.plan_batches` then plans this
rank's share before anything runs: the feature routing (``plan_feature_routing``), each sample collated once, each
LLM microbatch's attention metadata and CP token assignment (``plan_tokens``). A sample's encoder work runs in its
encoder microbatch, its LLM work possibly in a later one: the encoder outputs are kept as detached leaves by the
one deferral implementation (:class:`~plait.parallel.deferral.FeatureBuffer`, shared with the pipeline runtime)
until every LLM microbatch that reads them has run backward, then the gradients gathered on the leaves go back
through the encoders (detached-leaf re-injection). Gradients are summed over all ranks once, after the last
backward (:func:`plait.parallel.data_parallel.sum_gradients`), not by DDP's hooks, which would fire before the
deferred encoder backwards.
"""

from __future__ import annotations

import logging
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from plait.attention.interface import resolve_implementation, use_plait_attention
from plait.attention.masks import MaskInfo, block_work
from plait.config.loader import config_to_dict
from plait.config.schema import JobConfig
from plait.data.collate import Batch, collate
from plait.data.loader import SampleFeed
from plait.data.progress import Progress
from plait.data.metadata import SkippedSample
from plait.data.mixture import batch_sources, build_batch_loader
from plait.models.generation import greedy_generate
from plait.models.multimodal import MultimodalModel
from plait.parallel.context import CPShard, build_cp_shard, shard_tokens
from plait.parallel.grad_sync import GradientSync
from plait.parallel.dims import ParallelDims
from plait.parallel.fsdp import gathered
from plait.parallel.process_group import DistInfo
from plait.parallel.parallelize import PipelinePlace, parallelize
from plait.parallel.pipeline import build_pipeline_comm
from plait.planner.microbatch import MicrobatchPlan, SampleCost, workload_stats
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.microbatch.routing import plan_feature_routing
from plait.planner.token_distributor import plan_tokens
from plait.train.batches import StepBatches, encoder_view_batch, plan_global_batch
from plait.train.build import TrainerParts, build_trainer_parts, check_tp_degree, join_job, model_from_checkpoint
from plait.train.checkpoint import (CheckpointLayout, checkpoint_dir, latest_checkpoint, load_checkpoint,
                                    save_checkpoint, training_set_identity)
from plait.train.cost_coeffs import microbatch_cost_coeffs
from plait.train.evaluation import eval_batch_size, evaluate_on, load_metrics
from plait.train.feed import receive_step, upcoming_rank_samples
from plait.train.loop import LoopSchedule, run_steps, total_steps
from plait.train.loss import token_loss_sum
from plait.train.metrics import MetricsWriter, detect_energy_meter
from plait.train.optim import LRSchedule, build_optimizer, step_optimizer
from plait.train.preemption import StopSignals
from plait.train.run_dir import no_checkpoint_message
from plait.train.run_lock import hold_run_lock
from plait.train.run_start import clear_earlier_run, fsdp_description, nothing_to_train, report_setup, say
from plait.train.pipeline_run import PipelineRunner, build_pipeline_plan, check_pipeline_microbatches, describe_stages
from plait.train.step_run import FlatRunner

__all__ = ["Trainer", "StepResult"]

log = logging.getLogger(__name__)


class _Fitting(NamedTuple):
    """What a :meth:`Trainer.fit` call holds while its steps run."""

    feed: SampleFeed
    writer: MetricsWriter
    stop: StopSignals
    bar: Progress


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: global loss (mean over the global batch's target tokens), gradient norm before
    clipping, learning rate used, target tokens and all tokens of the global batch, wall time (s), and per
    module the balance of the microbatches (CV = std/mean and max/mean of per-microbatch work), the samples
    whose LLM work was deferred to a later microbatch (all ranks) and the peak bytes of encoder outputs this
    rank kept across a microbatch boundary for them."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    target_tokens: int
    tokens: int
    time_s: float
    workload: dict[str, dict[str, float]] | None = None
    deferred_samples: int = 0
    encoder_buffer_peak_bytes: int = 0


class Trainer:
    """Trains a :class:`JobConfig` on built parts (:meth:`build` builds them): the one training loop (fit, evaluate,
    checkpoint, metrics, LR) of every layout, delegating a step's forward/backward and validation to a step runner:
    :class:`~plait.train.step_run.FlatRunner` for a model trained whole on every rank (one process, DP x CP, TP,
    FSDP2), :class:`~plait.train.pipeline_run.PipelineRunner` for this rank's pipeline stages
    (``parallel.pp.degree`` > 1, built by :class:`~plait.train.pipeline_trainer.PipelineTrainer`).

    Args:
        cfg: the job.
        parts: the process's place in the job, tokenizer, model, processor and datasets
            (:func:`~plait.train.build.build_trainer_parts`).

    Raises:
        ValueError: when the degrees do not fit the world size (:meth:`layout`).
    """

    materializes_own_units = False
    """Whether the trainer builds the model on the meta device and materialises only its rank's units."""
    sync: GradientSync
    """The step's gradient sum (:meth:`_parallelize`, :mod:`plait.parallel.grad_sync`)."""
    runner: FlatRunner | PipelineRunner
    """The step runner (class docstring)."""

    def __init__(self, cfg: JobConfig, parts: TrainerParts) -> None:
        self.cfg, self.info = cfg, parts.info
        self.tokenizer, self.model, self.processor = parts.tokenizer, parts.model, parts.processor
        self.train_set, self.val_set = parts.train_set, parts.val_set
        t = cfg.train
        self._setup_mesh()
        self.run_dir = Path(cfg.metrics.run_dir)
        a = cfg.attention
        self.attention = resolve_implementation(a.implementation, a.mask, cfg.data.packing, self.cp,
                                                self.info.device.type)
        self._use_attention(self.model)
        self.loader = build_batch_loader(cfg, self.train_set)  # a MixtureBatchLoader for [[data.sources]]
        self.total_steps = total_steps(cfg, self.loader.batches_per_epoch)
        self.cost_coeffs = microbatch_cost_coeffs(self.model)
        self._setup_training()
        self.step = 0
        self._saved_step: int | None = None
        self._loaded: dict[int, Any] = {}  # this step's samples loaded ahead (fit), by dataset index
        self.dropped: list[SkippedSample] = []  # samples dropped from their step: they failed to load
        self.encoder_buffer_peak_bytes = 0  # of the last forward_backward (deferred encoder outputs)
        self._fitting: _Fitting | None = None  # while fit runs its steps
        use_bf16 = t.dtype == "bf16" or (t.dtype == "auto" and self.info.device.type == "cuda")
        self.autocast = (
            (lambda: torch.autocast(self.info.device.type, dtype=torch.bfloat16)) if use_bf16 else nullcontext
        )

    @classmethod
    def build(cls, cfg: JobConfig, info: DistInfo | None = None) -> "Trainer":
        """Join the job (``info``, or from the torchrun environment), check the parallel layout before loading
        anything (:meth:`layout`), build the parts (:func:`~plait.train.build.build_trainer_parts`) and the
        trainer on them.

        Raises:
            ValueError: as :meth:`layout` and the parts' builders.
        """
        info = join_job(cfg, info)
        try:
            cls.layout(cfg, info.world_size)
        except ValueError:
            check_tp_degree(cfg)  # a degree the model cannot take: say so rather than suggest a launch
            raise
        check_tp_degree(cfg, encoders_only=True)  # each rank refuses an encoder_tp its branch cannot take, up front
        return cls(cfg, build_trainer_parts(cfg, info, meta=cls.materializes_own_units))

    @staticmethod
    def layout(cfg: JobConfig, world_size: int) -> ParallelDims:
        """The DP x CP layout of ``cfg`` on ``world_size`` processes.

        Raises:
            ValueError: when the degrees do not fit the world size, or the job asks for pipeline parallelism
                (``plait.train.pipeline_trainer.PipelineTrainer`` runs those).
        """
        par = cfg.parallel
        if par.pp.degree > 1:
            raise ValueError(f"parallel.pp.degree={par.pp.degree}: pipeline jobs run with PipelineTrainer")
        dims = ParallelDims.from_world(world_size, 1, par.cp, par.dp, par.dp_shard, par.tp, ep=par.ep)
        return dims.ordered(par.rank_order, par.gpus_per_node)

    # ------------------------------------------------------------------ setup
    def _setup_mesh(self) -> None:
        """Parallel layout: ``dims`` (:class:`ParallelDims`), ``dp``/``dp_rank`` (DP replicas: replicas x shards,
        each with its own samples; pipelines under PP), ``pp``/``pp_rank``, ``cp``/``cp_rank``/``cp_group``,
        ``mesh`` (the job's named DeviceMesh; None for one process, and for a pipeline job without FSDP2 or TP) and,
        under PP, ``comm`` (this rank's ``PipelineComm``).

        Raises:
            ValueError: as :meth:`layout`.
        """
        d = self.dims = self.layout(self.cfg, self.info.world_size)
        self.dp, self.pp, self.cp = d.batch, d.pp, d.cp
        if d.pp > 1:
            self.comm = build_pipeline_comm(d.pp, self.info.device, d.cp, d.dp, d.dp_shard, d.tp, d.rank_order)
            self.mesh = d.build_mesh(self.info.device.type) if d.dp_shard * d.tp > 1 else None
            self.dp_rank, self.pp_rank, self.cp_rank = self.comm.dp_rank, self.comm.pp_rank, self.comm.cp_rank
            self.cp_group = self.comm.cp_group
            return
        self.dp_rank, self.pp_rank, self.cp_rank = d.batch_rank(self.info.rank), 0, d.coords(self.info.rank).cp
        self.mesh = d.build_mesh(self.info.device.type) if self.info.world_size > 1 else None
        self.cp_group = self.mesh.get_group("cp") if (self.mesh is not None and self.cp > 1) else None

    def _setup_training(self) -> None:
        """Parallelize the model (:meth:`_parallelize`; under PP first the pipeline plan, ``plan``), build
        ``optimizer`` (None on a pipeline rank whose stages are frozen), the LR ``scheduler`` and the step
        ``runner``.

        Raises:
            ValueError: under PP, when ``parallel.pp.microbatches`` exceeds a DP replica's share of the global
                batch or the stage counts and placement do not fit the model.
        """
        t, pipeline = self.cfg.train, None
        self._counts = (sum(p.numel() for _, p in self.model.trainable_parameters()),  # the whole model
                        sum(p.numel() for p in self.model.parameters()))
        if self.pp > 1:
            check_pipeline_microbatches(self.cfg, self.dp, len(self.train_set))
            self.plan: PipelinePlan = build_pipeline_plan(self.model, self.cfg.parallel.pp)
            pipeline = PipelinePlace(self.plan, self.comm)
        self._parallelize(pipeline)
        self.optimizer = None
        if self.stages is None or self.stages.trainable_parameters():
            self.optimizer = build_optimizer(self.model, t.lr, t.weight_decay, t.betas,
                                             {n: e.lr_scale for n, e in self.cfg.model.encoders.items()})
        # a pipeline's ranks hold different groups (or none): one job-level schedule state on every rank
        self.scheduler = LRSchedule.of_job(t, self.total_steps, self.optimizer if self.stages is None else None)
        self.runner = FlatRunner(self) if self.stages is None else PipelineRunner(self)

    def _parallelize(self, pipeline: PipelinePlace | None) -> None:
        """Apply the job's parallelism to ``model`` (:func:`~plait.parallel.parallelize.parallelize`, one order for
        every trainer): sets ``tp``, ``sharded``, ``stages`` (None without pipeline), ``sync`` (the step's gradient
        sum) and ``ddp_model`` (the DDP wrapper of plain DP: every rank starts from rank 0's parameters; the
        forwards bypass it and ``sync`` reduces the gradients after the deferred encoder backwards)."""
        par = parallelize(self.model, self.cfg, self.dims, self.mesh, self.info, pipeline)
        self.tp, self.sharded, self.stages, self.sync, self.ddp_model = (par.tp, par.sharded, par.stages, par.sync,
                                                                         par.ddp_model)
        self.experts = par.experts

    def _num_microbatches(self, samples: int) -> int:
        """Microbatches of a DP rank's share of ``samples`` samples: ``parallel.pp.microbatches`` under PP when
        set, else ``train.microbatch_size`` per microbatch."""
        if self.pp > 1 and self.cfg.parallel.pp.microbatches:
            return self.cfg.parallel.pp.microbatches
        return max(1, -(-samples // self.cfg.train.microbatch_size))

    # ------------------------------------------------------------------ one step
    def plan_step(self, indices: Sequence[int],
                  step: int | None = None) -> tuple[MicrobatchPlan, tuple[SampleCost, ...]]:
        """Assign the global batch ``indices`` of ``step`` (default: the current step) to DP ranks and microbatches
        (``train.microbatch_policy``).

        Every rank computes the same plan from the samples' metadata, seed and step, without communication.
        Plan entries are positions in ``indices``. Returns the plan and the per-sample costs it balanced.
        Deferral (a sample's LLM work in a later microbatch than its encoder work) is allowed: this trainer
        buffers encoder outputs as detached leaves, the pipeline runtime on the first LLM stage
        (:class:`~plait.planner.microbatch.routing.FeatureRouting`); not with replicated or tensor-parallel encoder
        stages (``parallel.pp.encoder_dp``, ``encoder_tp``).
        """
        per_rank = -(-len(indices) // self.dp)
        pp = self.cfg.parallel.pp  # replicated encoder stages split each microbatch's own items: no deferral
        defer = pp.degree == 1 or not any(d > 1 for d in (*pp.encoder_dp.values(), *pp.encoder_tp.values()))
        return plan_global_batch(self.cfg, [self.train_set.sample_meta(i) for i in indices], self.cost_coeffs,
                                 self.dp, self._num_microbatches(per_rank), self.step if step is None else step,
                                 allow_deferral=defer)

    def _rank_samples(self, indices: Sequence[int], step: int) -> list[int]:
        """The dataset indices of the global batch ``indices`` of ``step`` that this rank's DP replica trains."""
        return [indices[k] for mb in self.plan_step(indices, step)[0].microbatches[self.dp_rank] for k in mb]

    def microbatches(self, indices: Sequence[int], plan: MicrobatchPlan | None = None) -> list[list[int]]:
        """This rank's non-empty LLM microbatches (dataset indices) of the global batch ``indices``."""
        plan = plan or self.plan_step(indices)[0]
        return [[indices[k] for k in mb] for mb in plan.llm_microbatches(self.dp_rank) if mb]

    def plan_batches(self, indices: Sequence[int], plan: MicrobatchPlan) -> StepBatches:
        """This rank's :class:`~plait.train.batches.StepBatches` of the global batch ``indices`` under ``plan``,
        before the step runs: the feature routing, every sample collated once (into its LLM microbatch; an
        encoder microbatch that differs takes its samples' items from those batches), every LLM microbatch's
        attention metadata and CP token assignment planned once."""
        mine = [k for mb in plan.microbatches[self.dp_rank] for k in mb]
        routing = plan_feature_routing(plan, self.dp_rank, {k: self._feature_rows(indices[k]) for k in mine})
        llm = tuple(self._collate([indices[k] for k in mb]) if mb else None for mb in routing.llm_samples)
        items = {k: self.train_set.item_counts(indices[k]) for mb in routing.encoder_samples for k in mb}
        enc = tuple(llm[i] if mb == routing.llm_samples[i] else encoder_view_batch(i, routing, llm, items) if mb
                    else None for i, mb in enumerate(routing.encoder_samples))
        kwargs = tuple(self._llm_kwargs(b) if b is not None else {} for b in llm)
        return StepBatches(routing, enc, llm, kwargs)

    def _collate(self, samples: Sequence[int]) -> Batch:
        """The training batch of dataset samples ``samples`` on this rank's device (``data.packing``): the samples
        loaded ahead for this step (:meth:`fit`), others read and processed now."""
        loaded = self._loaded
        batch = collate([loaded[i] if i in loaded else self.train_set[i] for i in samples], self.processor.pad_id,
                        pack=self.cfg.data.packing)
        return batch.to(self.info.device)

    def _llm_kwargs(self, batch: Batch) -> dict[str, Any]:
        """Attention metadata for the LLM (plait attention reads ``plait_mask`` and ignores the 2-D mask); with CP
        also this rank's ``plait_cp`` shard of the batch's tokens (:meth:`_cp_shard`). ``{}`` for HF attention."""
        if self.attention == "hf":
            return {}
        info = MaskInfo.from_batch(vars(batch), mode=self.cfg.attention.mask)
        if self.cp == 1:
            return {"plait_mask": info}
        return {"plait_mask": info, "plait_cp": self._cp_shard(info)}

    def forward_backward(self, indices: Sequence[int], plan: MicrobatchPlan | None = None) -> tuple[float, int]:
        """Forward/backward this rank's share of the global batch ``indices`` by the plan (deferral included) through
        the step ``runner``; the gradients, summed over all ranks holding the same parameters and scaled by 1 /
        global target tokens, accumulate in ``.grad``. Returns ``(global loss, global target tokens)``; sets
        ``encoder_buffer_peak_bytes``. Collective when distributed."""
        plan = plan or self.plan_step(indices)[0]
        loss, targets, self.encoder_buffer_peak_bytes = self.runner.forward_backward(indices, plan)
        return loss, targets

    def _feature_rows(self, index: int) -> dict[str, int]:
        """Projected feature rows per encoder branch of dataset sample ``index`` (its placeholder tokens)."""
        rows = self.train_set.feature_rows(index)
        return {name: rows.get(name, 0) for name in self.model.placeholder_ids}

    def microbatch_loss(self, batch: Batch, kwargs: dict[str, Any], features: dict[str, torch.Tensor] | None = None
                        ) -> torch.Tensor:
        """Sum of token cross-entropies of an LLM microbatch ``batch`` with its planned ``kwargs``
        (:meth:`_llm_kwargs`), on this rank's share of its tokens.

        ``features``: precomputed projected features per branch (``[placeholders, hidden]`` in the batch's
        row-major placeholder order, e.g. from earlier encoder microbatches); None runs the encoders inline.
        Without CP every token is local. With CP (a ``plait_cp`` shard in ``kwargs``) the encoders run on every
        rank of the group, the LLM only on the local tokens, with K/V gathered across the group by plait's
        attention.
        """
        labels, positions, attn = batch.labels, batch.position_ids, batch.attention_mask
        kwargs = dict(kwargs)
        if "plait_mask" in kwargs:
            attn = None
        shard = kwargs.get("plait_cp")
        if shard is not None:
            kwargs["token_index"] = shard.local_index
            labels, positions = shard_tokens(labels, shard), shard_tokens(positions, shard)
        inputs = None if features is not None else batch.modality_inputs
        with self.autocast():
            logits = self.model(batch.input_ids, inputs, attn, positions, features=features,
                                rope_position_ids=batch.rope_position_ids, **kwargs)
        return token_loss_sum(logits, labels)

    def _cp_shard(self, info: MaskInfo) -> CPShard:
        """This rank's tokens of a microbatch under the planned CP token assignment.

        Blocks are ``attention.block_size`` tokens, smaller for a microbatch shorter than ``cp`` such blocks
        (every CP rank needs at least one block): ``min(block_size, tokens // cp)``."""
        tokens = info.document_ids.shape[1]
        block = max(1, min(self.cfg.attention.block_size, tokens // self.cp))
        work = block_work(info, block)
        assignment = plan_tokens(work, tokens, self.cp, method=self.cfg.parallel.cp_distribution, block_size=block)
        return build_cp_shard(assignment, self.cp_rank, self.cp_group, self.info.device)

    def _use_attention(self, model: MultimodalModel) -> None:
        """Switch ``model``'s LLM to plait attention unless the job runs HF's (``attention``, resolved by
        :func:`~plait.attention.interface.resolve_implementation`)."""
        if self.attention != "hf":
            use_plait_attention(model.language_model, "sdpa" if self.attention == "plait_sdpa" else "flex")

    def optimizer_step(self) -> tuple[float, float]:
        """Clip the global gradient norm (``sync``; collective when distributed), step the optimizer at the
        scheduled LR and advance the schedule (:func:`~plait.train.optim.step_optimizer`). Returns ``(gradient
        norm before clipping, learning rate used)``."""
        params = [p for _, p in self.model.trainable_parameters()]
        grad_norm = self.sync.clip(params, self.cfg.train.grad_clip)
        lr = step_optimizer(self.optimizer, self.scheduler)
        self.step += 1
        return float(grad_norm), lr

    def train_step(self, indices: Sequence[int]) -> StepResult:
        """One optimizer step on the global batch ``indices``."""
        start = time.perf_counter()
        plan, costs = self.plan_step(indices)
        self.encoder_buffer_peak_bytes = 0
        loss, targets = self.forward_backward(indices, plan)
        grad_norm, lr = self.optimizer_step()
        tokens = sum(self.train_set.sample_meta(i).length for i in indices)
        stats = workload_stats(plan, costs, list(self.cost_coeffs))
        workload = {m: {"cv": stats.cv[k], "max_over_mean": stats.max_over_mean[k]}
                    for k, m in enumerate(stats.modules)}
        return StepResult(self.step, loss, grad_norm, lr, targets, tokens, time.perf_counter() - start, workload,
                          stats.num_deferred, self.encoder_buffer_peak_bytes)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validate through this job's layout (:mod:`plait.train.evaluation`): the teacher-forced loss per task
        (DP x CP), greedy answers (the samples shared over every rank, each holding the whole model), exact match,
        ``train.eval_metrics`` and ``<run_dir>/predictions/step_<N>.jsonl``. Returns exact match per task (the same
        on every rank); the whole :class:`~plait.train.evaluation.EvalReport` is ``last_eval``. Collective."""
        if self.val_set is None:
            return {}
        self._load_eval_metrics()
        self.runner.train_mode(False)
        try:
            with gathered(self.sharded), self._whole_experts():  # FSDP2, EP: gathered once; the forwards may differ
                self.last_eval = evaluate_on(self.val_set, self.runner.eval_side(), self.processor.pad_id,
                                             self.info.device, eval_batch_size(self.cfg.train), self.step,
                                             self._eval_metrics, self.run_dir,
                                             self.info.is_main and self.cfg.metrics.progress)
        finally:
            self.runner.train_mode(True)
        return self.last_eval.exact_match

    def _whole_experts(self) -> Any:
        """Expert parallelism's :meth:`~plait.parallel.expert_parallel.ExpertParallel.whole` (every expert on
        every rank), or nothing without EP."""
        return self.experts.whole() if self.experts is not None else nullcontext()

    def _load_eval_metrics(self) -> None:
        """``train.eval_metrics`` imported once (a bad entry is a ValueError naming it)."""
        if self.val_set is not None and not hasattr(self, "_eval_metrics"):
            self._eval_metrics = load_metrics(self.cfg.train.eval_metrics)

    def generate(self, batch: Batch, stop_ids: list[int], model: MultimodalModel | None = None) -> list[str]:
        """Greedy answers (decoded text) for a left-padded batch of prompts, by ``model`` (default: the
        trainer's): :func:`plait.models.generation.greedy_generate`, up to ``train.max_new_tokens`` tokens."""
        return greedy_generate(model or self.model, batch, self.tokenizer, stop_ids, self.cfg.train.max_new_tokens,
                               self.processor.pad_id, self.autocast)

    # ------------------------------------------------------------------ fit
    def resume(self, path: str | Path | None = None) -> int:
        """Restore the newest checkpoint of the run (or ``path``), written with this or any other parallel layout
        (:mod:`plait.train.checkpoint`); returns the step resumed at. Rank 0 prints the saved and the current
        layout, and whether the RNG streams were re-derived.

        Raises:
            FileNotFoundError: when there is nothing to resume from.
            ValueError: when the checkpoint's model config, global batch size, seed or training set (size, or
                its sample ids in order) differ.
        """
        ckpt = Path(path) if path else latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise FileNotFoundError(no_checkpoint_message(self.run_dir))
        layout = self.checkpoint_layout()
        state = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler, self.loader.state_dict(),
                                layout, config_to_dict(self.cfg)["model"], self.cfg.train.seed,
                                training_set_identity(self.train_set))
        self.loader.load_state_dict(state["loader"])
        self.step = state["step"]
        # with nothing left to train (fit warns "nothing to train") the LR's continuation is not news
        if self.info.is_main and self.scheduler.extended_from is not None and self.step < self.total_steps:
            say(f"plait: the run's length changed from {self.scheduler.extended_from} to {self.total_steps} steps: "
                f"the LR continues from {self.scheduler.lr:.3g} at step {self.step}, the rest of its cosine "
                f"re-stretched to end at step {self.total_steps} (no jump; README \"Longer runs\")")
        if self.info.is_main:
            was = state["layout"].describe() if state["layout"] is not None else "an unrecorded layout"
            say(f"plait: resuming step {self.step} written with {was}, now {layout.describe()}")
            if state["rng"] == "derived":
                say("plait: the layout changed, so RNG streams were re-derived from (train.seed, step, rank): "
                    "dropout/sampling randomness differs from an uninterrupted run; model, optimizer, LR "
                    "schedule and data position continue exactly")
        return self.step

    def checkpoint_layout(self) -> CheckpointLayout:
        """The layout checkpoints record and resume compare: world size, DP, PP, CP, TP and shard degrees and,
        under PP, the plan (per stage its modules, unit count and pipeline rank)."""
        plan = f"{self.plan.layout}, stages {describe_stages(self.plan)}" if self.stages is not None else ""
        return CheckpointLayout(world_size=self.info.world_size, dp=self.dp, pp=self.pp, cp=self.cp, plan=plan,
                                tp=self.dims.tp, dp_shard=self.dims.dp_shard)

    def save(self) -> Path:
        """Write a checkpoint of the current step (collective; once per step, however often it is called), with
        its layout and ``[model]`` config."""
        if self._saved_step == self.step:
            return checkpoint_dir(self.run_dir, self.step)
        path = save_checkpoint(
            checkpoint_dir(self.run_dir, self.step), self.model, self.optimizer, self.scheduler,
            self.loader.state_dict(), self.step, keep=self.cfg.checkpoint.keep,
            layout=self.checkpoint_layout(), model_config=config_to_dict(self.cfg)["model"],
            data=training_set_identity(self.train_set),
        )
        self._saved_step = self.step
        return path

    def full_model(self, path: str | Path | None = None) -> MultimodalModel:
        """The whole trained model, for export (``final/``; evaluation never needs it): the one in memory when
        every rank holds it whole; under PP, FSDP2, TP or EP (parameters split over ranks) the whole model built from
        the config (same seed) with the weights of checkpoint ``path`` (default: the newest), in this process alone.

        Raises:
            FileNotFoundError: under PP, FSDP2, TP or EP when there is no checkpoint.
        """
        if self.stages is None and self.sharded is None and self.tp is None and self.experts is None:
            return self.model
        model = model_from_checkpoint(self.cfg, self.tokenizer, self.run_dir, path, self.info.device)
        self._use_attention(model)
        return model

    def fit(self, resume: bool | str = False, stop_after: int | None = None, overwrite: bool = False
            ) -> dict[str, Any]:
        """Train until ``train.steps`` (or ``stop_after`` steps, for tests), validating and checkpointing on
        schedule, holding the run folder's lock throughout (:func:`~plait.train.run_lock.hold_run_lock`: a run folder
        another live run is writing is refused, ``ValueError``). A fresh run (no ``resume``) refuses a run
        directory holding an earlier run's checkpoints or final model, or with ``overwrite`` removes them first
        (:func:`~plait.train.run_start.clear_earlier_run`). Each step's samples are loaded ahead by ``data.num_workers`` worker processes
        (:class:`~plait.data.loader.SampleFeed`, :mod:`plait.train.feed`); one that fails to load is dropped from
        its step on every rank alike (or stops the run with ``data.on_error = "raise"``); the wait goes to the
        metrics as ``data_wait_s``. SIGTERM or SIGINT on any rank (:class:`~plait.train.preemption.StopSignals`)
        ends the run after the current step, with a checkpoint. Returns ``{"steps": steps trained by this call,
        "step": the step reached, "losses", "eval", "skipped", "dropped", "stopped": the signal that stopped it or
        0}``, under PP also ``"timeline"``."""
        with hold_run_lock(self.run_dir, self.info.is_main, self.info.world_size):
            result = self._fit(resume, stop_after, overwrite)
        self.runner.after_fit(result)  # a pipeline's timeline ("timeline": its JSON path on rank 0, else None)
        return result

    def _fit(self, resume: bool | str, stop_after: int | None, overwrite: bool) -> dict[str, Any]:
        """:meth:`fit` once the run folder is locked: the steps by :func:`~plait.train.loop.run_steps`, this trainer
        its :class:`~plait.train.loop.StepHost`."""
        self._load_eval_metrics()  # a bad train.eval_metrics entry: refused before step 1, not at the first validation
        resumed = self.resume(None if resume is True else resume) if resume else None
        if not resume:
            clear_earlier_run(self.run_dir, self.info.is_main, self.info.world_size, overwrite)
        main = self.info.is_main
        if resumed is not None and resumed >= self.total_steps and main:
            log.warning(nothing_to_train(resumed, self.total_steps, self.cfg.train))
        m = self.cfg.metrics
        writer = MetricsWriter(self.run_dir, main, m.tensorboard, resume_step=resumed, wandb=m.wandb,
                               wandb_project=m.wandb_project, config=config_to_dict(self.cfg),
                               energy=detect_energy_meter(self.info.device.type) if main else None)
        self._report_setup(writer)
        first = self.step
        end = self.total_steps if stop_after is None else min(self.total_steps, self.step + stop_after)
        when = LoopSchedule.of(self.cfg, self.total_steps, end, self.val_set is not None)
        bar = Progress(self.total_steps, "train", "step", main and self.cfg.metrics.progress, initial=self.step)
        feed = SampleFeed(self.train_set, upcoming_rank_samples(self.loader, self.step, end, self._rank_samples),
                          self.cfg.data.num_workers, self.cfg.data.prefetch)
        self._fitting = _Fitting(feed, writer, StopSignals(), bar)
        with self._fitting.stop:
            try:  # closed on an error too: no sample-feed thread or loader worker outlives the run
                done = run_steps(self, when, self.step, bar)
            finally:
                feed.close()
                bar.close()
                writer.close()
                self._fitting = None
        if done.stopped and main:
            log.warning("stopped by %s at step %d of %d: checkpoint %s; continue with --resume",
                        signal.Signals(done.stopped).name, self.step, self.total_steps,
                        checkpoint_dir(self.run_dir, self.step))
        return {"steps": self.step - first, "step": self.step, "losses": done.losses, "eval": done.evals,
                "skipped": len(self.train_set.skipped), "dropped": len(self.dropped), "stopped": done.stopped}

    # ------------------------------------------------------------------ the loop's steps (plait.train.loop.StepHost)
    def before_step(self, step: int) -> None:
        """Nothing to do before a step of ``plait train``."""

    def next_step(self) -> dict[str, Any]:
        """The next global batch's samples from the feed (one that failed to load dropped alike on every rank,
        :func:`~plait.train.feed.receive_step`), one optimizer step on them (:meth:`train_step`); its metrics row."""
        got = receive_step(self._fitting.feed.next(), self.loader.next_batch(), self.train_set, self.info.device,
                           self.cfg.data.on_error, self.step + 1)
        self._loaded, self.dropped = got.samples, self.dropped + got.dropped
        res = self.train_step(got.indices)
        self._loaded = {}
        return {"step": res.step, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm,
                "tokens_per_s": res.tokens / res.time_s, "target_tokens": res.target_tokens,
                "epoch": self.loader.epoch, "workload": res.workload, "deferred_samples": res.deferred_samples,
                "encoder_buffer_peak_bytes": res.encoder_buffer_peak_bytes, "data_wait_s": got.wait_s,
                "dropped_samples": len(got.dropped), **batch_sources(self.loader, got.indices)}

    def validate(self, step: int) -> dict[str, Any]:
        """:meth:`evaluate`; the validation row of step ``step``."""
        return {"step": step, "eval": self.evaluate(), **self.last_eval.record()}  # evaluate() sets last_eval

    def write(self, row: dict[str, Any]) -> None:
        """A metrics row to the run's writers (the main rank's)."""
        self._fitting.writer.write(row)

    def stop_agreed(self) -> int:
        """SIGTERM / Ctrl-C on any rank (:class:`~plait.train.preemption.StopSignals`; collective)."""
        return self._fitting.stop.agreed(self.info)

    def checkpoint(self, step: int) -> None:
        """:meth:`save` (the checkpoint of the current step, ``step``)."""
        self.save()

    def say(self, message: str) -> None:
        """``message`` on the main rank, without breaking the progress bar."""
        if self.info.is_main:
            self._fitting.bar.write(message)

    def _report_setup(self, writer: MetricsWriter) -> None:
        """Main rank: ``config.json`` in the run folder, the setup printed (:func:`report_setup`)."""
        if self.info.is_main:
            sets = [("train", self.train_set)] + ([("val", self.val_set)] if self.val_set else [])
            report_setup(self.run_dir, config_to_dict(self.cfg), self._counts, sets, self.total_steps,
                         self.info.world_size, writer.destinations(), self.dims,
                         fsdp_description(self.sharded, self.dims.pp > 1), self.runner.describe())

