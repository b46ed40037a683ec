"""Per-encoder data-parallel degrees end to end on the demo job with a heavy frozen vision tower (8 layers of 256 on
64x64 images) on 4 H100s, one pipeline: ``plait plan --encoder-dp`` replicates the vision stage on 2 ranks; its printed
tables and command carry ``encoder_dp``, the command's overrides pass ``plait train``'s job-file check, and the job
they make builds the same pipeline (stages, replicas, ranks) in the trainer (``build_pipeline_plan``) and through
``apply_layout_choice``; ``plait simulate`` draws both replicas' tracks; ``plait energy`` (encoder degrees searched by default) plans a
clock for every action of both replica stages; ``--no-encoder-dp`` keeps one replica per encoder stage."""

from __future__ import annotations

import io
import json
import re
import shlex
import tomllib

import pytest
from transformers import AutoTokenizer

from plait.cli import main
from plait.commands.plan.command import plan_command
from plait.commands.simulate import simulate_command
from plait.config.loader import load_config
from plait.models.registry import build_model
from plait.models.units import model_units
from plait.planner.energy.types import EnergyPlan
from plait.train.apply_plan import apply_layout_choice
from plait.train.job_file import check_job
from plait.train.pipeline_run import build_pipeline_plan
from plait.train.plots import read_chrome_trace
from tests.helpers.jobs import DEMO, ROOT

JOB = ROOT / "configs" / "demo.toml"
HEAVY = ['--model.encoders.vision.config={ model_type = "siglip_vision_model", hidden_size = 256, '
         'intermediate_size = 1024, num_hidden_layers = 8, num_attention_heads = 4, image_size = 64, patch_size = 4, '
         'num_channels = 3 }', "--train.microbatch_size=4", "--model.encoders.vision.freeze=true"]
ONE_STAGE_PER_RANK = dict(virtual_stages=(1,), attach_encoders=False, in_bubble=False)
# vision's replicas on ranks 0 and 1, audio on rank 2, the LLM on rank 3
STAGES = [("vision", 0, 0, 2), ("vision", 1, 1, 2), ("audio", 2, 0, 1), ("llm", 3, 0, 1)]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    out = io.StringIO()
    choice = plan_command(JOB, 4, folder / "plan.json", device="h100", dp_degrees=[1], out=out,
                          profile_store=None, overrides=HEAVY, **ONE_STAGE_PER_RANK)
    return choice, out.getvalue(), folder


def _stages(plan) -> list[tuple[str, int, int, int]]:
    return [("+".join(s.modules), s.rank, s.replica, s.replicas) for s in plan.stages]


def test_the_search_replicates_the_heavy_encoder(planned):
    choice, text, _ = planned
    assert choice.encoder_dp == (("vision", 2),) and choice.layout == "encoder_parallel" and choice.dp == 1
    assert _stages(choice.plan) == STAGES
    assert "encoder data-parallel degrees (each stage's replicas): vision 2" in text


def test_printed_tables_and_command_run_the_same_plan(planned):
    choice, text, _ = planned
    match = re.search(r"put these tables in the job file:\n(.*?)or run it as printed .*?:\n  ([^\n]*)\n", text, re.S)
    assert match, text
    pp = tomllib.loads(match.group(1))["parallel"]["pp"]
    assert pp["encoder_dp"] == {"vision": 2} and pp["degree"] == 4 and pp["stages"] == {"vision": 1, "audio": 1,
                                                                                         "llm": 1}
    args = shlex.split(match.group(2))
    assert args[:6] == ["torchrun", "--nproc_per_node", "4", "-m", "plait.cli", "train"]
    overrides = args[8:]
    assert "--parallel.pp.encoder_dp={ vision = 2 }" in overrides
    check_job(args[7], overrides)  # plait train's job-file check, before torch loads
    cfg = load_config(args[7], overrides)
    assert cfg.parallel.pp.encoder_dp == {"vision": 2} and cfg.parallel.pp.layout == "encoder_parallel"
    model = build_model(cfg.model, AutoTokenizer.from_pretrained(str(DEMO / "tokenizer")), device="meta")
    built = build_pipeline_plan(model, cfg.parallel.pp)  # the trainer's plan
    assert built.replace(num_microbatches=choice.plan.num_microbatches) == choice.plan
    assert _stages(built) == STAGES
    # the choice written into the job (parallel.plan = "auto") gives the same [parallel.pp]
    written = apply_layout_choice(load_config(JOB, HEAVY), choice, model_units(model))
    assert written.parallel.pp == cfg.parallel.pp


def test_simulate_draws_both_replicas(planned, tmp_path):
    _, _, folder = planned
    out = io.StringIO()
    paths = simulate_command(folder / "plan.json", tmp_path / "sim", out=out)
    assert paths["png"].is_file() and "makespan" in out.getvalue()
    events = read_chrome_trace(paths["trace"])["predicted"]
    forwards = {(e.stage, e.rank) for e in events if e.kind == "F"}
    assert forwards == {(0, 0), (1, 1), (2, 2), (3, 3)}
    # each replica runs every microbatch (its share of the rows)
    assert sorted(e.microbatch for e in events if e.kind == "F" and e.stage == 1) == list(range(8))


