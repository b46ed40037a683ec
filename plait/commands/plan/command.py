"""``plait plan``: choose the pipeline layout of a job for N devices, print it, write it.

- :func:`plan_command`: read a job config (:func:`load_config_for_planning`), build the model's pipeline units
  (``plait.models.plan_inputs.job_units``: the units and names of the job's own model, so a boundary printed here
  can be pasted into ``parallel.pp.splits``) and their analytic costs (``plait.planner.cost.analytic``: Hugging Face
  configs from the TOML ``config`` tables or local ``path`` directories, read with ``transformers.AutoConfig``; no
  weights), search the layout (``plait.planner.search.layout.plan_layout``), print the plan as a table
  (``plait.planner.report.format_plan``) with the ready-to-paste job tables (``snippet.pp_snippet``) and the
  command that runs it (``snippet.run_command``), preferring a plan without a pipeline on fewer devices when the
  fastest is at most ``PREFER_WITHIN`` faster (:func:`prefer_simpler`), and write it as JSON (``plait.planner.report.plan_to_json``; ``plan_from_json`` reads it back, ``plait simulate``
  times it).

Workload assumed per microbatch (from the config, overridable): ``train.microbatch_size`` sequences of
``data.max_length`` LLM tokens (an upper bound: padding to the longest), each with ``items_per_sample``
items per encoder at the encoder's native size (vision: its ``image_size`` patches; audio: its
``max_source_positions`` frames); ``global_batch_size / microbatch_size`` microbatches per iteration, or the
global batch split into ``--microbatches N`` microbatches of ``ceil(global_batch_size / N)`` sequences
(:func:`split_global_batch`; never more samples than the job's global batch).

Macro-batches (Entrain, arXiv 2605.27918): when the job has training data and
``macrobatches`` > 0, :func:`plan_command` reads every sample's metadata (:func:`dataset_metadata`: the trainer's
processing; the model is built on the meta device, so no weights), draws that many global batches in the
loader's order (``plait.planner.microbatch.macrobatch.macrobatch_stats``), prints how much each module's total work varies
between batches (CV, min/max, against the ``1 / sqrt(B)`` law) and plans for the **expected** global batch
instead of the upper bound above: per microbatch, ``microbatch_size`` x the mean per-sample encoder tokens,
attended pairs and LLM tokens (``plait.planner.microbatch.macrobatch.expected_shapes``).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from plait.data.chat_template import tokenizer_dir
from plait.data.loader import GlobalBatchLoader, MultimodalDataset
from plait.models.plan_inputs import PlanInputs, build_plan_inputs, device_spec, model_parts
from plait.models.registry import build_model, build_processor, load_tokenizer
from plait.train.job_file import load_config_for_planning
from plait.measure.host_costs import host_cpu, host_device, runtime_costs, stored_profile
from plait.train.plan_search import search_plan
from plait.commands.plan.fsdp import fsdp_line
from plait.commands.plan.nodes import on_whole_nodes, partial_node_note, whole_node_plan
from plait.commands.plan.snippet import pp_snippet, run_command
from plait.parallel.activation_checkpointing import checkpoint_policy
from plait.planner.cost.types import DeviceSpec, MicrobatchShape
from plait.planner.microbatch.macrobatch import expected_shapes, macrobatch_stats
from plait.planner.microbatch.types import MacrobatchStats
from plait.planner.cost.node_presets import nvlink_infiniband
from plait.planner.pipeline.schedules import SCHEDULE_NAMES
from plait.planner.pipeline.types import LAYOUTS
from plait.planner.cost.recompute import checkpointed_costs, plan_checkpointing
from plait.planner.report import format_bytes, format_lora_units, format_plan, plan_to_json
from plait.planner.search.encoder_dp import encoder_dp_bounds, encoder_tp_bounds
from plait.planner.search.types import LayoutChoice, Machine, SearchSpace
from plait.planner.types import LLM_MODULE, Unit, UnitCost
from plait.train.apply_plan import kept_degrees
from plait.train.cost_coeffs import microbatch_cost_coeffs

__all__ = [
    "CPU_PRESET",
    "DEFAULT_MACROBATCHES",
    "DEVICE_CHOICES",
    "PREFER_WITHIN",
    "PlanSetup",
    "dataset_metadata",
    "plan_setup",
    "plan_command",
    "prefer_simpler",
    "split_global_batch",
]

DEFAULT_MACROBATCHES = 32
CPU_PRESET = "cpu-preset"
"""``--device`` name of the fixed CPU preset (``DeviceSpec.cpu``); ``--device cpu`` is this host's CPU, measured."""
DEVICE_CHOICES = ("h100", "h200", "a100", "cpu", CPU_PRESET)
"""``plait plan --device`` names."""
PREFER_WITHIN = 0.10
"""Tolerance of ``plait plan``'s preference for simple plans: a plan without a pipeline on fewer devices is
kept unless the fastest plan is predicted more than this fraction faster (a prediction's error is of this order,
and a pipeline adds bubbles, transfers and processes that the prediction may miss)."""

