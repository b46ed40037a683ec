"""The resilient training loop of ``plait launch`` (Oobleck, Jang et al., SOSP 2023): one
worker process of a job whose pipelines are heterogeneous data-parallel replicas (``plait.planner.resilience.templates``)
and whose workers may die, rank 0 included.

Each worker (its id is its rank in generation 0 and never changes):

1. joins the job's membership (``plait.parallel.membership``: heartbeats in the launcher's ``TCPStore``, the gloo
   group on a per-generation store prefix) and builds the stages of its pipeline's plan rank
   (``build_rank_stages``) and the per-unit gradient groups (``plait.parallel.hetero_dp``);
2. runs the loop of every plait job (:func:`~plait.train.loop.run_steps`: when to write, validate and
   checkpoint; the progress bar), this worker its step host: per step it draws the global batch from the job's
   loader (a function of seed, epoch and step), plans it with ``plait train``'s planner
   (:func:`~plait.train.batches.plan_global_batch`: ``train.microbatch_policy`` over the instantiation's
   microbatches, pipeline ``p`` taking the next ``counts[p]`` of them, :func:`pipeline_microbatches`) and runs its
   pipeline's share through the pipeline runtime as the pipelined trainer does (``run_pipeline_step``; the loss is
   normalised by the whole global batch's target tokens), the gradients summed across pipelines and clipped by its
   sync (:class:`~plait.parallel.grad_sync.HeteroSync`) and the optimizer stepped by
   :func:`~plait.train.optim.step_optimizer` at the LR of the trainers' schedule (``LRSchedule.of_job``);
3. votes to commit before its optimizer step (``Membership.commit``: a two-phase commit through the store), so
   either every survivor steps or none does;
4. when a collective or P2P call fails (a peer died), re-forms the group over the survivors, plans the
   reconfiguration (``plait.planner.resilience.reconfigure``: shrink, borrow, merge), builds its new stages on a fresh model,
   fills them from what it held and from the surviving replicas (``plait.parallel.unit_transfer``: parameters
   and AdamW state), prints one line and replays the step from its start with the same global batch. When some
   unit has no surviving copy it stops with :class:`~plait.planner.resilience.types.LostUnitsError`'s message (the
   lost units, resume from the last checkpoint).

With ``parallel.dp_shard`` > 1 (FSDP2 inside the pipelines; ``plait.planner.resilience.shards``) the plans' ranks
are shard groups: each worker runs its own row of its pipeline with its stage's trainable units sharded over its
group (``hetero_dp.shard_stages``); a failed worker's partners leave the job (:class:`ShardGroupLeft`) and units move
shard by shard.

Workers restarted or started again join at a step boundary (:class:`~plait.train.admission.JoinerAdmission`);
the launcher's decisions come as a :class:`~plait.train.launch_plan.LaunchPlan`.

Every worker appends one JSON line per committed step to ``<out>/worker<id>.jsonl`` (step, epoch, loss, learning
rate, the sample ids trained, the pipelines) and one per reconfiguration; at the end it saves its parameters to
``<out>/final-worker<id>.pt`` (by FQN). The LR schedule is the trainers' (:class:`~plait.train.optim.LRSchedule`),
so it continues across reconfigurations.

As ``plait train``, the job writes ``<metrics.run_dir>/metrics.jsonl`` (one row per step, by the current rank 0;
a worker that becomes rank 0 after the previous one died rewrites the last committed step's row and goes on),
validates every ``train.eval_every`` steps and at the end through its pipelines (``plait.train.replica_eval``: each
pipeline a share of the validation samples) and checkpoints every ``checkpoint.every`` steps and at the end
(:func:`~plait.train.checkpoint.save_checkpoint`: DCP, every worker its pruned stage model under full-model names,
replicas' identical keys stored once), which ``plait train --resume`` continues with any ordinary layout. A
validation and a checkpoint are committed like a step: when a worker dies during one, the survivors reconfigure
and do it again.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from plait.config.loader import config_to_dict
from plait.config.schema import JobConfig
from plait.data.chat_template import tokenizer_dir
from plait.data.collate import collate
from plait.data.mixture import build_batch_loader
from plait.data.progress import Progress
from plait.models.device import apply_cpu_threads
from plait.models.generation import stop_token_ids
from plait.models.registry import build_model, build_processor, load_tokenizer
from plait.models.units import unit_specs
from plait.parallel.grad_sync import HeteroSync
from plait.parallel.fsdp import ShardedModel, gathered
from plait.parallel.hetero_dp import (HeteroDP, build_hetero_dp, hetero_pipeline_comm, place_parts, receive_parts,
                                      shard_stages, tied_embedding_names, unit_parts)
from plait.parallel.membership import Membership, NoQuorumError, forget_process
from plait.parallel.pipeline import run_pipeline_step
from plait.parallel.stages import RankStages, build_rank_stages
from plait.parallel.unit_transfer import move_units, unit_parameter_names
from plait.planner.microbatch import MicrobatchPlan
from plait.planner.resilience.reconfigure import plan_reconfiguration
from plait.planner.resilience.shards import (failed_groups, group_workers, partners_left, shard_rows,
                                             worker_transfers)
from plait.planner.resilience.types import Instantiation, Reconfiguration, Transfer
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.schedules import build_schedule
from plait.train.admission import JoinerAdmission
from plait.train.batches import plan_global_batch
from plait.train.build import build_datasets, seed_everything
from plait.train.cost_coeffs import microbatch_cost_coeffs
from plait.train.checkpoint import CheckpointLayout, checkpoint_dir, save_checkpoint, training_set_identity
from plait.train.evaluation import EvalReport, eval_batch_size, evaluate_on, load_metrics
from plait.train.faults import Faults
from plait.train.launch_plan import LaunchPlan
from plait.train.loop import LoopSchedule, run_steps, total_steps
from plait.train.loss import token_loss_sum
from plait.train.metrics import MetricsWriter
from plait.train.optim import LRSchedule, build_optimizer, step_optimizer
from plait.train.replica_eval import replica_eval_side
from plait.train.run_start import say
from plait.train.step_run import unused_branches

__all__ = ["ResilientWorker", "WorkerRun", "pipeline_microbatches", "run_resilient_worker"]

log = logging.getLogger(__name__)

MAX_REPLAYS = 3
"""Replays of a step that fails with every worker alive (a slow worker taken for dead, or an error of the step
itself) before the job stops with the error."""

ADAMW_STATE = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)}
"""The per-parameter state keys of AdamW (shapes per parameter), for receiving moved units."""


def pipeline_microbatches(indices: Sequence[int], plan: MicrobatchPlan, counts: Sequence[int]
                          ) -> list[list[list[int]]]:
    """The global batch ``indices`` in the microbatches of ``plan`` (one replica of ``sum(counts)`` microbatches,
    :func:`~plait.train.batches.plan_global_batch`: the job's ``train.microbatch_policy``, as ``plait train``),
    pipeline ``p`` taking the next ``counts[p]`` of them. Returns per pipeline its microbatches (dataset indices;
    some empty when the batch holds fewer samples than microbatches).

    Raises:
        ValueError: when ``plan`` is not one replica of ``sum(counts)`` microbatches.
    """
    if plan.dp != 1 or plan.num_microbatches != sum(counts):
        raise ValueError(f"a plan of {plan.dp} replicas x {plan.num_microbatches} microbatches for pipelines of "
                         f"{list(counts)} microbatches")
    groups = [[indices[k] for k in mb] for mb in plan.microbatches[0]]
    starts = [sum(counts[:p]) for p in range(len(counts))]
    return [groups[a:a + c] for a, c in zip(starts, counts)]


class ShardGroupLeft(Exception):
    """This worker leaves the job: a worker of its shard group failed (FSDP2 inside the pipelines), so the shards
    it holds belong to a pipeline's copy that is gone (:func:`run_resilient_worker` ends it cleanly)."""


@dataclass
class WorkerRun:
    """This worker's part of an instantiation: stages, gradient groups (and their sum, ``sync``), schedule,
    optimizer."""

    inst: Instantiation
    stages: RankStages
    hetero: HeteroDP
    sync: HeteroSync
    schedule: Schedule
    opt: torch.optim.Optimizer | None
    eval_group: Any = None
    sharded: ShardedModel | None = None
    """FSDP2 inside the pipelines (``parallel.dp_shard`` > 1): this worker's stages' groups."""

    def drop_groups(self) -> None:
        """Drop this run's references to its process groups (gradient and validation groups), so that abandoning
        them closes their sockets."""
        self.hetero.groups.clear()
        self.eval_group = None


@dataclass
class ResilientWorker(JoinerAdmission):
    """One worker of a resilient job (module docstring). ``out``: the folder of logs and final parameters."""

    cfg: JobConfig
    plan: LaunchPlan
    membership: Membership
    out: Path
    tokenizer: Any = None
    processor: Any = None
    train_set: Any = None
    val_set: Any = None
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tied: tuple[str, ...] = ()
    """The FQNs of a weight tied between the LLM's embedding and head (``hetero_dp.tied_embedding_names``)."""
    cost_coeffs: dict[str, Any] = field(default_factory=dict)
    stop_ids: list[int] = field(default_factory=list)
    metric_fns: dict[str, Any] = field(default_factory=dict)
    faults: Faults | None = None
    """This worker's injected faults (``plait.train.faults``), if any."""
    schedule: LRSchedule | None = None
    writer: MetricsWriter | None = None
    last_row: dict[str, Any] | None = None
    last_error: str = ""
    run: WorkerRun | None = None
    """This worker's part of the current instantiation (:meth:`train` on)."""
    loader: Any = None
    """The job's global batch loader (:meth:`train` on)."""
    step: int = 0
    """Steps committed."""
    asking_since: dict[int, int] = field(default_factory=dict)
    """Rank 0's record of the step at which each worker outside the job was first seen asking to join."""

    @property
    def worker(self) -> int:
        """This worker's id."""
        return self.membership.worker

    def setup(self) -> None:
        """Tokenizer, processor and training set (no process group needed)."""
        cfg = self.cfg
        seed_everything(cfg.train.seed)
        self.tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
        model = self._fresh_model()
        self.processor = build_processor(cfg.model, model, self.tokenizer, cfg.data.max_length)
        self.train_set, self.val_set = build_datasets(cfg, self.processor, False)
        self.names = unit_parameter_names(model)
        self.tied = tied_embedding_names(model)
        self.cost_coeffs = microbatch_cost_coeffs(model)
        self.stop_ids = stop_token_ids(self.tokenizer, model.language_model.generation_config)
        self.metric_fns = load_metrics(cfg.train.eval_metrics) if self.val_set is not None else {}

    def _fresh_model(self) -> Any:
        return build_model(self.cfg.model, self.tokenizer, device="cpu", seed=self.cfg.train.seed)

    def build_run(self, inst: Instantiation, old: WorkerRun | None = None,
                  transfers: Sequence[Transfer] = ()) -> WorkerRun:
        """Build this worker's stages for ``inst`` on a fresh model, fill them from ``old`` and the transfers
        (collective over the current group), and create its gradient groups (collective)."""
        spares = inst.spares()
        if spares:  # the planner may keep spares (templates.PipelineTemplate); the runtime cannot run one
            n, used = spares[0]  # shard groups of dp_shard workers
            d = self.plan.templates.dp_shard
            raise ValueError(f"the new pipelines (workers {self.pipelines(inst)}) put {n * d} workers in a "
                             f"pipeline whose plan runs on {used * d}: plait launch cannot leave a worker idle as a "
                             "spare yet; resume from the last checkpoint with `plait train --resume`")
        members, d = self.membership.members, self.plan.templates.dp_shard
        rank_of = {w: i for i, w in enumerate(members)}
        timeout = datetime.timedelta(seconds=self.plan.timeout_s)
        pipeline = inst.pipelines[inst.pipeline_of(self.worker // d)]  # the planner's ranks are shard groups
        rows = [[rank_of[w] for w in row] for row in shard_rows(inst, d)]  # each worker runs a row of its pipeline
        comm = hetero_pipeline_comm(rows, rank_of[self.worker])
        model = self._fresh_model()
        specs = unit_specs(model)  # of the whole model, before pruning
        stages = build_rank_stages(model, pipeline.template.plan, comm.pp_rank)
        sharded = shard_stages(stages, specs, [[rank_of[w] for w in group_workers(g, d)] for g in inst.ranks],
                               timeout)
        t = self.cfg.train
        opt = None
        if stages.trainable_parameters():  # a rank of frozen units only has no optimizer
            scales = {name: enc.lr_scale for name, enc in self.cfg.model.encoders.items()}
            opt = build_optimizer(stages.model, t.lr, t.weight_decay, t.betas, scales)
        if old is not None or transfers:  # a joiner (old None) holds nothing and receives every unit
            # FSDP2: shards move shard by shard; a tied embedding moves whole (sharded or not, as the plans put it)
            whole = self.tied if sharded is not None or (old is not None and old.sharded is not None) else ()
            for group in old.sharded.all_groups() if old is not None and old.sharded is not None else ():
                group.reshard()  # a step that failed left them gathered: the sharded parameters (and state) again
            mesh = next((p.device_mesh for p in stages.model.parameters() if isinstance(p, DTensor)), None)
            held = unit_parts(dict(old.stages.model.named_parameters(remove_duplicate=False)), old.opt, whole,
                              mesh) if old else {}
            params = dict(stages.model.named_parameters(remove_duplicate=False))
            parts = receive_parts(params, whole)
            state = move_units(held, parts, self.names, worker_transfers(transfers, d), self.worker, rank_of,
                               ADAMW_STATE)
            place_parts(params, parts, state, opt, whole)
        hetero = build_hetero_dp(stages, comm, timeout, d)
        schedule = build_schedule(pipeline.template.plan, pipeline.template.schedule, pipeline.microbatches)
        eval_group = None
        if self.val_set is not None:  # every rank creates every row's group, in the same order (collective)
            for row in rows:
                group = torch.distributed.new_group(row, timeout=timeout)
                eval_group = group if rank_of[self.worker] in row and len(row) > 1 else eval_group
        return WorkerRun(inst, stages, hetero, HeteroSync(hetero), schedule, opt, eval_group, sharded)

    def _gradients(self, run: WorkerRun, indices: Sequence[int], targets: int, step: int) -> tuple[float, float]:
        """The pipeline's share of the global batch ``indices`` (:func:`pipeline_microbatches` of the run's
        instantiation) through the pipeline runtime, the gradients summed across pipelines and clipped by the run's
        sync; returns ``(loss, gradient norm)``. Raises ``RuntimeError`` when a peer died (collective over the
        group)."""
        counts = [p.microbatches for p in run.inst.pipelines for _ in range(self.plan.templates.dp_shard)]  # rows
        if len(indices) > sum(counts) * self.cfg.train.microbatch_size:
            raise ValueError(f"{len(indices)} samples do not fit {sum(counts)} microbatches of "
                             f"{self.cfg.train.microbatch_size}")
        plan, _ = plan_global_batch(self.cfg, [self.train_set.sample_meta(i) for i in indices], self.cost_coeffs, 1,
                                    sum(counts), step, allow_deferral=False)  # the pipelines route no features
        mine = pipeline_microbatches(indices, plan, counts)[run.hetero.comm.dp_rank]
        batches = [collate([self.train_set[i] for i in mb], self.processor.pad_id, pack=self.cfg.data.packing)
                   if mb else None for mb in mine]
        res = run_pipeline_step(run.stages, run.schedule, batches, targets, run.hetero.comm, loss_fn=token_loss_sum,
                                sharded=run.sharded, sync=run.sync)
        if run.sharded is not None:  # a branch no sample of the step uses keeps no gradient, as in one process
            run.sharded.drop_gradients(unused_branches(run.sharded, [self.train_set.sample_meta(i) for i in indices]))
        return res.loss, run.sync.clip(run.hetero.params, self.cfg.train.grad_clip)

    def _try_step(self, run: WorkerRun, indices: Sequence[int], targets: int,
                  step: int) -> tuple[float, float, float] | None:
        """One step: gradients, the two-phase commit (``Membership.commit``), then the optimizer step at the LR
        schedule's step. Returns ``(loss, lr, gradient norm)``, or None when the step is abandoned (a peer failed
        during it, here or on another member): then no member applied it."""
        node = [w for w in self.plan.node_workers(self.worker) if w in self.membership.members]
        hook = self.faults.arm(step, node) if self.faults is not None else None
        try:
            loss, norm = self._gradients(run, indices, targets, step)
        except RuntimeError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"  # text only: the traceback holds the old groups
            self.membership.commit(f"step{step}", ready=False)  # the others stop waiting for this worker
            return None
        finally:
            if hook is not None:
                hook.remove()
        if not self.membership.commit(f"step{step}"):
            return None
        return loss, step_optimizer(run.opt, self.schedule), norm

    def write(self, row: dict[str, Any]) -> None:
        """``metrics.jsonl`` as ``plait train`` writes it (a step's row, or a validation row: with ``eval``), by
        the current rank 0. A worker that becomes rank 0 mid-run (the previous one died) reopens the file at the
        step before its last committed row (which the dead worker may not have written) and writes that row again
        before ``row``."""
        last = self.last_row
        training = "eval" not in row
        if training:
            self.last_row = row
        if self.membership.rank != 0:
            if self.writer is not None:  # a rejoined lower worker id is rank 0 now
                self.writer.close()
                self.writer = None
            return
        m = self.cfg.metrics
        if self.writer is None:
            fresh = last is None and row["step"] == 1 and training
            again = last if last is not None else row
            self.writer = MetricsWriter(m.run_dir, True, m.tensorboard, None if fresh else again["step"] - 1)
            if last is not None:
                self.writer.write(last)
        self.writer.write(row)

    def checkpoint(self, steps: int) -> None:
        """Write the checkpoint of ``steps`` steps done (collective); a worker failing during it leads to a
        reconfiguration and the checkpoint written again."""
        self.run = self._checkpoint(self.run, steps, self.loader)

    def _checkpoint(self, run: WorkerRun, steps: int, loader: Any) -> WorkerRun:
        while True:
            try:
                save_checkpoint(checkpoint_dir(self.cfg.metrics.run_dir, steps), run.stages.model, run.opt,
                                self.schedule, loader.state_dict(), steps, keep=self.cfg.checkpoint.keep,
                                layout=self._layout(run.inst), model_config=config_to_dict(self.cfg)["model"],
                                data=training_set_identity(self.train_set))
                saved = True
            except (RuntimeError, CheckpointException):
                saved = False
            if self.membership.commit(f"save{steps}", ready=saved):
                return run
            run = self._recover(run, time.monotonic())

    def validate(self, steps: int) -> dict[str, Any]:
        """Validate after ``steps`` steps as ``plait train`` does (the loss per task, greedy answers, exact match,
        ``train.eval_metrics``, the predictions file), through the pipelines
        (:func:`~plait.train.replica_eval.replica_eval_side`; collective). Committed like a step: a worker failing
        during it leads to a reconfiguration and the validation again. Returns the validation row."""
        self.run, report = self._evaluate(self.run, steps)
        return {"step": steps, "eval": report.exact_match, **report.record()}

    def _evaluate(self, run: WorkerRun, steps: int) -> tuple[WorkerRun, EvalReport]:
        t = self.cfg.train
        while True:
            report: EvalReport | None = None
            run.stages.train(False)
            d, row = self.plan.templates.dp_shard, run.hetero.comm.dp_rank  # each shard row validates a share
            try:
                with gathered(run.sharded):  # FSDP2: the rows' forwards then run no collective of the shards
                    side = replica_eval_side(run.stages, run.inst.pipelines[row // d].template.plan, run.hetero.comm,
                                             (len(run.inst.pipelines) * d, row), run.eval_group, self.tokenizer,
                                             self.stop_ids, t.max_new_tokens, self.processor.pad_id)
                    report = evaluate_on(self.val_set, side, self.processor.pad_id, run.hetero.comm.device,
                                         eval_batch_size(t), steps, self.metric_fns, self.cfg.metrics.run_dir)
            except RuntimeError:
                pass
            finally:
                run.stages.train(True)
            if self.membership.commit(f"eval{steps}", ready=report is not None):
                return run, report
            run = self._recover(run, time.monotonic())

    def _layout(self, inst: Instantiation) -> CheckpointLayout:
        """The checkpoint's record of the job's layout: the workers, the pipelines as DP replicas and, as PP
        degree, the deepest pipeline's ranks, at least 2: every worker saves its pruned stage model as a pipeline
        rank does (model parts on no unit are never saved), which ``load_checkpoint`` accepts from a pipeline
        checkpoint only."""
        d = self.plan.templates.dp_shard
        pipelines = "; ".join(f"workers {w}: {p.template.plan.num_stages} stages, {p.microbatches * d} mb"
                              for w, p in zip(self.pipelines(inst), inst.pipelines))
        shards = f", stages sharded (FSDP2) over {d} workers" if d > 1 else ""
        deepest = max(p.template.plan.num_ranks for p in inst.pipelines)
        return CheckpointLayout(world_size=len(self.membership.members), dp=len(inst.pipelines) * d,
                                pp=max(2, deepest), cp=1, plan=f"plait launch: {pipelines}{shards}")

    def _log(self, record: dict[str, Any]) -> None:
        record["time"] = time.time()
        with open(self.out / f"worker{self.worker}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def reconfigure(self, run: WorkerRun, failed_at: float) -> WorkerRun:
        """After a failed step: re-form the group, plan and apply the reconfiguration, print one line.

        Raises:
            LostUnitsError: when some unit has no surviving copy (naming them); NoQuorumError from the agreement.
        """
        run.drop_groups()  # the old groups' last references: abandoning closes their sockets
        self.membership.reform()
        d = self.plan.templates.dp_shard
        left = tuple(w for p in self.pipelines(run.inst) for w in p if w not in self.membership.members)
        while partners := partners_left(run.inst, self.membership.members, d):  # FSDP2: their group's copy is gone
            dist.barrier()  # every member has connected to the new group before they leave it
            if self.worker in partners:
                raise ShardGroupLeft(f"its shard group lost worker(s) {list(left)}, so its shards belong to a copy "
                                     "that is gone; the others go on without the group")
            self.membership.reform()  # without them (they leave at once)
        rec: Reconfiguration = plan_reconfiguration(self.plan.templates, run.inst,
                                                    failed_groups(run.inst, self.membership.members, d))
        new = self.build_run(rec.after, run, rec.transfers)
        seconds = time.monotonic() - failed_at
        groups = f" (shard groups of {d} workers; their partners left)" if d > 1 else ""
        line = (f"plait launch: reconfigured in {seconds:.2f} s: worker(s) {list(left)} failed{groups}; "
                f"{rec.summary(d)}; workers per pipeline {self.pipelines(rec.after)}")
        if self.membership.rank == 0:
            say(line)
        self._log({"event": "reconfigure", "failed": list(left), "bytes": rec.bytes, "seconds": seconds,
                   "pipelines": self.pipelines(rec.after), "copies": [[t.unit, t.src, t.dst] for t in rec.transfers]})
        return new

    def pipelines(self, inst: Instantiation) -> list[list[int]]:
        """The workers of each pipeline of ``inst`` (with FSDP2 inside the pipelines, its shard groups' workers in
        group order)."""
        d = self.plan.templates.dp_shard
        return [[w for g in p.ranks for w in group_workers(g, d)] for p in inst.pipelines]

    def _recover(self, run: WorkerRun, failed_at: float) -> WorkerRun:
        """:meth:`reconfigure` until it succeeds (another worker failing during it leads to one more round)."""
        while True:
            try:
                return self.reconfigure(run, failed_at)
            except NoQuorumError:
                raise
            except RuntimeError as exc:  # another worker failed during it: one more generation (ShardGroupLeft is none)
                log.warning("worker %d: reconfiguration failed (%s: %s); one more round", self.worker,
                            type(exc).__name__, exc)

    def train(self, joining: bool = False) -> None:
        """Train every step of the job (``train.steps``, or ``train.epochs`` of the loader) by the loop of every
        plait job (:func:`~plait.train.loop.run_steps`, this worker its :class:`~plait.train.loop.StepHost`),
        surviving failures, writing metrics and checkpoints as ``plait train`` does; ``joining``: this worker was
        restarted and joins the running job (:meth:`Membership.rejoin`). A progress bar on the worker that starts
        as rank 0 (``metrics.progress``)."""
        self.loader = loader = build_batch_loader(self.cfg, self.train_set)
        total = total_steps(self.cfg, loader.batches_per_epoch)
        self.schedule = LRSchedule.of_job(self.cfg.train, total)
        self.step = 0
        if joining:
            start = time.monotonic()
            payload = self.membership.rejoin()
            self.step = int(payload["step"])
            self.schedule.load_state_dict({"last_epoch": self.step, "_step_count": self.step + 1})
            for _ in range(self.step):  # the data position: the global batches are a function of (seed, epoch, step)
                loader.next_batch()
            self.run = self._apply_rejoin(Instantiation.from_dict(payload["inst"]), payload["joiners"], None, start)
        else:
            self.run = self.build_run(self.plan.instantiation)
        bar = Progress(total, "launch", "step", self.membership.rank == 0 and self.cfg.metrics.progress,
                       initial=self.step)
        try:
            run_steps(self, LoopSchedule.of(self.cfg, total, validates=self.val_set is not None), self.step, bar)
        finally:
            bar.close()
        if self.writer is not None:
            self.writer.close()
        torch.save({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()  # shards gathered
                    for n, p in self.run.stages.model.named_parameters()}, self.out / f"final-worker{self.worker}.pt")

    def before_step(self, step: int) -> None:
        """Admit the workers planned to rejoin at ``step`` (:meth:`admit_joiners`)."""
        self.run = self.admit_joiners(self.run, step)

    def stop_agreed(self) -> int:
        """0: the launcher, not the loop, handles the job's signals."""
        return 0

    def say(self, message: str) -> None:
        """``message`` on the current rank 0."""
        if self.membership.rank == 0:
            say(f"plait launch: {message}")

    def next_step(self) -> dict[str, Any]:
        """The next step on the loader's next global batch, replayed after reconfigurations until it commits;
        logged in the worker's log. Returns its metrics row."""
        loader, step = self.loader, self.step
        epoch, begin = loader.epoch, time.monotonic()
        indices = loader.next_batch()
        targets = sum(self.train_set.sample_meta(i).target_tokens for i in indices)
        failed_at, in_vain = None, 0
        while (done := self._try_step(self.run, indices, targets, step)) is None:  # replay the step until it commits
            failed_at, members = failed_at or time.monotonic(), self.membership.members
            self.run = self._recover(self.run, failed_at)  # outside the except: its traceback held the old groups
            in_vain = in_vain + 1 if self.membership.members == members else 0
            if in_vain == MAX_REPLAYS:  # a failure no worker's death explains (a bug, not a peer): stop
                seen = self.last_error or "none here (another worker abandoned the step)"
                raise RuntimeError(f"step {step} failed {in_vain} times in a row with every worker alive; last "
                                   f"error on worker {self.worker}: {seen}")
        loss, lr, norm = done
        self.step += 1
        record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr,
                  "samples": [self.train_set.sample_meta(i).id for i in indices],
                  "pipelines": self.pipelines(self.run.inst)}
        if failed_at is not None:
            record["recovery_s"] = time.monotonic() - failed_at
            self.say(f"recovered: step {step} done {record['recovery_s']:.2f} s after the failure was seen")
        self._log(record)
        tokens = sum(self.train_set.sample_meta(i).length for i in indices)
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
                "tokens_per_s": tokens / (time.monotonic() - begin), "target_tokens": targets,
                "epoch": loader.epoch, "pipelines": record["pipelines"],
                **({"recovery_s": record["recovery_s"]} if failed_at is not None else {})}


def run_resilient_worker(cfg: JobConfig, plan_path: str | Path, worker: int, world: int, host: str,
                         port: int, joining: bool = False) -> None:
    """Run worker ``worker`` of ``world`` of the job planned in ``plan_path`` (``LaunchPlan`` JSON; its folder
    also receives the logs), with the membership store at ``host:port`` (hosted by the launcher); ``joining``: a
    restarted worker joining the running job.

    Raises:
        LostUnitsError: when failures left some unit with no copy; NoQuorumError: when the survivors cannot
            agree (see ``plait.parallel.membership``).
    """
    plan_path = Path(plan_path)
    plan = LaunchPlan.from_json(plan_path.read_text())
    apply_cpu_threads(cfg.train.threads, local_processes=plan.per_node)  # plait train's rule, this node's workers
    # a dead process is known at once from the launcher's dead/<id> key; a stale heartbeat (a hung worker, or a
    # heartbeat thread starved on a loaded machine) only counts after the collective timeout
    membership = Membership(host, port, worker, world, dead_after_s=plan.timeout_s, timeout_s=plan.timeout_s)
    job = ResilientWorker(cfg, plan, membership, plan_path.parent)
    job.faults = Faults(worker, worker // plan.per_node, plan.kills, plan.stops, plan.node_kills, membership.posted)
    job.setup()
    if not joining:
        membership.join()
    try:
        job.train(joining)
    except ShardGroupLeft as exc:
        say(f"plait launch: worker {worker} leaves the job: {exc}")
        if job.writer is not None:  # the next rank 0 carries metrics.jsonl on
            job.writer.close()
        membership.close()
        # no heartbeat at all: the others' agreement counts this worker gone at once (membership._gone)
        forget_process(dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60)), worker)
    finally:
        membership.close()