def test_energy_plans_every_replica_action(tmp_path, capsys):
    out = tmp_path / "energy"
    assert main(["energy", "--config", str(JOB), "--devices", "4", "--dp", "1", "--method", "lowtime",
                 "--straggler", "1.3", "--out-dir", str(out), *HEAVY]) == 0
    text = capsys.readouterr().out
    assert "encoder data-parallel degrees (each stage's replicas): vision 2" in text
    plan = EnergyPlan.from_json((out / "energy_plan.json").read_text())
    scheduled = set(plan.schedule)
    for stage, rank in ((0, 0), (1, 1)):  # both replica stages' forwards, every microbatch, on their own ranks
        assert {f"{rank} F s{stage} m{m}" for m in range(8)} <= scheduled
    # every listed frequency is of a scheduled action; the slowest point slows the replicas' actions too
    slowest = plan.points[-1]
    assert all(f"{a.rank} {a.label}" in scheduled for p in plan.points for a in p.frequencies)
    assert {a.rank for a in slowest.frequencies} >= {0, 1}
    frontier = json.loads((out / "frontier.json").read_text())
    assert len(frontier) >= 2


def test_plan_energy_searches_encoder_replicas_by_default(monkeypatch):
    """``plait plan --energy`` hands ``encoder_dp`` (on unless ``--no-encoder-dp``) and ``--gpus-per-node`` to every
    plan it compares."""
    import plait.commands.plan.energy as energy

    seen = []
    monkeypatch.setattr(energy, "plan_by_energy", lambda *args, **kwargs: seen.append(kwargs))
    for flags in ([], ["--encoder-dp"], ["--no-encoder-dp"], ["--gpus-per-node", "2"], ["--dp", "1"]):
        assert main(["plan", "--config", str(JOB), "--devices", "4", "--energy", *flags]) == 0
    assert [kwargs["encoder_dp"] for kwargs in seen] == [True, True, False, True, True]
    assert [kwargs["gpus_per_node"] for kwargs in seen] == [None, None, None, 2, None]
    assert [kwargs["dp_degrees"] for kwargs in seen] == [None, None, None, None, [1]]


def test_plan_energy_compares_only_the_dp_degree_asked_for(monkeypatch):
    """``plait plan --energy --dp 1`` compares plans of DP 1 only (it compared every divisor, overriding ``--dp``)."""
    import plait.commands.plan.energy as energy

    asked = []

    def no_plan(*args, **kwargs):
        asked.append(tuple(kwargs["dp_degrees"]))
        raise ValueError("no plan")

    monkeypatch.setattr(energy, "plan_command", no_plan)
    with pytest.raises(ValueError, match="no plan for 4 devices"):
        energy.plan_by_energy(JOB, 4, gpu="h100", dp_degrees=[1], out=io.StringIO())
    assert set(asked) == {(1,)}
    asked.clear()
    with pytest.raises(ValueError, match="no plan for 4 devices"):
        energy.plan_by_energy(JOB, 4, gpu="h100", out=io.StringIO())
    assert set(asked) == {(1,), (2,), (4,)}


def _note_job(dp_shard: int = 1, microbatch_size: int = 4):
    from types import SimpleNamespace

    return SimpleNamespace(parallel=SimpleNamespace(dp_shard=dp_shard),
                           train=SimpleNamespace(microbatch_size=microbatch_size))


def test_encoder_dp_note_only_when_the_job_keeps_replicas_out():
    from plait.commands.plan.command import encoder_dp_note
    from plait.planner.types import Unit

    units = [Unit("v0", "vision", "layer", False, False), Unit("l0", "llm", "layer", True, True)]
    assert encoder_dp_note(_note_job(dp_shard=2), units) == (
        "encoder data-parallel degrees: not searched (FSDP2, parallel.dp_shard = 2, refuses replicated encoder "
        "stages; set parallel.dp_shard = 1 to search them)")
    assert encoder_dp_note(_note_job(), units) == ""  # searched (by default): the plan prints its replicas, if any
    assert encoder_dp_note(_note_job(dp_shard=2, microbatch_size=1), units) == ""  # nothing to search anyway
    assert encoder_dp_note(_note_job(dp_shard=2), units[1:]) == ""


def test_plan_with_fsdp2_says_encoder_dp_was_not_searched():
    out = io.StringIO()
    choice = plan_command(JOB, 4, None, device="h100", encoder_dp=True, out=out, profile_store=None,
                          overrides=["--parallel.dp_shard=2"], **ONE_STAGE_PER_RANK)
    assert not choice.encoder_dp
    assert out.getvalue().count("encoder data-parallel degrees: not searched (FSDP2, parallel.dp_shard = 2") == 1
