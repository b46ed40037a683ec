"""The plans ``plait plan`` weighs, side by side: the best runnable plan of each family for a job
(:func:`considered_plans`, searched with ``plait plan``'s costs: ``plait.commands.plan.command.plan_setup``) and a short
name for each (:func:`plan_label`); ``bench/plan_holds.py`` runs them to check the recommendation holds.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from plait.commands.plan.command import plan_setup
from plait.train.plan_search import search_plan
from plait.commands.plan.snippet import pp_snippet
from plait.planner.cost.types import DeviceSpec
from plait.planner.pipeline.types import LAYOUTS
from plait.planner.search.encoder_dp import encoder_dp_bounds
from plait.planner.search.types import LayoutChoice, SearchSpace
from plait.planner.search.layout import plan_layout
from plait.planner.types import Unit

__all__ = ["considered_plans", "plan_label"]


def considered_plans(config_path: str | Path, devices: int, *, overrides: Sequence[str] = (),
                     device: str | DeviceSpec | None = None, profile_store: str | Path | None = "runs/profiles",
                     ) -> tuple[LayoutChoice, list[tuple[str, LayoutChoice, tuple[Unit, ...]]]]:
    """``plait plan``'s recommendation for ``devices`` devices and the best plan of each family it weighs, each
    runnable as a job (``[parallel.pp]`` expresses it) and distinct (DP degree, stages and ranks, schedule),
    searched with the same costs as ``plan_command`` (default arguments otherwise): plain data parallelism (the
    largest DP degree, no pipeline), 1F1B with one stage per rank in each layout, interleaved 1F1B (2 LLM stages
    per rank) and the encoders attached to the first LLM rank; for comparing plans with measurements
    (``bench/plan_holds.py``).

    Returns:
        ``(recommended, [(label, choice, units)])``: the recommendation (``plan_command``'s search with its default
        options, on the same measured costs as the others: a host plan measures the CPU once) and the families in
        that order (a family whose best plan is already listed, or that has none for ``devices``, is left out; the
        recommendation is listed first when no family gave it).

    Raises:
        ValueError, FileNotFoundError: as ``plan_command`` (no fitting plan: its one-sentence message).
    """
    setup = plan_setup(config_path, devices, overrides=overrides, device=device, profile_store=profile_store,
                       stream=io.StringIO())
    inputs = setup.inputs
    recommended = search_plan(setup, devices, 0.9, virtual_stages=(1, 2, 4), attach_encoders=True, in_bubble=True,
                              encoder_dp=encoder_dp_bounds(inputs.units, setup.cfg.train.microbatch_size))
    costs = setup.checkpointed_costs()  # the job's activation checkpointing, as the families run it
    dp_top = max(d for d in range(1, min(devices, inputs.microbatches) + 1) if devices % d == 0)
    families = [dict(dp_degrees=[dp_top])] + [dict(layouts=[layout]) for layout in LAYOUTS]
    families += [dict(virtual_stages=(2,)), dict(virtual_stages=(1, 2), attach_encoders=True),
                 dict(in_bubble=True)]
    out: list[tuple[str, LayoutChoice, tuple[Unit, ...]]] = []
    seen = set()
    for options in families:
        options = {"dp_degrees": [1], **options}
        try:
            choice = plan_layout(inputs.units, costs, devices, microbatches=inputs.microbatches,
                                 machine=setup.machine, space=SearchSpace(**options))
        except ValueError:
            continue
        key = _key(choice)
        if key in seen or (choice.plan.num_ranks == 1 and choice.dp != dp_top) or \
                pp_snippet(setup.cfg, choice, inputs.units, inputs.unit_source)[0] is None:
            continue  # seen, a one-rank plan on fewer devices than plain DP (not searched), or not runnable
        seen.add(key)
        out.append((plan_label(choice), choice, inputs.units))
    if _key(recommended) not in seen:
        out.insert(0, (plan_label(recommended), recommended, inputs.units))
    return recommended, out


def _key(choice: LayoutChoice) -> tuple:
    """What makes two plans the same job: DP degree, schedule, stages (units, ranks), TP, FSDP2, checkpointing and
    offload."""
    return (choice.dp, choice.schedule, tuple((s.units, s.rank) for s in choice.plan.stages), choice.tp,
            choice.dp_shard, choice.fsdp_reshard, choice.checkpointing, choice.offload)


def plan_label(choice: LayoutChoice) -> str:
    """A short name of a plan: ``"DP 2, no pipeline"``, ``"DP 1 x 1F1B, encoders_colocated, 2 stages"`` (the layout
    only for a model with several encoders), ``"DP 1 x interleaved 1F1B (v = 2), encoders attached, 5 stages"``,
    then its TP degree, FSDP2 shard degree, checkpointing and offload when it has them (``"DP 2, no pipeline, FSDP2
    over 2"``)."""
    plan = choice.plan
    degrees = ([f"TP {choice.tp}"] if choice.tp > 1 else []) + (
        [f"FSDP2 over {choice.dp_shard}"] if choice.dp_shard > 1 else []) + (
        [f"{choice.checkpointing} checkpointing"] if choice.checkpointing != "none" else []) + (
        ["CPU offload"] if choice.offload == "cpu" else [])
    if plan.num_ranks == 1:
        return ", ".join([f"DP {choice.dp}, no pipeline", *degrees])
    attached = any(s.rank == plan.stages[plan.llm_stages[0]].rank for s in plan.stages if not s.is_llm)
    kind = f"interleaved 1F1B (v = {plan.virtual_stages})" if plan.virtual_stages > 1 else "1F1B"
    where = "encoders attached" if attached else (choice.layout if len(plan.modules) > 2 else "")
    return ", ".join(x for x in (f"DP {choice.dp} x {kind}", where, f"{plan.num_stages} stages", *degrees) if x)
