"""``plait plan`` on a mixture-of-experts job: the demo job with a Qwen3-MoE LLM (64 experts, 97% of the parameters)
picks expert parallelism when only it fits the device (the EP options are searched with as few microbatches as the
job has; TP leaves the routed experts, their bytes and their time, whole on every rank, as the runtime does), prints ``ep = N`` and
``--parallel.ep=N``, and the printed tables load; the no-fit message names EP when the least option uses it."""

from __future__ import annotations

import dataclasses
import io
import shlex
import tomllib

import pytest

from plait.commands.plan.command import plan_command, plan_setup
from plait.config.loader import load_config
from plait.planner.cost.experts import ExpertDispatch, expert_layers
from plait.planner.cost.sharding import rank_memory, shard_costs
from plait.planner.cost.types import DeviceSpec, ParallelDegrees
from plait.planner.pipeline.graph import consistent_units
from plait.planner.search.fit import least_need
from plait.planner.search.types import LeastNeed, NoPlanFits
from plait.train.plan_search import explain_no_fit, search_plan
from tests.helpers.moe import DEMO, OVERRIDES, TIGHT



def test_moe_job_gets_expert_parallelism_and_the_tables_load(tmp_path):
    out = io.StringIO()
    choice = plan_command(DEMO, 8, tmp_path / "plan.json", device=TIGHT, out=out, profile_store=None,
                          overrides=OVERRIDES)
    text = out.getvalue()
    assert choice.ep > 1 and choice.fits_memory and choice.offload != "cpu"
    assert choice.tp == 1 and "tensor parallelism not searched: model.llm:" in text  # Qwen3-MoE: TP refused
    assert choice.dp % choice.ep == 0 and max(choice.stage_memory_bytes) <= choice.memory_cap
    snippet = text[text.index("to run this plan, put these tables in the job file:\n"):].split("\n", 1)[1]
    snippet = snippet[:snippet.index("or run it as printed")]
    table = tomllib.loads(snippet)["parallel"]
    assert f"\nep = {choice.ep}\n" in snippet and table["ep"] == choice.ep
    command = next(line for line in text.splitlines() if "torchrun" in line)
    assert f"--parallel.ep={choice.ep}" in command
    # the printed tables in the job file, with the MoE LLM and batch overrides
    job = tmp_path / "job.toml"
    body = DEMO.read_text()
    if choice.checkpointing != "none":
        body = body.replace("[train]\n", f"[train]\nactivation_checkpointing = \"{choice.checkpointing}\"\n")
    job.write_text(body + "\n" + snippet)
    cfg = load_config(job, OVERRIDES)
    assert (cfg.parallel.ep, cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.tp) == (
        choice.ep, table["dp"], choice.dp_shard, 1)
    assert cfg.model.llm.config["num_experts"] == 64
    # the printed command's overrides load the same settings
    args = shlex.split(command)
    printed = load_config(args[args.index("--config") + 1], args[args.index("--config") + 2:])
    assert (printed.parallel.ep, printed.parallel.dp, printed.parallel.pp.degree) == (
        choice.ep, table["dp"], table.get("pp", {}).get("degree", 1))
    assert printed.train.activation_checkpointing == choice.checkpointing


def test_without_expert_parallelism_nothing_fits_on_the_device():
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=TIGHT)
    try:
        choice = search_plan(setup, 8, 0.9, ep_degrees=(1,))
    except ValueError as exc:  # nothing at all fits
        assert "no plan fits" in str(exc)
        return
    assert choice.offload == "cpu"  # only with the optimizer state on the host


def test_tp_leaves_the_routed_experts_whole():
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=TIGHT)
    units, costs = consistent_units(setup.inputs.units), setup.inputs.costs
    layer = next(i for i, c in enumerate(costs) if c.expert_param_bytes)  # the first MoE layer
    experts = costs[layer].expert_param_bytes
    assert experts > 0.9 * costs[layer].param_bytes
    one = rank_memory([units[layer]], [costs[layer]]).parameters
    tp4 = rank_memory([units[layer]], [costs[layer]], ParallelDegrees(tp=4)).parameters
    ep4 = rank_memory([units[layer]], [costs[layer]], ParallelDegrees(ep=4)).parameters
    assert tp4 == pytest.approx(experts + (one - experts) / 4, abs=4)
    assert ep4 == pytest.approx(experts / 4 + (one - experts), abs=4)
    # time: each pass's routed part (the layer's routed_s at ep 1) whole on every TP rank, the rest divided
    inputs = setup.inputs
    moe = expert_layers(inputs.units, inputs.model_configs, inputs.shapes["llm"], setup.spec, inputs.dtype)
    routed = next(m for m in moe if m.unit == units[layer].name).routed_s(1)
    whole = costs[layer]
    assert 0 < routed < whole.forward_s
    split = shard_costs([units[layer]], [whole], ParallelDegrees(tp=4), experts=ExpertDispatch(moe))[0]
    for name in ("forward_s", "input_grad_s", "weight_grad_s"):
        assert getattr(split, name) == pytest.approx(routed + (getattr(whole, name) - routed) / 4), name
    assert shard_costs([units[layer]], [whole], ParallelDegrees(tp=4))[0].forward_s == pytest.approx(
        whole.forward_s / 4)  # without the MoE layers: all of it divided


