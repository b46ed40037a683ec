"""``parallel.plan = "auto"`` with interleaved 1F1B and attached encoders: a choice written into ``[parallel.pp]``
rebuilds exactly the chosen plan in the trainer (``build_pipeline_plan``), the DP all-reduce over ``dp_link`` is
charged (a slow link turns plain DP into an interleaved pipeline; a DP degree above the microbatch count pays it
too), and the choice is the best of every runnable plan on 2 processes (brute force, each timed by the simulator)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from transformers import AutoTokenizer

from plait.config.loader import config_from_dict, validate
from plait.models.registry import build_model
from plait.models.units import model_units
from plait.planner.search.auto_layout import plan_auto_layout
from plait.planner.pipeline.plan import plan_pipeline, stage_ranks
from plait.planner.search.layout import evaluate_plan
from plait.planner.pipeline.types import P2PModel
from plait.planner.types import UnitCost
from plait.train.apply_plan import apply_layout_choice, resolve_auto_plan
from plait.train.pipeline_run import build_pipeline_plan
from plait.planner.search.types import Machine
from plait.planner.search.auto_layout import AUTO_MACHINE, AUTO_SPACE
from tests.helpers.jobs import DEMO, tiny_config_dict

SLOW_LINK = P2PModel(latency_s=0.0, bandwidth_Bps=1e5)  # 1 MB of gradients takes 10 s
LLM_BYTES = 10**6
LLM = ["language_model.model.embed_tokens", "language_model.model.layers.0", "language_model.model.layers.1",
       "language_model.model.norm", "language_model.lm_head"]


def _job(**parallel) -> dict:
    job = tiny_config_dict("train.jsonl", train={"global_batch_size": 8, "microbatch_size": 2})  # 4 microbatches
    job["parallel"] = parallel
    for enc in job["model"]["encoders"].values():
        enc["freeze"] = True  # frozen encoders, trainable projectors and LLM
    return job


@pytest.fixture(scope="module")
def model():
    cfg = config_from_dict(_job())
    return build_model(cfg.model, AutoTokenizer.from_pretrained(str(DEMO / "tokenizer")), device="meta")


def _costs(units) -> list[UnitCost]:
    """Cheap encoder units; LLM units of 1 s forward, dX and dW each (the norm 0.05 s), 1 MB of parameters."""
    out = []
    for u in units:
        if u.module != "llm":
            out.append(UnitCost(0.01, 0.01, 0.01, 1000, 100, 10))
        else:
            f = 0.05 if u.kind == "norm" else 1.0
            out.append(UnitCost(f, f, f, LLM_BYTES, 100, 10))
    return out


def _work(units, costs) -> float:
    """Seconds of one microbatch on one rank: forward, and dX / dW where the unit needs them."""
    return sum(c.forward_s + c.backward_s(u) for u, c in zip(units, costs))


def _same_plan(built, plan) -> bool:
    return built.replace(num_microbatches=plan.num_microbatches) == plan


# ----- choice -> [parallel.pp] -> the trainer's plan ---------------------------------------------------------------
# (layout, stages per module or splits, encoder stages, LLM ranks, virtual stages, attached)
ROUND_TRIPS = [
    ("encoder_parallel", {"stages_per_module": {"llm": 4}}, 2, 2, 2, True),
    ("encoder_parallel", {"splits": {"llm": LLM[1:4]}}, 2, 2, 2, True),  # uneven: the head alone
    ("encoders_colocated", {"stages_per_module": {"llm": 4}}, 1, 2, 2, False),
    ("encoder_parallel", {"stages_per_module": {"llm": 4}}, 2, 2, 2, False),
    ("encoder_parallel", {"stages_per_module": {"llm": 2}}, 2, 2, 1, True),  # attached, 1F1B on the LLM ranks
    ("encoder_parallel", {"splits": {"llm": LLM[2:3]}}, 2, 2, 1, False),  # one stage per rank, uneven
]


@pytest.mark.parametrize("layout, cuts, enc, p, v, attached", ROUND_TRIPS)
def test_a_written_choice_rebuilds_its_plan_in_the_trainer(model, layout, cuts, enc, p, v, attached):
    units = model_units(model)
    plan = plan_pipeline(units, layout, ranks=stage_ranks(enc, p, v, attached), **cuts)
    schedule = "interleaved_1f1b" if v > 1 or attached else "1f1b"
    choice = evaluate_plan(plan, units, _costs(units), dp=1, microbatches=4, schedule=schedule,
                           machine=Machine(dtype="float32"))
    cfg = apply_layout_choice(config_from_dict(_job(plan="auto")), choice, units)
    validate(cfg)
    pp = cfg.parallel.pp
    assert (cfg.parallel.plan, cfg.parallel.dp, pp.degree, pp.layout) == ("manual", 1, enc * (not attached) + p, layout)
    assert (pp.virtual_stages, pp.attach_encoders, pp.schedule, pp.microbatches) == (v, attached, schedule, 4)
    assert pp.stages["llm"] == v * p and pp.splits == cuts.get("splits", {})
    assert _same_plan(build_pipeline_plan(model, pp), choice.plan)


def test_plans_the_config_cannot_express_are_refused(model):
    units = model_units(model)
    costs = _costs(units)
    crossed = plan_pipeline(units, "encoders_colocated", stages_per_module={"llm": 4}, ranks=[0, 1, 2, 2, 1])
    choice = evaluate_plan(crossed, units, costs, dp=1, microbatches=4, schedule="gpipe",
                           machine=Machine(dtype="float32"))
    with pytest.raises(ValueError, match="LayoutChoice.schedule is 'gpipe'"):
        apply_layout_choice(config_from_dict(_job(plan="auto")), choice, units)
    cyclic = plan_pipeline(units, "encoders_colocated", stages_per_module={"llm": 4}, ranks=[0, 1, 2, 1, 2])
    choice = evaluate_plan(cyclic, units, costs, dp=1, microbatches=4, schedule="interleaved_1f1b",
                           machine=Machine(dtype="float32"))
    apply_layout_choice(config_from_dict(_job(plan="auto")), choice, units)  # expressible
    choice = dataclasses.replace(choice, plan=crossed.replace(num_microbatches=4))  # LLM stages not cyclic
    with pytest.raises(ValueError, match=r"cannot express the chosen plan: stage 3 would be .* the plan has"):
        apply_layout_choice(config_from_dict(_job(plan="auto")), choice, units)


# ----- the automatic choice ---------------------------------------------------------------------------------------
def _runnable_on_two(units):
    """Every plan the trainer runs on 2 processes with 1 replica: (plan, schedule). Encoders colocated on rank 0
    and the LLM on rank 1; or the encoders (either layout) on LLM rank 0 with the LLM in 2 stages (1F1B) or 4
    (interleaved), cut anywhere."""
    plans = [(plan_pipeline(units, "encoders_colocated"), "1f1b")]
    for stages, layout in itertools.product((2, 4), ("encoder_parallel", "encoders_colocated")):
        enc = 2 if layout == "encoder_parallel" else 1
        for cut in itertools.combinations(LLM[1:], stages - 1):
            plan = plan_pipeline(units, layout, splits={"llm": list(cut)},
                                 ranks=stage_ranks(enc, 2, stages // 2, attach_encoders=True))
            plans.append((plan, "interleaved_1f1b"))
    return plans


def test_a_slow_dp_link_makes_the_interleaved_pipeline_the_best_runnable_plan(model):
    units = model_units(model)
    costs = _costs(units)
    work = _work(units, costs)
    trainable = sum(c.param_bytes for u, c in zip(units, costs) if u.trainable)

    fast = plan_auto_layout(units, costs, 2, 4)  # all-reduce not charged: plain DP, 2 microbatches per replica
    assert (fast.dp, fast.plan.num_ranks) == (2, 1) and fast.iteration_s == pytest.approx(2 * work, rel=1e-9)

    choice = plan_auto_layout(units, costs, 2, 4, machine=dataclasses.replace(AUTO_MACHINE, dp_link=SLOW_LINK))
    dp_time = 2 * work + trainable / SLOW_LINK.bandwidth_Bps  # ring all-reduce over 2: 2 (d - 1) / d x bytes
    times = {}  # best time per LLM stages per rank (1 or 2) over the runnable 2-rank plans
    for plan, schedule in _runnable_on_two(units):
        t = evaluate_plan(plan, units, costs, dp=1, microbatches=4, schedule=schedule,
                          machine=Machine(dp_link=SLOW_LINK, dtype="float32")).iteration_s
        times[plan.virtual_stages] = min(t, times.get(plan.virtual_stages, t))
    assert times[2] < min(times[1], dp_time)  # interleaving beats 1F1B and plain DP here
    assert choice.iteration_s == pytest.approx(times[2], rel=1e-9)
    assert (choice.dp, choice.schedule, choice.plan.virtual_stages, choice.plan.num_ranks) == \
        (1, "interleaved_1f1b", 2, 2)


def test_resolve_auto_plan_writes_an_interleaved_job_the_trainer_accepts(model):
    units = model_units(model)
    cfg = config_from_dict(_job(plan="auto"))
    resolved, choice = resolve_auto_plan(cfg, 2, units, _costs(units), machine=dataclasses.replace(AUTO_MACHINE,
                                                                                                   dp_link=SLOW_LINK))
    assert cfg.parallel.plan == "auto" and resolved.parallel.plan == "manual"  # the input is unchanged
    validate(resolved)
    pp = resolved.parallel.pp
    assert (resolved.parallel.dp, pp.degree, pp.virtual_stages, pp.attach_encoders, pp.schedule) == \
        (1, 2, 2, True, "interleaved_1f1b")
    assert pp.stages == {"vision": 1, "audio": 1, "llm": 4} and pp.microbatches == 4
    plan = build_pipeline_plan(model, pp)
    assert _same_plan(plan, choice.plan)
    assert [plan.stages[s].rank for s in plan.llm_stages] == [0, 1, 0, 1]


def test_more_replicas_than_microbatches_pay_the_all_reduce(model):
    """4 processes, 2 microbatches: with free links and a 1 ms P2P latency, 4 replicas (two of them idle) win at
    exactly one microbatch's work; a slow DP link makes their all-reduce (ring over 4: 1.5 x the bytes) too dear.
    Without TP and FSDP2 (TP, weighed whether or not the plain plan fits, splits the 1 s layers and is faster)."""
    units = model_units(model)
    costs = _costs(units)
    p2p = P2PModel(latency_s=1e-3)
    plain = dataclasses.replace(AUTO_SPACE, tp_degrees=(1,), dp_shard_degrees=(1,))
    free = plan_auto_layout(units, costs, 4, 2, machine=dataclasses.replace(AUTO_MACHINE, p2p=p2p), space=plain)
    assert (free.dp, free.plan.num_ranks) == (4, 1) and free.iteration_s == pytest.approx(_work(units, costs))
    complete = plan_auto_layout(units, costs, 4, 2, machine=dataclasses.replace(AUTO_MACHINE, p2p=p2p))
    assert complete.tp > 1 and complete.iteration_s < free.iteration_s
    slow = plan_auto_layout(units, costs, 4, 2, machine=dataclasses.replace(AUTO_MACHINE, p2p=p2p, dp_link=SLOW_LINK),
                            space=plain)
    trainable = sum(c.param_bytes for u, c in zip(units, costs) if u.trainable)
    assert slow.dp < 4 and slow.iteration_s < _work(units, costs) + 1.5 * trainable / SLOW_LINK.bandwidth_Bps
    assert slow.dp * slow.plan.num_ranks == 4
