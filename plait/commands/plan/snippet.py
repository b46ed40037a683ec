"""What runs a plan (``plait plan``): the ready-to-paste job tables (:func:`pp_snippet`) and the command line
(:func:`run_command`, with the plan as overrides: :func:`plan_overrides`)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.models.plan_inputs import MODEL_UNITS
from plait.planner.report import pp_toml
from plait.planner.toml_text import toml_value
from plait.planner.search.types import LayoutChoice
from plait.planner.types import Unit
from plait.train.apply_plan import apply_layout_choice

__all__ = ["plan_overrides", "pp_snippet", "run_command"]


def pp_snippet(cfg: Any, choice: LayoutChoice, units: Sequence[Unit],
               unit_source: str = MODEL_UNITS) -> tuple[str | None, str]:
    """The ready-to-paste job tables that make the job run ``choice`` (``report.pp_toml``), or None and why not.

    A ``[parallel]`` table (``plan = "manual"``, ``dp``: replicas, ``dp_shard``, ``tp``, ``cp``; ``offload``,
    ``fsdp_reduce``, ``fsdp_reshard``, ``rank_order``, ``ep`` when not their defaults) and, only when the plan has a pipeline,
    the
    ``[parallel.pp]`` table (degree, layout, stages per module, schedule, microbatches per replica, ``splits``
    for the modules whose cost-balanced boundaries are not the even split by unit count, ``virtual_stages`` and
    ``attach_encoders`` when the plan interleaves, ``encoder_dp`` when it replicates encoder stages):
    ``plait.train.apply_plan.apply_layout_choice``'s config,
    under a comment giving the processes and ``train.activation_checkpointing`` when the plan checkpoints. There
    are tables only for stage placement that ``[parallel.pp]`` can express (``apply_layout_choice`` accepts it)
    and units named as the model names them (``unit_source`` is ``MODEL_UNITS``, see
    ``plait.models.plan_inputs.job_units``).

    Args:
        cfg: the ``JobConfig`` the plan is for; choice: the plan; units: the units it was searched over.
        unit_source: ``PlanInputs.unit_source``.

    Returns:
        ``(toml_text, "")`` or ``(None, reason)``.
    """
    if unit_source != MODEL_UNITS:
        return None, f"the unit names are not the model's: {unit_source}"
    try:
        fields = _pp_fields(cfg, choice, units)
    except ValueError as exc:
        return None, f"[parallel.pp] cannot express this plan: {exc}"
    return pp_toml(fields, choice.dp, _degrees(cfg, choice, units)), ""


def _pp_fields(cfg: Any, choice: LayoutChoice, units: Sequence[Unit]) -> dict[str, Any]:
    """The ``[parallel.pp]`` keys of the job running ``choice`` (``degree`` only without a pipeline).

    Raises:
        ValueError: when ``[parallel.pp]`` cannot express the plan (``apply_layout_choice``).
    """
    pp = apply_layout_choice(cfg, choice, units).parallel.pp
    fields: dict[str, Any] = {"degree": pp.degree}
    if pp.degree > 1:
        fields.update(layout=pp.layout, stages=pp.stages, schedule=pp.schedule, microbatches=pp.microbatches)
        if pp.virtual_stages != 1:
            fields["virtual_stages"] = pp.virtual_stages
        if pp.encoders_in_bubble:
            fields["encoders_in_bubble"] = True
        if pp.attach_encoders:
            fields["attach_encoders"] = True
            if pp.layout == "encoder_parallel":  # never paired with attached encoders (report.pp_toml)
                del fields["layout"]
        if pp.splits:
            fields["splits"] = pp.splits
        if choice.encoder_dp:  # replicated encoder stages (the job's [parallel.pp] encoder_dp)
            fields["encoder_dp"] = dict(pp.encoder_dp)
        if choice.encoder_tp:  # tensor-parallel encoder stages (the job's [parallel.pp] encoder_tp)
            fields["encoder_tp"] = dict(pp.encoder_tp)
    return fields


def _degrees(cfg: Any, choice: LayoutChoice, units: Sequence[Unit]) -> dict[str, Any]:
    """The ``[parallel]`` keys (and ``train.activation_checkpointing``) of the job running ``choice``; the planner
    does not split sequences: ``cp`` 1."""
    out = apply_layout_choice(cfg, choice, units)
    checkpointing = out.train.activation_checkpointing if choice.checkpointing != "none" else "none"
    return dict(dp=out.parallel.dp, dp_shard=out.parallel.dp_shard, tp=out.parallel.tp, cp=1,
                activation_checkpointing=checkpointing, offload=out.parallel.offload,
                fsdp_reduce=out.parallel.fsdp_reduce, fsdp_reshard=out.parallel.fsdp_reshard,
                rank_order=out.parallel.rank_order, ep=choice.ep)


def plan_overrides(cfg: Any, choice: LayoutChoice, units: Sequence[Unit]) -> list[str]:
    """``choice`` as ``--section.key=value`` overrides of the job (the keys of :func:`pp_snippet`'s tables:
    ``parallel.plan``, ``dp``, ``dp_shard``, ``tp``, ``cp``, the non-default FSDP2 keys, ``parallel.pp.*``, and
    ``train.activation_checkpointing`` when the plan checkpoints), values written as TOML.

    Raises:
        ValueError: when ``[parallel.pp]`` cannot express the plan (``apply_layout_choice``).
    """
    degrees = _degrees(cfg, choice, units)
    keys: dict[str, Any] = {"parallel.plan": "manual"}
    keys.update({f"parallel.{k}": degrees[k] for k in ("dp", "dp_shard", "tp", "cp")})
    if degrees["offload"] != "none":
        keys["parallel.offload"] = degrees["offload"]
    if degrees["fsdp_reduce"] != "step":
        keys["parallel.fsdp_reduce"] = degrees["fsdp_reduce"]
    if degrees["fsdp_reshard"] not in ("auto", "after_forward"):
        keys["parallel.fsdp_reshard"] = degrees["fsdp_reshard"]
    if degrees["rank_order"] not in ("auto", "dp_outer"):
        keys["parallel.rank_order"] = degrees["rank_order"]
    if degrees["ep"] > 1 or cfg.parallel.ep != degrees["ep"]:  # the job file's own ep replaced by the plan's
        keys["parallel.ep"] = degrees["ep"]
    keys.update({f"parallel.pp.{k}": v for k, v in _pp_fields(cfg, choice, units).items()})
    if degrees["activation_checkpointing"] != "none":
        keys["train.activation_checkpointing"] = degrees["activation_checkpointing"]
    return [f"--{k}={_override_value(v)}" for k, v in keys.items()]


def _override_value(value: Any) -> str:
    """An override's value as ``plait.config.loader.parse_overrides`` reads it back: a plain word bare (read as a
    string), anything else as TOML."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) and \
            value not in ("true", "false", "inf", "nan"):
        return value
    return toml_value(value)


