"""FSDP2 without pipeline stages over several microbatches per rank (``parallel.fsdp_reduce``): ``"step"`` keeps
every trainable unit's unsharded gradient until the last microbatch (``sharding.accumulated_grad_bytes``),
``"microbatch"`` one unit's at a time for a reduction per microbatch; ``search_parallel.flat_reduce`` keeps the
faster fitting of the two, and the emitted ``[parallel]`` table names it. Hand-worked values."""

from __future__ import annotations

import dataclasses

import pytest

from plait.planner.cost.types import GradAccumulation, OptimizerSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.report import degrees_line, pp_toml
from plait.planner.search.layout import plan_layout
from plait.planner.search.parallel import flat_reduce, plan_parallel
from plait.planner.cost.sharding import accumulated_grad_bytes, rank_memory, shard_buffer_bytes, unsharded_grad_bytes
from plait.planner.pipeline.types import P2PModel
from plait.planner.search.types import Machine, SearchSpace
from tests.helpers.sharding import toy_costs, vit_llm, toy_units

OPT = OptimizerSpec(grad_bytes_per_param=4, state_bytes_per_param=8)


def test_step_reduction_over_several_microbatches_holds_every_unsharded_gradient():
    units, costs = toy_units(), toy_costs()
    two = ParallelDegrees(dp_shard=2)
    # trainable: projector 200, LLM embed 200, LLM layer 800, head 200 (fp32, 4-byte gradients): 1400 in all
    assert accumulated_grad_bytes(units, costs, two, "float32", OPT) == 1400 - 800
    assert unsharded_grad_bytes(units, costs, two, "float32", OPT) == 1400
    assert unsharded_grad_bytes(units, costs, ParallelDegrees(tp=2), "float32", OPT) == 400 + 3 * 200
    assert shard_buffer_bytes(units, costs, two, "float32", OPT) == 1000 + 800  # layer + neighbour, one gradient
    assert shard_buffer_bytes(units, costs, two, "float32", OPT, accumulate=True) == 1000 + 1400
    assert accumulated_grad_bytes(units, costs, ParallelDegrees(), "float32", OPT) == 0.0
    memory = {(m, r): rank_memory(units, costs, two, dtype="float32", optimizer=OPT,
                                  accumulation=GradAccumulation(m, r))
              for m in (1, 3) for r in ("step", "microbatch")}
    assert memory[1, "step"].buffer == memory[1, "microbatch"].buffer == memory[3, "microbatch"].buffer == 1800
    assert memory[3, "step"].buffer == 2400
    assert memory[3, "step"].gradients == memory[1, "step"].gradients == 1400 / 2  # the shards stay resident
    with pytest.raises(ValueError, match="fsdp_reduce must be one of"):
        rank_memory(units, costs, two, accumulation=GradAccumulation(fsdp_reduce="layer"))
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        rank_memory(units, costs, two, accumulation=GradAccumulation(microbatches=0))
    tp = ParallelDegrees(tp=2, dp_shard=2)  # TP halves the layer: 400 of its gradient on each TP rank
    assert accumulated_grad_bytes(units, costs, tp, "float32", OPT) == (400 + 3 * 200) - 400


def _fake_run(need: float, grad_sync_s: float):
    base = dataclasses.replace(plan_layout(toy_units(), toy_costs(), 1, microbatches=4), grad_sync_s=grad_sync_s)

    def run(cap):
        return dataclasses.replace(base, fits_memory=cap is None or need <= cap)
    return base, run


def test_flat_reduce_keeps_the_faster_fitting_reduction():
    base, run = _fake_run(need=700, grad_sync_s=0.5)
    roomy = flat_reduce(run, 2000.0, 4, 600.0)  # step fits under 2000 - 600: no extra time
    assert (roomy.fsdp_reduce, roomy.shard_buffer_bytes, roomy.iteration_s) == ("step", 600.0, base.iteration_s)
    tight = flat_reduce(run, 1000.0, 4, 600.0)  # 1000 - 600 < 700: a reduce-scatter after each of 4 microbatches
    assert tight.fsdp_reduce == "microbatch" and tight.fits_memory and tight.shard_buffer_bytes == 0.0
    assert tight.iteration_s == pytest.approx(base.iteration_s + 3 * 0.5)
    assert tight.planned_iteration_s == pytest.approx(base.planned_iteration_s + 3 * 0.5)
    one = flat_reduce(run, 1000.0, 1, 600.0)  # one microbatch per rank: the two are the same
    assert (one.fsdp_reduce, one.shard_buffer_bytes) == ("step", 0.0)
    assert flat_reduce(run, None, 4, 600.0).fsdp_reduce == "step"