# ----- macro-batches ---------------------------------------------------------------------------------
def dataset_metadata(cfg: Any) -> tuple[list[Any], dict[str, Any]]:
    """Every training sample's metadata and the per-sample cost coefficients of a ``JobConfig``'s model.

    The samples are processed exactly as the trainer does (``MultimodalDataset``: same tokenizer, placeholder
    expansion and feature counts; bad records follow ``data.on_error``); the model is built on the meta
    device (no weights, no init), which is all ``plait.train.cost_coeffs.microbatch_cost_coeffs`` reads.

    Returns:
        ``(metas, coeffs)``: ``SampleMeta`` per usable sample and ``ModuleCostCoeffs`` per encoder and ``"llm"``
        (forward FLOPs x frozen-aware pass factor).

    Raises:
        ValueError: when the job has no ``data.train``, and as the trainer's data pipeline (bad records, no
            usable sample).
    """
    if not cfg.data.train:
        raise ValueError("data.train is not set: macro-batch statistics need the training data")
    tokenizer = load_tokenizer(tokenizer_dir(cfg.data, cfg.model), cfg.data.chat_template)
    model = build_model(cfg.model, tokenizer, device="meta")
    processor = build_processor(cfg.model, model, tokenizer, cfg.data.max_length)
    dataset = MultimodalDataset(cfg.data.train, processor, cfg.data.on_error)
    return dataset.meta, microbatch_cost_coeffs(model)


def _macrobatches(cfg: Any, count: int, stream: TextIO) -> tuple[MacrobatchStats | None, dict[str, MicrobatchShape]]:
    """Macro-batch statistics of the job's training data (printed) and the expected microbatch shapes; no
    statistics (a note instead) when the dataset holds fewer samples than one global batch."""
    metas, coeffs = dataset_metadata(cfg)
    configs, _, dropped = model_parts(cfg)
    shapes = expected_shapes(metas, configs, dropped, cfg.train.microbatch_size)
    batch = cfg.train.global_batch_size
    if batch > len(metas):
        print(f"macro-batches: {len(metas)} samples, fewer than one global batch of {batch}: no statistics",
              file=stream)
        return None, shapes
    order = GlobalBatchLoader(len(metas), batch, seed=cfg.train.seed).epoch_order  # the trainer's loader order
    stats = macrobatch_stats(metas, batch, count, coeffs, seed=cfg.train.seed, sampling="loader", epoch_order=order)
    print(stats.format_table(unit="FLOPs x passes"), file=stream)
    planned = ", ".join(f"{name} {shape.tokens} tokens" for name, shape in shapes.items())
    print(f"planned for the expected global batch: per microbatch of {cfg.train.microbatch_size} samples "
          f"{planned}", file=stream)
    return stats, shapes


# ----- plan ------------------------------------------------------------------------------------------
def check_schedules(names: Sequence[str]) -> tuple[str, ...]:
    """``--schedules``: names of the schedules weighed (``schedules.SCHEDULE_NAMES`` but ``interleaved_1f1b``, which
    the search picks for plans of several stages per rank; ``zb_v`` is weighed on its own V, ``plan_layout``).

    Raises:
        ValueError: on an unknown name or none, naming the choices.
    """
    allowed = [n for n in SCHEDULE_NAMES if n != "interleaved_1f1b"]
    if not [n for n in names if n]:
        raise ValueError(f"--schedules: give at least one schedule; choose from {', '.join(allowed)} "
                         "(interleaved_1f1b is weighed by itself for plans of several stages per rank)")
    bad = [n for n in names if n not in allowed]
    if bad:
        raise ValueError(f"--schedules: unknown schedule(s) {bad or list(names)}; choose from {', '.join(allowed)}")
    return tuple(names)


