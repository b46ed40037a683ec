"""``plait train``: train a job (single process, or under torchrun for DP/CP/PP) and save the result.

:func:`train_command` loads the job, resolves ``parallel.plan = "auto"`` (:func:`resolve_auto`: rank 0
profiles the model alone (``plait.measure.auto_profile.main_rank_profile``) while the others wait, every rank runs the
same deterministic search, ``plait.train.apply_plan.resolve_auto_plan``), builds the trainer (``PipelineTrainer`` when
``parallel.pp.degree`` > 1), fits, and on the main rank saves the final model, tokenizer and processors, draws
the loss curve and prints where everything went.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait.train.job_file import same_on_every_rank
from plait.measure.host_costs import CPU_OPTIMIZER_S_PER_BYTE, host_device, measured_overheads
from plait.train.plan_search import explain_no_fit, job_expert_layers
from plait.config.loader import load_config
from plait.config.schema import JobConfig, ParallelConfig, PipelineConfig
from plait.measure.auto_profile import main_rank_profile
from plait.models.device import apply_cpu_threads
from plait.models.generation import save_final
from plait.measure.machine import auto_plan_inputs
from plait.parallel.process_group import init_distributed
from plait.planner.search.types import Machine, NoPlanFits
from plait.planner.report import format_plan
from plait.train.apply_plan import resolve_auto_plan
from plait.train.metrics import import_wandb
from plait.train.pipeline_trainer import PipelineTrainer
from plait.train.plots import plot_loss_curve
from plait.train.preemption import StopSignals, exit_code
from plait.train.run_dir import check_new_run
from plait.train.run_lock import check_run_free, hold_run_lock
from plait.train.run_start import elastic_restart
from plait.train.trainer import Trainer

__all__ = ["auto_plan_replaces", "resolve_auto", "train_command"]

def train_command(config: str | Path, overrides: list[str], *, resume: bool | str = False,
                  profile_store: str | Path = "runs/profiles", overwrite: bool = False) -> int:
    """``plait train``: train the job in ``config`` (with its ``--section.key=value`` overrides); returns 0, or
    128 + the signal's number when SIGTERM / SIGINT stopped it after a checkpoint (no ``final/`` then).

    A job that ``torchrun --max-restarts`` restarted resumes from the newest complete checkpoint by itself
    (:func:`~plait.train.run_start.elastic_restart`). Before anything is built: a ``metrics.run_dir`` that another
    live run is writing is refused
    (:func:`~plait.train.run_lock.check_run_free`; the run folder's lock is then held until the final model is
    saved), a new run into one holding an earlier run's checkpoints or final model is refused unless ``overwrite``
    (:func:`~plait.train.run_dir.check_new_run`), and ``metrics.wandb`` needs the ``wandb`` package.

    Args:
        resume: True to resume from the newest checkpoint of the run, or a checkpoint directory.
        profile_store: folder of stored profiles for ``parallel.plan = "auto"``.
        overwrite: start a new run even when the run directory holds an earlier one (its checkpoints and final
            model are removed).

    Raises:
        ValueError, FileNotFoundError: on a bad or missing job file, an earlier run in the way, ``resume`` with
            ``overwrite``, or ``metrics.wandb`` without wandb (marked ``same_on_every_rank``: every rank reads the
            same files), and as the trainer.
    """
    with same_on_every_rank():  # every rank reads the same files
        cfg = load_config(config, overrides)
        resume, overwrite = elastic_restart(cfg.metrics.run_dir, resume, overwrite)  # torchrun --max-restarts
        _check_before_building(cfg, config, resume, overwrite, overrides)
    apply_cpu_threads(cfg.train.threads)  # before profiling or building: torch's one per core crawls on a shared CPU
    info = None
    if cfg.parallel.plan == "auto":
        cfg, info = resolve_auto(cfg, profile_store)
    trainer = PipelineTrainer.build(cfg, info) if cfg.parallel.pp.degree > 1 else Trainer.build(cfg, info)
    # SIGTERM / Ctrl-C after the last step (fit's own handling has ended) waits until final/ is whole and the lock
    # released: a half-written final/ and a stale lock are never left; the run is complete, so the exit is 0
    late = StopSignals("finishing the final model, then stopping")
    with late, hold_run_lock(trainer.run_dir, trainer.info.is_main, trainer.info.world_size):
        result = trainer.fit(resume=resume, overwrite=overwrite)
        if trainer.info.is_main and not result["stopped"]:  # a stopped run has a checkpoint, not a final model
            _save_and_report(trainer, result)
    if dist.is_initialized():  # a clean shutdown: gloo's worker threads must not outlive the interpreter
        dist.destroy_process_group()
    return exit_code(result["stopped"]) if result["stopped"] else 0


def _check_before_building(cfg: JobConfig, config: str | Path, resume: bool | str, overwrite: bool,
                           overrides: list[str] = ()) -> None:
    """The checks that need no model: ``--resume`` with ``--overwrite``, an earlier run in the run directory of a
    new run (without ``--overwrite``), ``metrics.wandb`` without the package.

    Raises:
        ValueError: naming the flags, the folder or the package.
    """
    if resume and overwrite:
        raise ValueError("--resume continues the run in metrics.run_dir and --overwrite replaces it: give one")
    check_run_free(cfg.metrics.run_dir)  # another live run writing there (its lock): refused whatever the flags
    if not resume and not overwrite:
        try:
            check_new_run(cfg.metrics.run_dir)
        except ValueError as exc:
            job = " ".join([f"--config {config}", *overrides])  # the suggested commands keep the user's overrides
            raise ValueError(str(exc).replace("--config JOB", job)) from None
    if cfg.metrics.wandb:
        import_wandb()


def _save_and_report(trainer: Trainer, result: dict[str, Any]) -> None:
    """Main rank after ``fit``: the loss curve, the final model with its tokenizer and processors, and one line
    each for them, the last step's pipeline timeline and the validation scores."""
    try:
        png = plot_loss_curve(trainer.run_dir / "metrics.jsonl", trainer.run_dir / "loss.png")
    except ValueError:  # a resumed run that had nothing left to train and whose metrics.jsonl was lost
        png = "not drawn (metrics.jsonl holds no training loss)"
    final = trainer.run_dir / "final"
    save_final(trainer.full_model(), trainer.processor, final, trainer.cfg.checkpoint.merge_lora)  # PP: from a ckpt
    done = (f"trained {result['steps']} step{'' if result['steps'] == 1 else 's'}" if result["steps"]
            else "nothing trained")
    print(f"plait: {done} (model at step {result['step']}); loss curve {png}; model {final} (written by this run: "
          f"{trainer.checkpoint_layout().describe()})")
    if result.get("timeline"):
        print(f"plait: pipeline timeline of the last step {result['timeline']} (Chrome trace; open in "
              f"https://ui.perfetto.dev) and {result['timeline'].with_suffix('.png')}")
    for task, acc in result["eval"].items():
        print(f"plait: validation exact match {task}: {acc:.1%}")