def test_least_need_under_ep_counts_the_stages_ep_leaves():
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=TIGHT)
    units, costs = consistent_units(setup.inputs.units), setup.inputs.costs
    ep8 = ParallelDegrees(ep=8, checkpointing="full")
    need, degrees = least_need(units, costs, 8, [ep8])
    whole = rank_memory(units, costs, ep8).total  # dp 8 for ep 8: one pipeline rank holds every unit
    assert degrees == ep8 and need == pytest.approx(whole)


def test_no_fit_message_names_ep():
    error = NoPlanFits("nothing fits", LeastNeed(60 * 2**20, ParallelDegrees(dp_shard=8, ep=8,
                                                                             checkpointing="full")))
    text = explain_no_fit(error, 8, 27 * 2**20, "a cap", "more devices", max_ep=8)
    assert "(tp 1, dp_shard 8, ep 8, activation checkpointing full;" in text
    assert "ep up to 8" in text
    plain = explain_no_fit(NoPlanFits("x", LeastNeed(1.0, ParallelDegrees())), 8, 2.0, "a cap", "more devices")
    assert "ep " not in plain


def test_no_fit_on_the_moe_job_names_the_ep_degrees_its_microbatches_allow():
    tiny = dataclasses.replace(DeviceSpec.h100(), memory_bytes=0.03 * 2**30)  # 27.6 MiB: below any plan's need
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=tiny)
    with pytest.raises(ValueError, match=r"no plan fits in 27.6 MiB per device .* the least any option searched "
                                         r"needs is about [0-9.]+ MiB .*ep up to 2 and CPU offload were searched"):
        search_plan(setup, 8, 0.9)  # 2 microbatches: EP 2 at most (one per DP rank)


def test_the_printed_command_replaces_the_jobs_own_ep():
    """A job file with ``parallel.ep = 2`` whose plan chose ep 1 on roomy devices: the command sets ep back to 1."""
    out = io.StringIO()
    choice = plan_command(DEMO, 2, None, device="h100", out=out, profile_store=None,
                          overrides=[*OVERRIDES, "--parallel.ep=2", "--parallel.dp=2"])
    command = next(line for line in out.getvalue().splitlines() if "torchrun" in line or "plait train" in line)
    args = shlex.split(command)
    printed = load_config(args[args.index("--config") + 1], args[args.index("--config") + 2:])
    assert choice.ep == 1 and printed.parallel.ep == 1 and "--parallel.ep=1" in command


def test_a_bad_model_field_stops_the_plan_before_anything_is_planned():
    """The job's model table is checked as the trainer checks it (built on the meta device) before the search: an
    unknown field of the MoE LLM's config is the error, and no plan is printed ahead of it."""
    bad = OVERRIDES[0].replace("num_experts = 64", "num_experts = 64, num_expert = 8")
    out = io.StringIO()
    with pytest.raises(ValueError, match=r"model\.llm\.config: qwen3_moe config has no field\(s\) \['num_expert'\]"):
        plan_command(DEMO, 8, None, device=TIGHT, out=out, profile_store=None, overrides=[bad, *OVERRIDES[1:]])
    assert "iteration" not in out.getvalue() and "stage rank" not in out.getvalue()


def test_tp_is_not_offered_for_a_family_whose_tp_plan_the_runtime_refuses(tmp_path):
    """Qwen3-MoE's shipped plan gives its q/k norms a style plait's TP does not apply (the runtime refuses it at
    launch): the plan inputs say so, the search offers no TP degree above 1, and a job's own ``parallel.tp = 2`` is
    refused before planning. A Llama LLM (the demo's) keeps TP in the search."""
    from plait.models.hf import TP_STYLES
    from plait.parallel.tensor_parallel import STYLES

    assert STYLES == TP_STYLES  # the runtime's rule is the planner's
    out = io.StringIO()
    setup = plan_setup(DEMO, 8, overrides=OVERRIDES, device=TIGHT, stream=out)
    assert "self_attn.q_norm has tensor-parallel style 'replicated_with_grad_allreduce'" in setup.inputs.tp_refusal
    assert setup.space.tp_degrees == (1,) and "tensor parallelism not searched: model.llm:" in out.getvalue()
    with pytest.raises(ValueError, match=r"parallel.tp = 2: plait's tensor parallelism refuses this model"):
        plan_command(DEMO, 8, None, device=TIGHT, out=io.StringIO(), profile_store=None,
                     overrides=[*OVERRIDES, "--parallel.tp=2"])
    dense = plan_setup(DEMO, 8, device=TIGHT)
    assert dense.inputs.tp_refusal == "" and dense.space.tp_degrees is None