def plan_command(
    config_path: str | Path,
    devices: int,
    out_json: str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    device: str | DeviceSpec | None = None,
    microbatches: int | None = None,
    items_per_sample: int = 1,
    memory_fraction: float = 0.9,
    frozen_aware: bool = True,
    layouts: Sequence[str] = LAYOUTS,
    dp_degrees: Sequence[int] | None = None,
    dp_link_Bps: float | None = None,
    rel_tol: float = 0.0,
    macrobatches: int = 0,
    virtual_stages: Sequence[int] = (1, 2, 4),
    attach_encoders: bool = True,
    in_bubble: bool = True,
    schedules: Sequence[str] = ("1f1b",),
    out: TextIO | None = None,
    profile_store: str | Path | None = "runs/profiles",
    prefer_within: float = PREFER_WITHIN,
    gpus_per_node: int | None = None,
    encoder_dp: bool = True,
    encoder_tp: bool = False,
) -> LayoutChoice:
    """``plait plan``: choose the pipeline layout of a job for ``devices`` accelerators, print it with its job
    tables (``pp_snippet``, or why there are none) and the command that runs it (``run_command``), save it. The job file is read with
    ``load_config_for_planning``: its own ``[parallel.pp]`` table and ``parallel.dp`` are replaced by the plan,
    not checked.

    Args:
        config_path: TOML job file; overrides: dotted ``--section.key=value`` overrides.
        devices: accelerators available.
        out_json: where to write the plan JSON (``plait.planner.report.plan_to_json``; parents
            created); None: do not write.
        device: accelerator preset (``h100``, ``h200``, ``a100``; ``cpu-preset``: the fixed CPU preset) or
            ``DeviceSpec``; its link is the stage-to-stage P2P model. ``"cpu"``: this host's CPU, measured as below.
            None: this host's (``measure.host_costs.host_device``: the GPU's preset; without a GPU this host's CPU
            measured by ``measure.host_costs.host_cpu`` with ``train.threads`` threads, else the cores / ``devices``), printed.
            On a device with host overheads (the ``"cpu"`` preset) the plan charges the runtime's fixed costs
            (``measure.host_costs.runtime_costs``): the job's measured profile from ``profile_store`` when one matches
            (``measure.host_costs.stored_profile``: its unit costs and overheads), else the analytic costs plus the
            preset's measured per-chunk-action and per-message overheads; and the DP all-reduce on its link.
        microbatches: global microbatches per step: the job's global batch split into this many microbatches of
            ``ceil(train.global_batch_size / microbatches)`` samples (``split_global_batch``; at most
            ``train.global_batch_size``); None: ``global_batch_size / microbatch_size`` of ``microbatch_size``.
        items_per_sample: workload (``build_plan_inputs``).
        gpus_per_node: plan for nodes of this many GPUs (``_with_nodes``: NVLink inside, InfiniBand between, the
            rank order written as ``parallel.rank_order``; at least 1); None: one node.
        memory_fraction: fraction of the device memory a stage may use (the rest: CUDA context, workspaces).
        dp_degrees: DP degrees to search (``plait plan --dp``), each in ``1..min(devices, microbatches)``;
            None: the divisors of ``devices`` in that range.
        frozen_aware, layouts, rel_tol, virtual_stages, attach_encoders, in_bubble: as
            ``search.plan_layout`` (by default interleaved 1F1B with 2 or 4 LLM stages per rank, encoders on
            the first LLM rank and encoders in the last LLM rank's bubbles are searched too: jobs run them,
            ``[parallel.pp] virtual_stages / attach_encoders / encoders_in_bubble``).
        schedules: the schedules weighed for a plan of one stage per rank (``SearchSpace.schedules``: ``1f1b``,
            and the zero-bubble ``zb_h1``, ``zb_h2``); the fastest that fits memory is planned.
        dp_link_Bps: bandwidth (B/s) of the data-parallel gradient all-reduce; None: not modelled.
        encoder_dp: search per-encoder data-parallel degrees too (``search.encoder_dp``: each encoder branch's
            stages replicated on up to ``train.microbatch_size`` ranks, written as ``[parallel.pp] encoder_dp``);
            False (``--no-encoder-dp``): one replica per encoder stage.
        encoder_tp: also search per-encoder tensor-parallel degrees (each branch's stages as TP groups of up to the
            largest power of two dividing its heads, ``search.encoder_dp.encoder_tp_bounds``; not for a model
            plait's TP refuses; written as ``[parallel.pp] encoder_tp``).
        macrobatches: global batches drawn from the training data for the macro-batch statistics (module
            docstring; ``DEFAULT_MACROBATCHES`` is a good count); the plan is then for the expected global
            batch. 0, or a job without ``data.train``: no statistics, upper-bound workload. Off by default
            because it processes the training set as the trainer does (about 30 ms per sample on a CPU core).
        out: text stream for the table (default stdout).
        profile_store: folder of ``plait profile``'s stored profiles (CPU plans); None: analytic costs only.
        prefer_within: a plan without a pipeline, on fewer devices, replaces the fastest plan when that one is
            predicted at most this fraction faster (:func:`prefer_simpler`; ``PREFER_WITHIN``); 0: the fastest.
            Not applied with ``dp_degrees`` or a job's own ``tp`` / ``dp_shard``.

    Returns:
        The ``LayoutChoice``.

    Raises:
        ValueError: on bad arguments (``--devices`` below 1, ``--microbatches`` above the global batch's samples, ``--dp`` out of range:
            named) or configs, or when no layout fits memory; FileNotFoundError: on a missing config file or
            model directory.
    """
    stream = out or sys.stdout
    setup = plan_setup(config_path, devices, overrides=overrides, device=device, microbatches=microbatches,
                       items_per_sample=items_per_sample, memory_fraction=memory_fraction, dp_degrees=dp_degrees,
                       dp_link_Bps=dp_link_Bps, macrobatches=macrobatches, profile_store=profile_store, stream=stream)
    setup = _with_nodes(setup, gpus_per_node, stream)
    gpus_per_node = gpus_per_node or 0
    if partial_node_note(devices, gpus_per_node):
        print(f"plait plan: {partial_node_note(devices, gpus_per_node)}", file=stream)
    cfg, inputs, spec = setup.cfg, setup.inputs, setup.spec
    if cfg.parallel.tp > 1 and inputs.tp_refusal:
        raise ValueError(f"parallel.tp = {cfg.parallel.tp}: plait's tensor parallelism refuses this model "
                         f"({inputs.tp_refusal}); set parallel.tp = 1")
    kept = job_degrees(cfg, devices, stream)
    space = dict(frozen_aware=frozen_aware, layouts=layouts, rel_tol=rel_tol, virtual_stages=virtual_stages,
                 attach_encoders=attach_encoders, in_bubble=in_bubble, schedules=check_schedules(schedules),
                 encoder_dp=encoder_dp_bounds(inputs.units, cfg.train.microbatch_size) if encoder_dp else (),
                 encoder_tp=_encoder_tp_space(cfg, inputs, stream) if encoder_tp else ())
    choice = search_plan(setup, devices, memory_fraction, dp_degrees=dp_degrees, **space, **kept)
    if gpus_per_node and devices > gpus_per_node:  # torchrun: the same count on every node
        choice = whole_node_plan(choice, devices, gpus_per_node, lambda n, layout_search: search_plan(
            setup, n, memory_fraction, layout_search, dp_degrees=dp_degrees, **space, **kept))
    why_simpler = ""
    if dp_degrees is None and not kept and prefer_within > 0:
        choice, why_simpler = prefer_simpler(setup, choice, devices, memory_fraction, prefer_within, space,
                                             gpus_per_node)
    print(f"plait plan: {config_path} on {devices} x {spec.name}, {inputs.microbatches} microbatches of "
          f"{cfg.train.microbatch_size} samples (global batch {cfg.train.global_batch_size})", file=stream)
    if why_simpler:
        print(f"plait plan: {why_simpler}", file=stream)
    print(format_plan(choice), file=stream)
    if encoder_dp and encoder_dp_note(cfg, inputs.units):
        print(f"plait plan: {encoder_dp_note(cfg, inputs.units)}", file=stream)
    if space["encoder_tp"] and not choice.encoder_tp:
        print("plait plan: encoder tensor-parallel degrees: searched (at most "
              f"{dict(space['encoder_tp'])}), none faster", file=stream)
    unweighed = not_weighed(space["schedules"], choice)
    if unweighed:
        print(f"plait plan: {unweighed}", file=stream)
    if gpus_per_node and choice.devices_used > gpus_per_node:
        nodes = choice.devices_used // gpus_per_node  # whole nodes (whole_node_plan)
        print(f"plait plan: {choice.devices_used} processes on nodes of {gpus_per_node}: {nodes} nodes; start "
              f"one torchrun per node (the command below, NODE_RANK=0..{nodes - 1}, MASTER_ADDR=node 0's address; "
              "docs/parallelism.md, Several nodes)", file=stream)
    if choice.dp_shard > 1:
        print(fsdp_line(inputs.units, inputs.costs, choice, setup.machine.shard_link), file=stream)
    print(format_lora_units(inputs.units), end="", file=stream)
    snippet, why = pp_snippet(cfg, choice, inputs.units, inputs.unit_source)
    if snippet is None:
        print(f"no [parallel.pp] snippet: {why} (no job tables, no command to run)", file=stream)
    else:
        command = run_command(config_path, overrides, cfg, choice, inputs.units, gpus_per_node)
        print(f"to run this plan, put these tables in the job file:\n{snippet}"
              f"or run it as printed (the same settings as overrides):\n  {command}", file=stream)
    if out_json is not None:
        path = Path(out_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plan_to_json(choice, snippet))
        print(f"plan written to {path}", file=stream)
    return choice