def resolve_auto(cfg: JobConfig, store: str | Path) -> tuple[JobConfig, Any]:
    """``parallel.plan = "auto"``: rank 0 profiles the model alone (reusing a stored profile whose key matches;
    ``plait.measure.auto_profile.main_rank_profile``), every rank receives the profile, the smallest device memory
    cap and the link model (``auto_plan_inputs``: same on every rank) and runs the same deterministic search, so all ranks agree on the
    plan, charging the runtime overheads the profile measured as ``plait plan`` does
    (``measure.host_costs.measured_overheads``). The main rank prints the choice.

    Returns:
        ``(resolved config, the process's DistInfo)``.
    """
    info = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    if info.is_main:
        print(f"plait: parallel.plan=auto: the model's per-unit costs on this machine, from {store} when stored, else "
              "measured now (minutes on a CPU; a progress bar on stderr)", flush=True)
    started = time.perf_counter()
    profile = main_rank_profile(cfg, store, info)
    if info.is_main:
        print(f"plait: parallel.plan=auto: costs ready after {time.perf_counter() - started:.0f} s", flush=True)
    machine = auto_plan_inputs(info.device, max((c.output_bytes for c in profile.costs), default=0))
    # a MoE LLM's layers, with the profile's measured routing: expert parallelism is searched too
    experts = job_expert_layers(cfg, profile.units, "cpu" if info.device.type == "cpu" else host_device()[0],
                                profile.key.dtype, profile.router_load)
    try:
        optimizer_s_per_byte = CPU_OPTIMIZER_S_PER_BYTE if info.device.type == "cpu" else 0.0
        resolved, choice = resolve_auto_plan(cfg, info.world_size, profile.units, profile.costs, machine=Machine(
            memory_cap=machine.memory_cap_bytes, p2p=machine.p2p, dp_link=machine.p2p, dtype=profile.key.dtype,
            overheads=measured_overheads(profile, optimizer_s_per_byte)), experts=experts)
    except NoPlanFits as exc:
        raise ValueError("parallel.plan=auto: " + explain_no_fit(
            exc, info.world_size, machine.memory_cap_bytes, machine.memory_source,
            "more processes, a device with more memory, or freeze more of the model")) from None
    if info.is_main:
        pp = resolved.parallel.pp
        shape = (f"layout {pp.layout}, stages {pp.stages}, splits {pp.splits or 'even'}, virtual stages "
                 f"{pp.virtual_stages}, encoders attached {pp.attach_encoders}, encoders in the bubbles "
                 f"{pp.encoders_in_bubble}, schedule {pp.schedule}, "
                 f"{pp.microbatches} microbatches per replica" if pp.degree > 1 else "no pipeline parallelism")
        par = resolved.parallel
        extra = (f" x TP {par.tp}" if par.tp > 1 else "") + (f", FSDP2 dp_shard {par.dp_shard}" if par.dp_shard > 1
                                                             else "") + (f", EP {par.ep}" if par.ep > 1 else "")
        extra += (f", activation checkpointing {resolved.train.activation_checkpointing}"
                  if resolved.train.activation_checkpointing != "none" else "")
        print(f"plait: parallel.plan=auto for {info.world_size} process(es): DP {par.dp} x PP {pp.degree}{extra}, "
              f"{shape}")
        note = auto_plan_replaces(cfg, resolved)
        if note:
            print(note)
        print(f"plait: auto-plan inputs: {machine.describe()}")
        print(format_plan(choice), flush=True)
    return resolved, info


