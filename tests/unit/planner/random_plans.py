"""Random pipeline plans and schedules for the property tests of the schedule generators (test_schedules.py) and
the simulator (test_simulator.py): one drawing of a plan, one dispatch to a generator."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import PipelinePlan
from plait.planner.pipeline.schedule_ir import Schedule
from plait.planner.pipeline.schedules import gpipe, memory_capped_1f1b, one_f_one_b


def draw_plan(draw: Any, slack: int, shared_ranks: bool = False) -> tuple[PipelinePlan, str, list[int], int]:
    """A random plan of 1-3 encoder branches (1-3 stages each; colocated branches share one count) and a 1-4 stage
    LLM over synthetic units (each stage one to ``1 + slack`` units, trainable or frozen at random); with
    ``shared_ranks`` some stages share a rank. Returns ``(plan, layout, stages per encoder, LLM stages)``."""
    layout = draw(st.sampled_from(["encoder_parallel", "encoders_colocated"]))
    n_enc = draw(st.integers(1, 3))
    stages = [draw(st.integers(1, 3)) for _ in range(n_enc)]
    if layout == "encoders_colocated":
        stages = [stages[0]] * n_enc
    encoders = {f"e{k}": draw(st.lists(st.booleans(), min_size=s, max_size=s + slack)) for k, s in enumerate(stages)}
    s_llm = draw(st.integers(1, 4))
    llm = draw(st.lists(st.booleans(), min_size=s_llm, max_size=s_llm + slack))
    counts = {f"e{k}": s for k, s in enumerate(stages)} | {"llm": s_llm}
    ranks = None
    if shared_ranks:
        n_stages = (sum(stages) if layout == "encoder_parallel" else stages[0]) + s_llm
        n_ranks = draw(st.integers(1, n_stages))
        extra = n_stages - n_ranks
        ranks = list(range(n_ranks)) + draw(st.lists(st.integers(0, n_ranks - 1), min_size=extra, max_size=extra))
        ranks = draw(st.permutations(ranks))
    return plan_pipeline(synthetic_units(encoders, llm), layout, stages_per_module=counts, ranks=ranks), layout, \
        stages, s_llm


def draw_encoders(draw: Any) -> tuple[str, dict[str, list[bool]], dict[str, int], int]:
    """0-2 random encoder branches of 1-2 stages (colocated branches share one count), each stage one or two
    synthetic units, trainable or frozen at random. Returns ``(layout, units per encoder, stages per encoder,
    encoder stages of the plan)``."""
    layout = draw(st.sampled_from(["encoder_parallel", "encoders_colocated"]))
    n_enc = draw(st.integers(0, 2))
    stages = [draw(st.integers(1, 2)) for _ in range(n_enc)]
    if layout == "encoders_colocated":
        stages = [stages[0]] * n_enc if n_enc else []
    encoders = {f"e{k}": draw(st.lists(st.booleans(), min_size=s, max_size=s + 1)) for k, s in enumerate(stages)}
    counts = {f"e{k}": s for k, s in enumerate(stages)}
    return layout, encoders, counts, sum(stages) if layout == "encoder_parallel" else (stages[0] if stages else 0)


def generate(kind: str, plan: PipelinePlan, m: int, split: bool, defer: bool, cap: int | None) -> Schedule:
    """The ``kind`` (``gpipe``, ``1f1b``, ``capped`` with ``cap``) schedule of ``plan`` for ``m`` microbatches."""
    if kind == "gpipe":
        return gpipe(plan, m, split_backward=split, defer_weight_grad=defer)
    if kind == "1f1b":
        return one_f_one_b(plan, m, split_backward=split, defer_weight_grad=defer)
    return memory_capped_1f1b(plan, m, cap, split_backward=split, defer_weight_grad=defer)