def encoder_dp_note(cfg: Any, units: Sequence[Unit]) -> str:
    """The line ``plait plan`` prints when the job itself keeps the per-encoder data-parallel degrees from being
    searched: FSDP2 (``parallel.dp_shard`` above 1) on a model with an encoder branch and more than one sample per
    microbatch (``encoder_dp_bounds``); ``""`` otherwise (the plan's replicas, if any, are printed with it)."""
    if cfg.parallel.dp_shard > 1 and encoder_dp_bounds(units, cfg.train.microbatch_size):
        return (f"encoder data-parallel degrees: not searched (FSDP2, parallel.dp_shard = {cfg.parallel.dp_shard}, "
                "refuses replicated encoder stages; set parallel.dp_shard = 1 to search them)")
    return ""


def _encoder_tp_space(cfg: Any, inputs: Any, stream: TextIO) -> tuple[tuple[str, int], ...]:
    """``SearchSpace.encoder_tp`` of ``plait plan --encoder-tp``: per encoder branch the largest power of two dividing
    its heads (``encoder_tp_bounds`` of ``inputs.model_configs``' ``EncoderArch.heads``); ``()`` with a printed reason
    when plait's TP refuses the model, the job has its own ``parallel.tp`` or FSDP2, or no branch can be split."""
    heads = {m: int(getattr(inputs.model_configs.get(m), "heads", 0) or 0)
             for m in dict.fromkeys(u.module for u in inputs.units) if m != LLM_MODULE}
    why = (f"plait's tensor parallelism refuses this model ({inputs.tp_refusal})" if inputs.tp_refusal else
           f"the job's own parallel.tp = {cfg.parallel.tp}" if cfg.parallel.tp > 1 else
           f"FSDP2, parallel.dp_shard = {cfg.parallel.dp_shard}" if cfg.parallel.dp_shard > 1 else
           "no encoder branch has an even number of heads" if not encoder_tp_bounds(heads) else "")
    if why:
        print(f"plait plan: encoder tensor-parallel degrees not searched ({why})", file=stream)
        return ()
    return encoder_tp_bounds(heads)