def run_command(config_path: str | Path, overrides: Sequence[str], cfg: Any, choice: LayoutChoice,
                units: Sequence[Unit], gpus_per_node: int = 0) -> str:
    """The shell command that trains the job with ``choice`` as printed: ``plait train --config JOB ...`` for one
    process, else ``torchrun --nproc_per_node N -m plait.cli train --config JOB ...`` (``N = choice.devices_used``,
    one node), with the planning ``overrides`` and then :func:`plan_overrides`, each argument shell-quoted. With
    more processes than ``gpus_per_node`` (> 0) it is the command of one node of ``N / gpus_per_node`` (torchrun's
    ``--nnodes``, ``--nproc_per_node gpus_per_node``), its node rank and node 0's address left to the shell
    variables ``$NODE_RANK`` and ``$MASTER_ADDR`` (docs/parallelism.md, Several nodes).

    Raises:
        ValueError: as :func:`plan_overrides`, or when the processes do not fill whole nodes (torchrun starts the
            same count on every node).
    """
    processes = choice.devices_used
    tail = ["plait.cli", "train", "--config", str(config_path), *overrides, *plan_overrides(cfg, choice, units)]
    if processes == 1:
        return " ".join(shlex.quote(a) for a in ["plait", *tail[1:]])
    if gpus_per_node <= 0 or processes <= gpus_per_node:
        return " ".join(shlex.quote(a) for a in ["torchrun", "--nproc_per_node", str(processes), "-m", *tail])
    if processes % gpus_per_node:
        raise ValueError(f"{processes} processes do not fill nodes of {gpus_per_node} GPUs: torchrun starts the same "
                         "number on every node")
    head = (f"torchrun --nnodes {processes // gpus_per_node} --nproc_per_node {gpus_per_node} --node_rank $NODE_RANK "
            "--master_addr $MASTER_ADDR --master_port 29500 -m ")
    return head + " ".join(shlex.quote(a) for a in tail)


