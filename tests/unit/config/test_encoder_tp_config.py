"""``parallel.pp.encoder_tp``: an encoder branch's own tensor-parallel degree inside each pipeline parses from TOML and
overrides, counts each TP rank of a stage as a pipeline rank, builds the plan's tensor-parallel stages (a TP group on
ranks of its own, the leader's features into the LLM), every unsupported combination is refused with the field
named, and a degree the tower's heads cannot take is refused before any process group is made."""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict, load_config, pipeline_plan_kwargs, pipeline_stage_counts, validate
from plait.config.schema import PipelineConfig
from plait.parallel.process_group import DistInfo
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from plait.planner.pipeline.types import Stage
from plait.train.build import check_tp_degree
from plait.train.pipeline_run import describe_stages
from plait.train.pipeline_trainer import PipelineTrainer
from tests.helpers.jobs import ROOT, tiny_config_dict

ENCODERS = ["vision", "audio"]
UNITS = synthetic_units({"vision": [True] * 3, "audio": [False] * 2}, [True] * 4)


def _config(parallel: dict):
    return config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel))


def test_override_sets_encoder_tp_and_ranks_count_tp_ranks():
    cfg = load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.pp.degree=5", "--parallel.pp.stages={}",
                                                           "--parallel.pp.encoder_tp={vision = 2}"])
    pp = cfg.parallel.pp
    assert pp.encoder_tp == {"vision": 2}
    # vision's TP group takes ranks 0 and 1, audio rank 2, the LLM ranks 3 and 4
    assert pipeline_stage_counts(pp, ENCODERS) == {"vision": 1, "audio": 1, "llm": 2}
    kwargs = pipeline_plan_kwargs(pp, ENCODERS)
    assert kwargs["ranks"] == [0, 1, 2, 3, 4] and kwargs["tensor_parallel"] == {"vision": 2}
    assert kwargs["replicas"] == {}
    plan = plan_pipeline(UNITS, pp.layout, **kwargs)
    assert [(s.modules[0], s.rank, s.replica, s.replicas, s.tensor_parallel) for s in plan.stages] == [
        ("vision", 0, 0, 2, True), ("vision", 1, 1, 2, True), ("audio", 2, 0, 1, False), ("llm", 3, 0, 1, False),
        ("llm", 4, 0, 1, False)]
    assert plan.edges == ((0, 3), (1, 3), (2, 3), (3, 4))  # every TP rank feeds the first LLM stage (the leader's
    assert plan.stages[1].tp_follower and not plan.stages[0].tp_follower  # features; the follower's are empty)
    assert [s.row_share for s in plan.stages[:3]] == [1, 1, 1]
    assert "vision (3 units, rank 1, TP rank 2 of 2)" in describe_stages(plan)
    assert plan_pipeline(UNITS, **{**kwargs, "layout": pp.layout}).to_json() == plan.to_json()
    assert type(plan).from_json(plan.to_json()) == plan


def test_a_tensor_parallel_chain_sends_copy_k_to_copy_k():
    plan = plan_pipeline(UNITS, stages_per_module={"vision": 2}, tensor_parallel={"vision": 2},
                         ranks=[0, 1, 0, 1, 2, 3])
    assert plan.edges == ((0, 2), (1, 3), (2, 5), (3, 5), (4, 5))
    assert plan.tensor_parallel and plan.replicated


def test_encoder_tp_one_is_the_plain_plan():
    validate(_config({"pp": {"degree": 3, "encoder_tp": {"vision": 1}}}))
    pp = PipelineConfig(degree=3, encoder_tp={"vision": 1})
    plan = plan_pipeline(UNITS, pp.layout, **pipeline_plan_kwargs(pp, ENCODERS))
    assert not plan.replicated and not plan.tensor_parallel and plan.num_ranks == 3


