"""``--section.key=value`` overrides are never taken as the value of an option with an optional value: an override
holding a space (a TOML inline table) after ``--resume`` stayed an override, not the checkpoint folder."""

import pytest

from plait.cli import parse_command_line

STAGES = "--parallel.pp.stages={vision = 1, audio = 1, llm = 1}"
REPLICAS = "--parallel.pp.encoder_dp={vision = 2}"


@pytest.mark.parametrize("argv,resume,overrides", [
    (["--resume", STAGES, REPLICAS, "--train.steps=6"], True, [STAGES, REPLICAS, "--train.steps=6"]),
    (["--resume", "--model.llm.config={hidden_size = 64}"], True, ["--model.llm.config={hidden_size = 64}"]),
    (["--resume", "runs/a b", STAGES], "runs/a b", [STAGES]),
    ([STAGES, "--resume"], True, [STAGES]),
    (["--train.steps=6"], False, ["--train.steps=6"]),
])
def test_overrides_stay_overrides_after_an_optional_value(argv, resume, overrides):
    args, rest = parse_command_line(["train", "--config", "configs/demo_pp.toml", *argv])
    assert args.resume == resume
    assert rest == overrides
