"""``parallel.pp.encoder_dp``: an encoder branch's own data-parallel degree inside each pipeline parses from TOML and
overrides, counts each replica as a pipeline rank, builds the plan's replicated stages (own ranks or in the
bubbles), and every invalid combination is refused with the field named."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, load_config, pipeline_plan_kwargs, pipeline_stage_counts, validate
from plait.config.schema import PipelineConfig
from plait.planner.pipeline.plan import plan_pipeline, synthetic_units
from tests.helpers.jobs import ROOT, tiny_config_dict

ENCODERS = ["vision", "audio"]
UNITS = synthetic_units({"vision": [True] * 3, "audio": [False] * 2}, [True] * 4)


def _validate(parallel: dict) -> None:
    validate(config_from_dict(tiny_config_dict("train.jsonl", parallel=parallel)))


def test_override_sets_encoder_dp_and_ranks_count_replicas():
    cfg = load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.pp.degree=4", "--parallel.pp.stages={}",
                                                           "--parallel.pp.encoder_dp={vision = 2}"])
    pp = cfg.parallel.pp
    assert pp.encoder_dp == {"vision": 2}
    # vision x2 and audio take 3 ranks, the LLM the 4th
    assert pipeline_stage_counts(pp, ENCODERS) == {"vision": 1, "audio": 1, "llm": 1}
    kwargs = pipeline_plan_kwargs(pp, ENCODERS)
    assert kwargs["ranks"] == [0, 1, 2, 3] and kwargs["replicas"] == {"vision": 2}
    plan = plan_pipeline(UNITS, pp.layout, **kwargs)
    assert [(s.modules[0], s.rank, s.replica, s.replicas) for s in plan.stages] == [
        ("vision", 0, 0, 2), ("vision", 1, 1, 2), ("audio", 2, 0, 1), ("llm", 3, 0, 1)]


def test_encoder_dp_in_the_bubbles_of_the_llm_ranks():
    pp = PipelineConfig(degree=2, encoders_in_bubble=True, encoder_dp={"vision": 2})
    assert pipeline_stage_counts(pp, ENCODERS) == {"vision": 1, "audio": 1, "llm": 2}
    plan = plan_pipeline(UNITS, pp.layout, **pipeline_plan_kwargs(pp, ENCODERS))
    assert [(s.modules[0], s.rank, s.replica) for s in plan.stages] == [
        ("vision", 1, 0), ("vision", 0, 1), ("audio", 1, 0), ("llm", 0, 0), ("llm", 1, 0)]
    assert plan.edges == ((0, 3), (1, 3), (2, 3), (3, 4))


def test_encoder_dp_one_is_the_plain_plan():
    pp = PipelineConfig(degree=3, encoder_dp={"vision": 1})
    _validate({"pp": {"degree": 3, "encoder_dp": {"vision": 1}}})
    plan = plan_pipeline(UNITS, pp.layout, **pipeline_plan_kwargs(pp, ENCODERS))
    assert not plan.replicated and plan.num_ranks == 3


@pytest.mark.parametrize("parallel, match", [
    ({"pp": {"degree": 4, "encoder_dp": {"vison": 2}}},
     r"parallel.pp.encoder_dp names unknown encoder branch\(es\) \['vison'\]"),
    ({"pp": {"degree": 4, "encoder_dp": {"vision": 0}}}, r"parallel.pp.encoder_dp.vision must be an integer >= 1"),
    ({"pp": {"degree": 4, "encoder_dp": {"llm": 2}}}, r"parallel.pp.encoder_dp.llm: the LLM's data-parallel degree"),
    ({"pp": {"degree": 3, "encoder_dp": {"vision": 2}}}, r"encoder_dp / encoder_tp copies included\), leaving none for the LLM"),
    ({"pp": {"degree": 5, "stages": {"llm": 1}, "encoder_dp": {"vision": 2}}},
     r"parallel.pp.stages give 4 stages \(\{'vision': 1, 'audio': 1, 'llm': 1\}, layout encoder_parallel; "
     r"parallel.pp.encoder_dp = \{'vision': 2\} copies included: \{'vision': 2, 'audio': 1, 'llm': 1\}\) but "
     r"parallel.pp.degree is 5"),
    ({"pp": {"degree": 5, "encoder_dp": {"vision": 3}}},
     r"parallel.pp.encoder_dp.vision = 3 is larger than train.microbatch_size = 2"),
    ({"pp": {"degree": 1, "encoder_dp": {"vision": 2}}}, r"needs parallel.pp.degree > 1"),
    ({"pp": {"degree": 4, "layout": "encoders_colocated", "encoder_dp": {"vision": 2}}},
     r"needs parallel.pp.layout = 'encoder_parallel'"),
    ({"pp": {"degree": 2, "attach_encoders": True, "schedule": "interleaved_1f1b", "encoder_dp": {"vision": 2}}},
     r"does not combine with parallel.pp.attach_encoders"),
    ({"pp": {"degree": 5, "stages": {"llm": 4}, "virtual_stages": 2, "schedule": "interleaved_1f1b",
             "encoder_dp": {"vision": 2}}}, r"one LLM stage per rank, got parallel.pp.virtual_stages = 2"),
    ({"dp_shard": 2, "pp": {"degree": 4, "encoder_dp": {"vision": 2}}}, r"does not combine with FSDP2"),
    ({"pp": {"degree": 2, "encoders_in_bubble": True, "encoder_dp": {"vision": 3}}},
     r"each replica sits on a different LLM rank, so at most parallel.pp.degree = 2"),
])
def test_bad_encoder_dp_is_refused_naming_the_field(parallel, match):
    with pytest.raises(ValueError, match=match):
        _validate(parallel)


def test_plait_launch_refuses_encoder_dp():
    from plait.commands.launch import check_launch

    data = tiny_config_dict("train.jsonl", None, "runs/x", train={"steps": 4},
                            parallel={"pp": {"degree": 4, "encoder_dp": {"vision": 2}}})
    with pytest.raises(ValueError, match=r"^parallel.pp.encoder_dp = \{'vision': 2\}: plait launch plans its own "
                                         r"pipelines"):
        check_launch(config_from_dict(data), 4)