def test_plan_and_stage_refuse_tp_with_replicas_or_alone():
    with pytest.raises(ValueError, match=r"module\(s\) \['vision'\]: an encoder branch has either data-parallel "
                                         r"replicas or a tensor-parallel group"):
        plan_pipeline(UNITS, replicas={"vision": 2}, tensor_parallel={"vision": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel\['llm'\]: only encoder modules"):
        plan_pipeline(UNITS, tensor_parallel={"llm": 2})
    with pytest.raises(ValueError, match="tensor_parallel needs a group of replicas >= 2 copies"):
        Stage(0, ("vision",), ("vision.0",), 0, True, False, tensor_parallel=True)


@pytest.mark.parametrize("parallel, match", [
    ({"pp": {"degree": 4, "encoder_tp": {"vison": 2}}},
     r"parallel.pp.encoder_tp names unknown encoder branch\(es\) \['vison'\]"),
    ({"pp": {"degree": 4, "encoder_tp": {"vision": 0}}}, r"parallel.pp.encoder_tp.vision must be an integer >= 1"),
    ({"pp": {"degree": 4, "encoder_tp": {"llm": 2}}}, r"parallel.pp.encoder_tp.llm: the LLM's tensor-parallel degree"),
    ({"pp": {"degree": 3, "encoder_tp": {"vision": 2}}}, r"encoder_tp copies included\), leaving none for the LLM"),
    ({"pp": {"degree": 5, "stages": {"llm": 1}, "encoder_tp": {"vision": 2}}},
     r"parallel.pp.encoder_tp = \{'vision': 2\} copies included: \{'vision': 2, 'audio': 1, 'llm': 1\}\) but "
     r"parallel.pp.degree is 5"),
    ({"pp": {"degree": 1, "encoder_tp": {"vision": 2}}}, r"parallel.pp.encoder_tp = \{'vision': 2\} splits encoder "
     r"stages of a pipeline: it needs parallel.pp.degree > 1"),
    ({"pp": {"degree": 4, "layout": "encoders_colocated", "encoder_tp": {"vision": 2}}},
     r"parallel.pp.encoder_tp = \{'vision': 2\} needs parallel.pp.layout = 'encoder_parallel'"),
    ({"pp": {"degree": 2, "attach_encoders": True, "schedule": "interleaved_1f1b", "encoder_tp": {"vision": 2}}},
     r"encoder_tp .* does not combine with parallel.pp.attach_encoders = true"),
    ({"pp": {"degree": 2, "encoders_in_bubble": True, "encoder_tp": {"vision": 2}}},
     r"encoder_tp .* does not combine with parallel.pp.encoders_in_bubble = true"),
    ({"pp": {"degree": 5, "stages": {"llm": 4}, "virtual_stages": 2, "schedule": "interleaved_1f1b",
             "encoder_tp": {"vision": 2}}}, r"encoder_tp .* one LLM stage per rank, got parallel.pp.virtual_stages"),
    ({"tp": 2, "pp": {"degree": 4, "encoder_tp": {"vision": 2}}},
     r"encoder_tp .* does not combine with the job's own tensor parallelism \(parallel.tp = 2\)"),
    ({"dp_shard": 2, "pp": {"degree": 4, "encoder_tp": {"vision": 2}}}, r"encoder_tp .* does not combine with FSDP2"),
    ({"pp": {"degree": 6, "encoder_tp": {"vision": 2}, "encoder_dp": {"vision": 2}}},
     r"branch\(es\) \['vision'\] also have parallel.pp.encoder_dp above 1"),
])
def test_bad_encoder_tp_is_refused_naming_the_field(parallel, match):
    with pytest.raises(ValueError, match=match):
        validate(_config(parallel))


def test_a_degree_the_heads_cannot_take_is_refused_before_groups():
    """The tiny SigLIP tower has 2 heads: encoder_tp 4 is refused naming the field, on one process before any
    group is made (PipelineTrainer.build); encoder_tp 2 passes the check."""
    cfg = _config({"pp": {"degree": 6, "encoder_tp": {"vision": 4}}})
    with pytest.raises(ValueError, match=r"parallel.pp.encoder_tp.vision=4 does not divide the 2 heads of "
                                         r"encoders.vision.encoder.* cannot work for this model") as err:
        check_tp_degree(cfg, encoders_only=True)
    assert err.value.same_on_every_rank  # under torchrun one rank prints it (cli.first_to_report), not every rank
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"parallel.pp.encoder_tp.vision=4 does not divide"):
        PipelineTrainer.build(cfg, one)
    check_tp_degree(_config({"pp": {"degree": 4, "encoder_tp": {"vision": 2}}}), encoders_only=True)


def test_plait_launch_refuses_encoder_tp():
    from plait.commands.launch import check_launch

    data = tiny_config_dict("train.jsonl", None, "runs/x", train={"steps": 4},
                            parallel={"pp": {"degree": 4, "encoder_tp": {"vision": 2}}})
    with pytest.raises(ValueError, match=r"^parallel.pp.encoder_tp = \{'vision': 2\}: plait launch plans its own "
                                         r"pipelines, with no tensor-parallel encoder stages"):
        check_launch(config_from_dict(data), 4)