def test_plan_parallel_reduces_every_microbatch_only_when_accumulating_does_not_fit():
    units, costs = vit_llm()
    link = P2PModel(latency_s=1e-5, bandwidth_Bps=100e9)
    whole = sum(plan_layout(units, costs, 1, microbatches=8).stage_memory_bytes)
    machine = Machine(p2p=link, dp_link=link)
    space = SearchSpace(tp_degrees=[1], dp_shard_degrees=[2], checkpointing=["none"], prefer_plain=False,
                        dp_degrees=[2])
    common = dict(microbatches=8)
    extra = accumulated_grad_bytes(consistent_units(units), costs, ParallelDegrees(dp_shard=2))
    base = shard_buffer_bytes(consistent_units(units), costs, ParallelDegrees(dp_shard=2))
    roomy = plan_parallel(units, costs, 2, machine=dataclasses.replace(machine, memory_cap=0.7 * whole), space=space,
                          **common)
    assert (roomy.fsdp_reduce, roomy.dp_shard, roomy.plan.num_ranks, roomy.dp) == ("step", 2, 1, 2)
    assert roomy.shard_buffer_bytes == pytest.approx(base + extra)  # 4 microbatches per rank accumulate
    assert max(roomy.stage_memory_bytes) + roomy.shard_buffer_bytes <= 0.7 * whole
    tight = plan_parallel(units, costs, 2, machine=dataclasses.replace(machine, memory_cap=0.6 * whole), space=space,
                          **common)
    assert (tight.fsdp_reduce, tight.plan.num_ranks, tight.dp) == ("microbatch", 1, 2)
    assert tight.shard_buffer_bytes == pytest.approx(base)
    assert max(tight.stage_memory_bytes) + base <= 0.6 * whole < max(tight.stage_memory_bytes) + base + extra
    assert tight.iteration_s == pytest.approx(roomy.iteration_s + 3 * roomy.grad_sync_s)  # 3 more reductions


def test_emitted_parallel_table_names_the_reduction_only_when_not_step():
    fields = {"degree": 1}
    degrees = dict(dp=1, dp_shard=2, tp=1, activation_checkpointing="none", offload="none")
    assert "fsdp_reduce" not in pp_toml(fields, 2, degrees | {"fsdp_reduce": "step"})
    assert "fsdp_reduce" not in pp_toml(fields, 2, degrees)
    text = pp_toml(fields, 2, degrees | {"fsdp_reduce": "microbatch"})
    assert text.endswith('tp = 1\ncp = 1\nfsdp_reduce = "microbatch"\n')  # no pipeline: no [parallel.pp]


def test_auto_plan_config_follows_the_chosen_reduction():
    from plait.config.loader import config_from_dict, validate
    from plait.train.apply_plan import apply_layout_choice
    from tests.helpers.jobs import tiny_config_dict

    cfg = config_from_dict(tiny_config_dict("train.jsonl"))
    choice = plan_layout(toy_units(), toy_costs(), 2, microbatches=4, machine=Machine(dp_shard=2),
                         space=SearchSpace(dp_degrees=[2]))
    assert choice.plan.num_ranks == 1 and choice.fsdp_reduce == "step"
    each = apply_layout_choice(cfg, dataclasses.replace(choice, fsdp_reduce="microbatch"), toy_units())
    validate(each)
    assert (each.parallel.fsdp_reduce, each.parallel.dp_shard, each.parallel.pp.degree) == ("microbatch", 2, 1)
    assert apply_layout_choice(cfg, choice, toy_units()).parallel.fsdp_reduce == "step"
    line = degrees_line(dataclasses.replace(choice, fsdp_reduce="microbatch"))
    assert line.startswith("memory: FSDP2 over 2 of the 2 data-parallel ranks + ")
    assert choice.shard_buffer_bytes < 2**20  # a few KB: MiB, not "0.00 GiB" (report.format_bytes)
    assert line.endswith(" + 0.0 MiB unsharded buffer, gradients reduce-scattered every microbatch")
    assert "every microbatch" not in degrees_line(choice)