def auto_plan_replaces(cfg: JobConfig, resolved: JobConfig) -> str | None:
    """One line saying what ``parallel.plan = "auto"`` replaced: the job's ``parallel.dp`` and ``[parallel.pp]``
    fields that differ from their defaults, as written and as chosen (``resolved``), and the ``parallel.dp_shard``,
    ``parallel.tp`` and ``train.activation_checkpointing`` the plan writes when they differ from the job's; None
    when there is nothing to say."""
    default_pp, written, chosen = PipelineConfig(), cfg.parallel.pp, resolved.parallel.pp
    changes = [f"parallel.pp.{f.name} = {getattr(written, f.name)!r} -> {getattr(chosen, f.name)!r}"
               for f in dataclasses.fields(PipelineConfig) if getattr(written, f.name) != getattr(default_pp, f.name)]
    if cfg.parallel.dp != ParallelConfig().dp:
        changes.insert(0, f"parallel.dp = {cfg.parallel.dp} -> {resolved.parallel.dp}")
    for section, name in (("parallel", "dp_shard"), ("parallel", "tp"), ("train", "activation_checkpointing")):
        was, now = getattr(getattr(cfg, section), name), getattr(getattr(resolved, section), name)
        if was != now:
            changes.append(f"{section}.{name} = {was!r} -> {now!r}")
    if not changes:
        return None
    return "plait: parallel.plan=auto replaces the job's " + ", ".join(changes) + " (written -> chosen)"
