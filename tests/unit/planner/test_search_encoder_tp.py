"""Per-encoder tensor-parallel degrees in the search (``search.encoder_dp`` with ``SearchSpace.encoder_tp``): a frozen
encoder whose one heavy layer no pipeline cut can split, with one sample per microbatch (no replica can take a share
of the rows) and an LLM that fills the other ranks, gets a TP group when that is faster; the chosen plan's time is
``evaluate_plan``'s (the simulator's) and the search's own; the written tables rebuild the plan; the bounds come from
the heads."""

from __future__ import annotations

import tomllib

import pytest

from plait.config.loader import pipeline_plan_kwargs
from plait.config.schema import PipelineConfig
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import P2PModel
from plait.planner.report import format_plan, pp_toml
from plait.planner.search.auto_layout import layout_pp_fields
from plait.planner.search.encoder_dp import copy_vectors, encoder_dp_bounds, encoder_tp_bounds
from plait.planner.search.layout import evaluate_plan, plan_layout
from plait.planner.search.parallel import plan_parallel
from plait.planner.search.types import Machine, SearchSpace
from plait.planner.types import UnitCost

GB = 10**9
LINK = P2PModel(latency_s=1e-5, bandwidth_Bps=5e9)
MICROBATCHES = 8
DEVICES = 5


def _job():
    """A frozen vision tower whose one layer takes 4 s per microbatch (a single unit: no pipeline cut splits it) and
    three trainable 0.5 s LLM layers of 4 GB each, one per rank under a 40 GB cap (parameters, gradients and AdamW
    state): on 5 devices one rank is left for the tower, or two for a TP group of 2."""
    units = synthetic_units({"vision": [False, False, True]}, [True] * 3)
    embed = UnitCost(0.05, 0.0, 0.0, param_bytes=10**6, activation_bytes=10**6, output_bytes=10**6)
    tower = UnitCost(4.0, 0.0, 0.0, param_bytes=2 * GB, activation_bytes=GB, output_bytes=10**6)
    projector = UnitCost(0.01, 0.01, 0.01, param_bytes=10**6, activation_bytes=10**6, output_bytes=10**6)
    layer = UnitCost(0.5, 0.5, 0.5, param_bytes=4 * GB, activation_bytes=10**8, output_bytes=10**6)
    return units, [embed, tower, projector, layer, layer, layer]


MACHINE = Machine(memory_cap=40 * GB, p2p=LINK, dp_link=LINK)


def test_a_heavy_frozen_encoder_gets_a_tp_group_when_rows_cannot_be_split():
    units, costs = _job()
    assert encoder_dp_bounds(units, 1) == ()  # microbatch_size 1: no replica can take a share of a microbatch
    space = SearchSpace(encoder_tp=(("vision", 4),))
    homogeneous = plan_layout(units, costs, DEVICES, microbatches=MICROBATCHES, machine=MACHINE)
    chosen = plan_layout(units, costs, DEVICES, microbatches=MICROBATCHES, machine=MACHINE, space=space)
    assert homogeneous.encoder_tp == () and chosen.encoder_tp == (("vision", 2),) and chosen.encoder_dp == ()
    assert [(s.modules[0], s.rank, s.replica, s.tensor_parallel) for s in chosen.plan.stages] == [
        ("vision", 0, 0, True), ("vision", 1, 1, True), ("llm", 2, 0, False), ("llm", 3, 0, False),
        ("llm", 4, 0, False)]
    # the tower's rank was the bottleneck (8 x 4.06 s); a TP group of 2 halves its layer (plus two all-reduces)
    assert homogeneous.iteration_s == pytest.approx(36.68147, rel=1e-6)
    assert chosen.iteration_s == pytest.approx(21.03478, rel=1e-6)
    again = evaluate_plan(chosen.plan, units, costs, dp=chosen.dp, microbatches=MICROBATCHES, devices=DEVICES,
                          machine=MACHINE)
    assert again.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12) and again.fits_memory
    assert chosen.planned_iteration_s == pytest.approx(chosen.iteration_s, rel=1e-9)  # the search's model agrees
    # the complete search (global TP, FSDP2, checkpointing, every divisor) takes it too
    complete = plan_parallel(units, costs, DEVICES, microbatches=MICROBATCHES, machine=MACHINE, space=space)
    assert complete.encoder_tp == (("vision", 2),) and complete.tp == 1
    assert complete.iteration_s == pytest.approx(chosen.iteration_s, rel=1e-12)
    assert "encoder tensor-parallel degrees (each stage's TP group): vision 2" in format_plan(chosen)
    assert type(chosen).from_json(chosen.to_json()) == chosen  # the plan file plait simulate reads back


def test_written_tables_rebuild_the_tp_plan():
    """``layout_pp_fields`` (what ``parallel.plan = "auto"`` and ``plait plan`` write) and its TOML table give back the
    chosen plan as the trainer builds it (``pipeline_plan_kwargs``)."""
    units, costs = _job()
    choice = plan_layout(units, costs, DEVICES, microbatches=MICROBATCHES, machine=MACHINE,
                         space=SearchSpace(encoder_tp=(("vision", 4),)))
    fields = layout_pp_fields(choice, units)
    assert fields["encoder_tp"] == {"vision": 2} and "encoder_dp" not in fields
    assert fields["stages"] == {"vision": 1, "llm": 3} and fields["degree"] == DEVICES
    table = tomllib.loads(pp_toml(fields, choice.dp))["parallel"]["pp"]
    assert table["encoder_tp"] == {"vision": 2}
    pp = PipelineConfig(**{k: v for k, v in table.items()})
    rebuilt = plan_pipeline(units, pp.layout, **pipeline_plan_kwargs(pp, ["vision"]))
    assert rebuilt.stages == choice.plan.stages


def test_tp_bounds_from_heads_and_the_vectors_searched():
    assert encoder_tp_bounds({"vision": 16, "audio": 20, "odd": 25, "unknown": 0}) == (("vision", 16), ("audio", 4))
    vectors = copy_vectors(["vision", "audio"], {"vision": 2}, {"vision": 4, "audio": 2}, 8)
    assert ({"vision": 2, "audio": 1}, frozenset()) in vectors  # replicas
    assert ({"vision": 4, "audio": 2}, frozenset({"vision", "audio"})) in vectors  # both TP
    assert ({"vision": 2, "audio": 2}, frozenset({"audio"})) in vectors  # vision replicas, audio TP
    assert len(vectors) == 4 * 2 - 1  # vision: 1, dp 2, tp 2, tp 4; audio: 1, tp 2; not all ones
    assert copy_vectors(["vision"], {}, {"vision": 8}, 3) == [({"vision": 2}, frozenset({"vision"}))]


def test_a_slow_tp_link_keeps_the_plain_plan():
    """When the TP all-reduces cost more than the split saves, the search keeps every degree 1."""
    units, costs = _job()
    slow = Machine(memory_cap=40 * GB, p2p=LINK, dp_link=LINK, tp_link=P2PModel(latency_s=1.0))
    plain = plan_layout(units, costs, DEVICES, microbatches=MICROBATCHES, machine=slow)
    chosen = plan_layout(units, costs, DEVICES, microbatches=MICROBATCHES, machine=slow,
                         space=SearchSpace(encoder_tp=(("vision", 4),)))
    assert chosen.encoder_tp == () and chosen.iteration_s == plain.iteration_s
