"""The ready-to-paste job tables of a plan (``plait plan``): :func:`pp_snippet`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.models.plan_inputs import MODEL_UNITS
from plait.planner.report import pp_toml
from plait.planner.search.types import LayoutChoice
from plait.planner.types import Unit
from plait.train.apply_plan import apply_layout_choice

__all__ = ["pp_snippet"]


def pp_snippet(cfg: Any, choice: LayoutChoice, units: Sequence[Unit],
               unit_source: str = MODEL_UNITS) -> tuple[str | None, str]:
    """A ready-to-paste ``[parallel.pp]`` TOML table that makes the job run ``choice``, or None and why not.

    The table is ``plait.train.apply_plan.apply_layout_choice``'s ``parallel.pp`` (degree, layout, stages per module,
    schedule, microbatches per replica, and ``splits`` for the modules whose cost-balanced boundaries are not
    the even split by unit count, ``virtual_stages`` and ``attach_encoders`` when the plan interleaves),
    written as TOML, under a comment line giving the rest of ``apply_layout_choice``'s config: ``parallel.dp``
    (to set in the job's ``[parallel]`` table when the plan has several replicas; the table describes one
    pipeline replica, ``microbatches`` per replica) and ``parallel.plan = "manual"``. There is one only for
    stage placement that ``[parallel.pp]`` can express (``apply_layout_choice`` accepts it; a one-rank plan is
    ``degree = 1``, no pipeline parallelism) and units named as the model names them (``unit_source`` is
    ``MODEL_UNITS``, see ``plait.models.plan_inputs.job_units``). A plan with TP, FSDP2 sharding or activation checkpointing gets a
    ``[parallel]`` table too (``plan``, ``dp``: replicas, ``dp_shard``, ``tp``, ``offload`` when the plan offloads
    FSDP2's shards to the host, ``fsdp_reduce`` when it reduce-scatters every microbatch) and a comment naming
    ``train.activation_checkpointing`` (``report.pp_toml``).

    Args:
        cfg: the ``JobConfig`` the plan is for; choice: the plan; units: the units it was searched over.
        unit_source: ``PlanInputs.unit_source``.

    Returns:
        ``(toml_text, "")`` or ``(None, reason)``.
    """
    if unit_source != MODEL_UNITS:
        return None, f"the unit names are not the model's: {unit_source}"
    try:
        pp = apply_layout_choice(cfg, choice, units).parallel.pp
    except ValueError as exc:
        return None, f"[parallel.pp] cannot express this plan: {exc}"
    fields: dict[str, Any] = {"degree": pp.degree}
    if pp.degree > 1:
        fields.update(layout=pp.layout, stages=pp.stages, schedule=pp.schedule, microbatches=pp.microbatches)
        if pp.virtual_stages != 1:
            fields["virtual_stages"] = pp.virtual_stages
        if pp.attach_encoders:
            fields["attach_encoders"] = True
        if pp.splits:
            fields["splits"] = pp.splits
    degrees = None
    if choice.tp > 1 or choice.dp_shard > 1 or choice.checkpointing != "none":  # the [parallel] table too
        out = apply_layout_choice(cfg, choice, units)
        degrees = dict(dp=out.parallel.dp, dp_shard=out.parallel.dp_shard, tp=out.parallel.tp,
                       activation_checkpointing=out.train.activation_checkpointing, offload=out.parallel.offload,
                       fsdp_reduce=out.parallel.fsdp_reduce, fsdp_reshard=out.parallel.fsdp_reshard)
    return pp_toml(fields, choice.dp, degrees), ""