def job_degrees(cfg: Any, devices: int, stream: TextIO) -> dict[str, Any]:
    """``SearchSpace`` fields that keep the job's own ``parallel.tp`` / ``parallel.dp_shard`` when
    either is above 1 (the plan is then searched with exactly those degrees, not the plain plan first), printing
    that it does; ``{}`` when both are 1 (TP and sharding are searched only when memory requires them).

    Raises:
        ValueError: when ``tp x dp_shard`` does not divide ``devices`` (named; ``train.apply_plan.kept_degrees``).
    """
    kept = kept_degrees(cfg, devices, f"--devices {devices}")
    if kept:
        own = "".join([f", parallel.fsdp_reshard = {cfg.parallel.fsdp_reshard!r}" if "fsdp_reshard" in kept else "",
                       ", parallel.offload = 'cpu'" if "offload" in kept else ""])
        print(f"plait plan: the job sets parallel.tp = {cfg.parallel.tp}, parallel.dp_shard = "
              f"{cfg.parallel.dp_shard}{own}: the plan keeps them (set tp and dp_shard to 1 to let it choose)",
              file=stream)
    return kept


def prefer_simpler(setup: "PlanSetup", fastest: LayoutChoice, devices: int, memory_fraction: float,
                   within: float, space: dict[str, Any], gpus_per_node: int = 0) -> tuple[LayoutChoice, str]:
    """The plan ``plait plan`` recommends: ``fastest``, unless a plan without a pipeline (plain data parallelism
    on ``d`` of the ``devices``, ``d`` at most the microbatches per step and on whole nodes of ``gpus_per_node``,
    ``nodes.on_whole_nodes``) is predicted at most ``within`` (a fraction, ``PREFER_WITHIN``) slower; then the one
    of those using the fewest devices. Returns the plan and a sentence saying why it replaced ``fastest`` (empty
    when it did not)."""
    simpler = []
    for d in range(1, min(devices, setup.inputs.microbatches) + 1):
        if not on_whole_nodes(d, gpus_per_node):
            continue
        try:
            option = search_plan(setup, d, memory_fraction, dp_degrees=[d], **space)
        except ValueError:
            continue  # no plain plan on d devices fits
        if option.plan.num_ranks == 1 and option.iteration_s <= fastest.iteration_s * (1 + within):
            simpler.append(option)
    if not simpler or fastest.plan.num_ranks == 1 and fastest.devices_used <= min(c.devices_used for c in simpler):
        return fastest, ""
    chosen = min(simpler, key=lambda c: (c.devices_used, c.iteration_s))
    gain = chosen.iteration_s / fastest.iteration_s - 1
    faster = f"predicted only {100 * gain:.1f}% faster" if gain > 0 else "predicted no faster"
    what = (f"DP {fastest.dp} x {fastest.plan.num_ranks} pipeline ranks" if fastest.plan.num_ranks > 1
            else f"DP {fastest.dp}, no pipeline")
    return chosen, (f"recommending DP {chosen.dp} without a pipeline on {chosen.devices_used} of {devices} devices "
                    f"({1e3 * chosen.iteration_s:.2f} ms): the fastest plan, {what} on {fastest.devices_used} "
                    f"devices ({1e3 * fastest.iteration_s:.2f} ms), is {faster}, "
                    f"within the {100 * within:g}% tolerance (PREFER_WITHIN) that a simpler plan is preferred by")


