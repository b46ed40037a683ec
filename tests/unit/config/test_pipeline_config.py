"""``[parallel.pp]`` with several stages per pipeline rank: ``virtual_stages`` (interleaved 1F1B) and
``attach_encoders`` parse from TOML and overrides, fill in stage counts and stage ranks (checked against hand-worked
placements), and every invalid combination is refused with the field named."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict, load_config, pipeline_plan_kwargs, pipeline_stage_counts, validate
from plait.config.schema import PipelineConfig
from plait.planner.pipeline.plan import plan_pipeline, stage_ranks, synthetic_units
from plait.planner.pipeline.schedules import build_schedule
from plait.planner.pipeline.interleaved import runs_interleaved
from tests.helpers.jobs import ROOT, tiny_config_dict

ENCODERS = ["vision", "audio"]
INTERLEAVED = {"schedule": "interleaved_1f1b"}


def _validate_pp(pp: dict) -> None:
    validate(config_from_dict(tiny_config_dict("train.jsonl", parallel={"pp": pp})))


def test_toml_and_overrides_set_the_new_fields(tmp_path):
    cfg = load_config(ROOT / "configs" / "demo_pp.toml", [
        "--parallel.pp.degree=2", "--parallel.pp.stages={}", "--parallel.pp.virtual_stages=2",
        "--parallel.pp.attach_encoders=true", "--parallel.pp.schedule=interleaved_1f1b"])
    pp = cfg.parallel.pp
    assert (pp.degree, pp.virtual_stages, pp.attach_encoders, pp.schedule) == (2, 2, True, "interleaved_1f1b")
    assert pipeline_stage_counts(pp, ENCODERS) == {"vision": 1, "audio": 1, "llm": 4}
    assert PipelineConfig().virtual_stages == 1 and PipelineConfig().attach_encoders is False
    with pytest.raises(ValueError, match="parallel.pp.virtual_stages: expected int, got 'two'"):
        load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.pp.virtual_stages=two"])
    with pytest.raises(ValueError, match="parallel.pp.attach_encoders: expected bool, got 1"):
        load_config(ROOT / "configs" / "demo_pp.toml", ["--parallel.pp.attach_encoders=1"])


# (pp fields, layout, stages per module, stage ranks): worked out by hand from the placement rules (encoder stages
# on ranks 0.. or all on rank 0 when attached; LLM stage j on LLM rank j mod p)
CASES = [
    ({"degree": 2, "virtual_stages": 2, "attach_encoders": True, **INTERLEAVED},
     {"vision": 1, "audio": 1, "llm": 4}, [0, 0, 0, 1, 0, 1]),
    ({"degree": 4, "virtual_stages": 2, **INTERLEAVED},
     {"vision": 1, "audio": 1, "llm": 4}, [0, 1, 2, 3, 2, 3]),
    ({"degree": 3, "layout": "encoders_colocated", "virtual_stages": 2, **INTERLEAVED},
     {"vision": 1, "audio": 1, "llm": 4}, [0, 1, 2, 1, 2]),
    ({"degree": 2, "attach_encoders": True, **INTERLEAVED},  # v = 1: 1F1B on the LLM ranks, encoders attached
     {"vision": 1, "audio": 1, "llm": 2}, [0, 0, 0, 1]),
    ({"degree": 2, "layout": "encoders_colocated", "attach_encoders": True, "stages": {"vision": 2}, **INTERLEAVED},
     {"vision": 2, "audio": 2, "llm": 2}, [0, 0, 0, 1]),
    ({"degree": 3, "virtual_stages": 2, "attach_encoders": True,  # names are checked against units by plan_pipeline
      "splits": {"llm": ["language_model.model.layers.0", "language_model.model.layers.1",
                         "language_model.model.norm", "language_model.lm_head", "x.5"]}, **INTERLEAVED},
     {"vision": 1, "audio": 1, "llm": 6}, [0, 0, 0, 1, 2, 0, 1, 2]),
    ({"degree": 4, "stages": {"vision": 2}}, {"vision": 2, "audio": 1, "llm": 1}, [0, 1, 2, 3]),  # unchanged default
]


@pytest.mark.parametrize("pp, counts, ranks", CASES)
def test_stage_counts_and_ranks_follow_the_placement(pp, counts, ranks):
    config = config_from_dict({"parallel": {"pp": pp}}).parallel.pp
    assert pipeline_stage_counts(config, ENCODERS) == counts
    kwargs = pipeline_plan_kwargs(config, ENCODERS)
    assert kwargs["ranks"] == ranks
    assert kwargs["splits"] == pp.get("splits", {})
    assert sum(kwargs["stages_per_module"].values()) + sum(len(s) + 1 for s in kwargs["splits"].values()) \
        == sum(counts.values())


def test_the_configured_plan_runs_the_interleaved_schedule():
    """The plan of a ``virtual_stages = 2`` config has 2 LLM stages per rank and suits ``interleaved_1f1b``."""
    units = synthetic_units({"vision": [False, True], "audio": [False, True]}, [True] * 6)
    config = config_from_dict({"parallel": {"pp": CASES[0][0]}}).parallel.pp
    plan = plan_pipeline(units, config.layout, **pipeline_plan_kwargs(config, ENCODERS))
    assert plan.num_ranks == 2 and plan.virtual_stages == 2 and runs_interleaved(plan)
    assert [plan.stages[s].rank for s in plan.llm_stages] == [0, 1, 0, 1]
    schedule = build_schedule(plan, "interleaved_1f1b", 3)  # checked (complete, deadlock-free) when built
    assert {a.stage for a in schedule.actions[0]} == {0, 1, 2, 4}


def test_stage_ranks_by_hand():
    assert stage_ranks(2, 2) == (0, 1, 2, 3)  # one stage per rank
    assert stage_ranks(1, 3, 2) == (0, 1, 2, 3, 1, 2, 3)
    assert stage_ranks(2, 2, 2, attach_encoders=True) == (0, 0, 0, 1, 0, 1)
    assert stage_ranks(0, 2, 3, attach_encoders=True) == (0, 1, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="encoder_stages must be >= 0"):
        stage_ranks(-1, 2)
    with pytest.raises(ValueError, match="llm_ranks and virtual_stages must be >= 1"):
        stage_ranks(1, 2, 0)


@pytest.mark.parametrize("pp, message", [
    ({"degree": 4, **INTERLEAVED}, "parallel.pp.schedule = 'interleaved_1f1b' needs several stages per pipeline rank"),
    ({"degree": 2, "virtual_stages": 2, "attach_encoders": True},
     "parallel.pp.virtual_stages=2 and parallel.pp.attach_encoders=true put several stages on a pipeline rank, which only "
     "parallel.pp.schedule = 'interleaved_1f1b' or 'zb_v' runs; got '1f1b'"),
    ({"degree": 2, "attach_encoders": True, "schedule": "gpipe"}, "attach_encoders=true put several stages"),
    ({"degree": 1, "virtual_stages": 2, "schedule": "zb_v"}, "parallel.pp.virtual_stages=2 place stages on several "
     "pipeline ranks, but parallel.pp.degree = 1"),
    ({"degree": 2, "virtual_stages": 2, "attach_encoders": True, "schedule": "memory_capped_1f1b", "cap": 1},
     "only parallel.pp.schedule = 'interleaved_1f1b' or 'zb_v' runs"),
    ({"degree": 2, "virtual_stages": 1, "schedule": "zb_v"}, "'zb_v' runs 2 LLM stages per LLM rank in a V: set "
     "parallel.pp.virtual_stages = 2, got 1"),
    ({"degree": 3, "virtual_stages": 3, "schedule": "zb_v"}, "set parallel.pp.virtual_stages = 2, got 3"),
    ({"degree": 1, "virtual_stages": 2, **INTERLEAVED}, "parallel.pp.degree = 1 runs the whole model on one rank"),
    ({"degree": 2, "virtual_stages": 0}, "parallel.pp.virtual_stages must be >= 1"),
    ({"degree": 3, "virtual_stages": 2, **INTERLEAVED}, "parallel.pp.virtual_stages=2 needs at least 2 LLM ranks"),
    ({"degree": 4, "virtual_stages": 2, "stages": {"llm": 3}, **INTERLEAVED},
     "the LLM has 3 stages, not a multiple of parallel.pp.virtual_stages=2"),
    ({"degree": 4, "virtual_stages": 2, **INTERLEAVED,
      "splits": {"llm": ["language_model.model.layers.0", "language_model.model.layers.1"]}},
     "the LLM has 3 stages, not a multiple"),
    ({"degree": 4, "virtual_stages": 2, "splits": {"llm": ["language_model.model.layers.0"]}, **INTERLEAVED},
     "needs at least 2 LLM ranks"),
    ({"degree": 3, "virtual_stages": 2, "attach_encoders": True, "stages": {"llm": 4}, **INTERLEAVED},
     "parallel.pp.stages give 2 pipeline ranks"),
    ({"degree": 3, "attach_encoders": True, "stages": {"llm": 2}, **INTERLEAVED}, "parallel.pp.degree is 3"),
    ({"degree": 4, "virtual_stages": 2, "cap": 1, **INTERLEAVED}, "only used by schedule 'memory_capped_1f1b'"),
])
def test_bad_placements_name_the_field(pp, message):
    with pytest.raises(ValueError) as err:
        _validate_pp(pp)
    assert message in str(err.value)


def test_zb_v_places_the_llm_in_a_v():
    """``schedule = "zb_v"``: LLM rank ``i`` of ``p`` holds LLM stages ``i`` and ``2p - 1 - i`` (encoders on their own
    ranks before, or on the first LLM rank)."""
    own = pipeline_plan_kwargs(PipelineConfig(degree=4, virtual_stages=2, schedule="zb_v"), ["vision", "audio"])
    assert own["stages_per_module"] == {"vision": 1, "audio": 1, "llm": 4} and own["ranks"] == [0, 1, 2, 3, 3, 2]
    attached = pipeline_plan_kwargs(PipelineConfig(degree=2, virtual_stages=2, attach_encoders=True, schedule="zb_v"),
                                    ["vision"])
    assert attached["ranks"] == [0, 0, 1, 1, 0]


def test_attach_encoders_needs_encoders():
    pp = PipelineConfig(degree=2, attach_encoders=True, schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="parallel.pp.attach_encoders = true needs encoder branches"):
        pipeline_stage_counts(pp, [])
    assert pipeline_stage_counts(PipelineConfig(degree=2, virtual_stages=2, schedule="interleaved_1f1b"), []) == \
        {"llm": 4}


def test_encoders_in_bubble_sit_on_the_last_llm_ranks_and_run_the_list_scheduled_schedules():
    """``encoders_in_bubble``: encoder stage ``k`` on LLM rank ``p - 1 - (k mod p)``; the encoders take no rank."""
    assert stage_ranks(2, 2, in_bubble=True) == (1, 0, 0, 1)
    assert stage_ranks(1, 4, in_bubble=True) == (3, 0, 1, 2, 3)
    assert stage_ranks(3, 2, in_bubble=True) == (1, 0, 1, 0, 1)  # more encoder stages than LLM ranks: around again
    with pytest.raises(ValueError, match="encoders in the bubbles sit on LLM ranks of one LLM stage each"):
        stage_ranks(1, 2, 2, in_bubble=True)
    for schedule, degree, layout, ranks in (("1f1b", 2, "encoder_parallel", [1, 0, 0, 1]),
                                            ("zb_h1", 4, "encoder_parallel", [3, 2, 0, 1, 2, 3]),
                                            ("zb_h2", 2, "encoders_colocated", [1, 0, 1])):
        pp = PipelineConfig(degree=degree, layout=layout, encoders_in_bubble=True, schedule=schedule)
        _validate_pp({"degree": degree, "layout": layout, "encoders_in_bubble": True, "schedule": schedule})
        kwargs = pipeline_plan_kwargs(pp, ENCODERS)
        assert kwargs["ranks"] == ranks, schedule
        units = synthetic_units({"vision": [False, True], "audio": [False, True]}, [True] * 4)
        plan = plan_pipeline(units, layout, **kwargs)
        schedule_ = build_schedule(plan, schedule, 4)  # checked when built
        last = plan.num_ranks - 1
        assert plan.stages[0].rank == last and {a.stage for a in schedule_.actions[last]} >= {0, plan.num_stages - 1}


@pytest.mark.parametrize("pp, message", [
    ({"degree": 2, "encoders_in_bubble": True, "schedule": "interleaved_1f1b"},
     "parallel.pp.encoders_in_bubble = true runs with the schedules gpipe, 1f1b, memory_capped_1f1b, zb_h1, zb_h2"),
    ({"degree": 2, "encoders_in_bubble": True, "attach_encoders": True, **INTERLEAVED},
     "does not combine with parallel.pp.attach_encoders=true"),
    ({"degree": 2, "encoders_in_bubble": True, "virtual_stages": 2, "schedule": "zb_v"},
     "does not combine with parallel.pp.virtual_stages=2"),
    ({"degree": 1, "encoders_in_bubble": True}, "parallel.pp.degree = 1 has none"),
])
def test_bad_in_bubble_placements_name_the_field(pp, message):
    with pytest.raises(ValueError) as err:
        _validate_pp(pp)
    assert message in str(err.value)
    with pytest.raises(ValueError, match="parallel.pp.encoders_in_bubble = true needs encoder branches"):
        pipeline_stage_counts(PipelineConfig(degree=2, encoders_in_bubble=True), [])