@dataclass(frozen=True)
class PlanSetup:
    """What ``plan_command`` searches with: the job config (global batch split), the plan inputs (costs without
    activation checkpointing), the device, the machine (memory cap, link, DP link, FSDP2's ``shard_link``, dtype,
    overheads) and the job's checkpointing as the search space of ``search_parallel.plan_parallel``
    (``base_checkpointing``, ``checkpoint_overrides``); ``router_load``: the measured profile's per-expert routed
    tokens of each MoE layer (``Profile.router_load``; empty: uniform routing)."""

    cfg: Any
    inputs: PlanInputs
    spec: DeviceSpec
    machine: Machine
    space: SearchSpace = SearchSpace()
    router_load: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

    def checkpointed_costs(self) -> tuple[UnitCost, ...]:
        """The inputs' costs with the job's activation checkpointing charged (``recompute.checkpointed_costs``)."""
        policy = self.space.base_checkpointing
        checkpointed = plan_checkpointing(self.inputs.units, policy, self.space.checkpoint_overrides)
        return tuple(checkpointed_costs(self.inputs.costs, checkpointed))


def plan_setup(config_path: str | Path, devices: int, *, overrides: Sequence[str] = (),
               device: str | DeviceSpec | None = None, microbatches: int | None = None, items_per_sample: int = 1,
               memory_fraction: float = 0.9, dp_degrees: Sequence[int] | None = None,
               dp_link_Bps: float | None = None, macrobatches: int = 0,
               profile_store: str | Path | None = None, stream: TextIO | None = None) -> PlanSetup:
    """Read the job and derive what the search needs (``plan_command``'s arguments, same meaning and defaults;
    ``profile_store`` None: analytic costs only), printing the notes on ``stream`` (None: dropped).

    Raises:
        ValueError, FileNotFoundError: as ``plan_command``.
    """
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices must be an integer >= 1, got {devices!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    if isinstance(macrobatches, bool) or not isinstance(macrobatches, int) or macrobatches < 0:
        raise ValueError(f"macrobatches must be an integer >= 0, got {macrobatches!r}")
    stream = stream if stream is not None else io.StringIO()
    cfg, replaced = load_config_for_planning(config_path, overrides)
    if device is None or device == "cpu":
        device, why = host_device() if device is None else ("cpu", "--device cpu: this host's CPU, measured")
        if device == "cpu":  # this host's CPU, measured
            device = host_cpu(cfg.train.threads or max(1, (os.cpu_count() or 1) // devices), devices)
        print(f"plait plan: planning for {getattr(device, 'name', device)} ({why}; --device to plan for another)",
              file=stream)
    elif device == CPU_PRESET:
        device = "cpu"
    spec = device_spec(device)
    if replaced:
        print(f"plait plan: the job's {replaced} is not checked or used: the plan replaces it", file=stream)
    cfg = split_global_batch(cfg, microbatches)
    microbatches = None if microbatches is None else int(microbatches)
    _check_dp_degrees(dp_degrees, devices,
                      microbatches or max(1, cfg.train.global_batch_size // cfg.train.microbatch_size))
    expected = None
    if macrobatches and cfg.data.train:
        _, expected = _macrobatches(cfg, macrobatches, stream)
    inputs = build_plan_inputs(cfg, spec, microbatches=microbatches, items_per_sample=items_per_sample,
                               shapes_override=expected)
    profile = None
    if spec.chunk_overhead_s or spec.message_overhead_s:
        weights = sum(c.param_bytes for c in inputs.costs)
        if profile_store is None:
            profile, why = None, "no store"
        elif weights > spec.memory_bytes / 4:  # keying a profile builds the model with its weights
            profile, why = None, f"the model's {format_bytes(weights)} of parameters are not built here to key one"
        else:
            profile, why = stored_profile(cfg, profile_store)
        if profile is not None and expected is None:
            inputs = dataclasses.replace(inputs, units=profile.units, costs=profile.costs, dtype=profile.key.dtype)
        elif profile is not None:
            profile, why = None, "the plan is for the expected macro-batch, not the profiled microbatch"
        if profile is None:
            print(f"plait plan: no measured profile ({why}); `plait profile` stores one", file=stream)
    policy, overrides = checkpoint_policy(cfg)  # train.activation_checkpointing: charged by plan_parallel
    costs = runtime_costs(spec, profile, dp_link_Bps)
    if spec.chunk_overhead_s or spec.message_overhead_s:
        print(f"plait plan: costs: {costs.source}", file=stream)
    # FSDP2's all-gathers and reduce-scatters: on the DP link, else (GPU presets charge no DP all-reduce) the node's
    machine = Machine(memory_cap=memory_fraction * spec.memory_bytes, p2p=costs.p2p, dp_link=costs.dp_link,
                      shard_link=costs.dp_link or costs.p2p, dtype=inputs.dtype, overheads=costs.overheads)
    if inputs.tp_refusal:  # the runtime's tensor parallelism refuses the model: no TP degree above 1 is offered
        print(f"plait plan: tensor parallelism not searched: {inputs.tp_refusal}", file=stream)
    space = SearchSpace(base_checkpointing=policy, checkpoint_overrides=overrides,
                        tp_degrees=(1,) if inputs.tp_refusal else None)
    return PlanSetup(cfg, inputs, spec, machine, space, dict(profile.router_load) if profile is not None else {})


def not_weighed(requested: Sequence[str], choice: LayoutChoice) -> str:
    """Which of the ``requested`` schedules (``--schedules``) the search did not time for ``choice`` and why, as one
    sentence; ``""`` when it timed all of them. The zero-bubble schedules run plans of one stage per rank (``zb_v``:
    that plan's LLM cut into a V, which needs 2 or more LLM ranks and 2 LLM units per rank)."""
    timed = {name for name, _, _ in choice.schedules_weighed} or {choice.schedule}
    missing = [name for name in requested if name not in timed]
    if not missing:
        return ""
    why = {"zb_v": "zb_v (a V needs the best plan of one stage per rank to have 2 or more LLM ranks, and the LLM 2 "
                   "units per rank)"}
    named = [why.get(name, f"{name} (it runs plans of one stage per rank; the best such plan was not timed)")
             for name in missing]
    return "not weighed: " + "; ".join(named)


def _with_nodes(setup: PlanSetup, gpus_per_node: int | None, stream: TextIO) -> PlanSetup:
    """``setup`` planning for nodes of ``gpus_per_node`` GPUs (``--gpus-per-node``; None: one node, unchanged): NVLink
    inside a node, one 400 Gb/s InfiniBand port per GPU between nodes (``node_presets.nvlink_infiniband``), each
    collective charged by where its group sits under the rank order chosen with the plan (``Machine.topology``).

    Raises:
        ValueError: on a count below 1, or nodes with ``--device cpu`` (its link is this host's, measured).
    """
    if gpus_per_node is None:
        return setup
    if gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node must be >= 1 (the GPUs of one node; leave it out to plan one node), got "
                         f"{gpus_per_node}")
    if setup.spec.name.lower().startswith("cpu"):
        raise ValueError("--gpus-per-node plans nodes of GPUs (NVLink inside, InfiniBand between): use it with a GPU "
                         "--device preset (h100, h200, a100)")
    print(f"plait plan: nodes of {gpus_per_node} GPUs: NVLink inside a node, 400 Gb/s InfiniBand per GPU between "
          "nodes; each collective charged by where its group sits", file=stream)
    return dataclasses.replace(setup, machine=dataclasses.replace(setup.machine,
                                                                  topology=nvlink_infiniband(gpus_per_node)))


def split_global_batch(cfg: Any, microbatches: int | None) -> Any:
    """``cfg`` with its global batch split into ``microbatches`` microbatches (``plait plan --microbatches``).

    ``--microbatches N`` plans the job's own global batch (``train.global_batch_size`` = ``G`` samples per step)
    cut into ``N`` microbatches of ``ceil(G / N)`` samples, as ``parallel.pp.microbatches`` cuts it at run time;
    it never adds samples. The returned copy has ``train.microbatch_size = ceil(G / N)``; None returns ``cfg``
    (``G / train.microbatch_size`` microbatches).

    Raises:
        ValueError: naming ``--microbatches`` when ``N`` is not an integer in ``1..G`` (a microbatch needs at least
            one sample).
    """
    if microbatches is None:
        return cfg
    train = cfg.train
    if isinstance(microbatches, bool) or int(microbatches) != microbatches or not \
            1 <= microbatches <= train.global_batch_size:
        raise ValueError(
            f"--microbatches {microbatches}: must be in 1..{train.global_batch_size}, the samples of the job's global "
            f"batch (train.global_batch_size {train.global_batch_size}, train.microbatch_size "
            f"{train.microbatch_size}: {max(1, train.global_batch_size // train.microbatch_size)} microbatches); "
            "the planner splits that global batch, it does not add samples: raise train.global_batch_size "
            "(--train.global_batch_size=...) to plan a larger one")
    out = copy.deepcopy(cfg)
    out.train.microbatch_size = -(-train.global_batch_size // int(microbatches))
    return out


def _check_dp_degrees(dp_degrees: Sequence[int] | None, devices: int, microbatches: int) -> None:
    """``plan_command``'s DP degrees (``plait plan --dp``) against the devices and microbatches.

    Raises:
        ValueError: naming ``--dp`` for a degree outside ``1..min(devices, microbatches)``.
    """
    top = min(devices, microbatches)
    for d in dp_degrees or ():
        if isinstance(d, bool) or int(d) != d or not 1 <= d <= top:
            raise ValueError(f"--dp {d}: the data-parallel degree must be in 1..{top} (at most --devices {devices} "
                             f"and the {microbatches} microbatches per step: each replica needs a microbatch)")
