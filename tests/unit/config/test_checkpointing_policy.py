"""An unknown activation checkpointing policy is refused the same way, with the same message, whether the job comes
from a TOML file (the CLI's ``load_config``) or is built in Python from the config dataclasses."""

from __future__ import annotations

import dataclasses

import pytest

from plait.config.loader import config_from_dict, load_config
from plait.config.schema import EncoderConfig, JobConfig, LLMConfig, ModelConfig, TrainConfig
from tests.helpers.jobs import ROOT

DEMO = ROOT / "configs" / "demo.toml"
POLICIES = "('none', 'full', 'selective')"


def _cli_message(override: str) -> str:
    with pytest.raises(ValueError) as refused:
        load_config(DEMO, [override])
    return str(refused.value)


def test_train_policy_refused_by_the_dataclass_as_by_the_job_file():
    message = f"train.activation_checkpointing must be one of {POLICIES}, got 'reentrant'"
    assert _cli_message("--train.activation_checkpointing=reentrant") == message
    with pytest.raises(ValueError) as refused:
        TrainConfig(activation_checkpointing="reentrant")
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        config_from_dict({"train": {"activation_checkpointing": "reentrant"}})
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        dataclasses.replace(TrainConfig(), activation_checkpointing="reentrant")
    assert str(refused.value) == message


def test_per_module_policies_refused_by_the_dataclass_as_by_the_job_file():
    llm = "model.llm.activation_checkpointing must be one of " + POLICIES + ", got 'reentrant'"
    assert _cli_message("--model.llm.activation_checkpointing=reentrant") == llm
    with pytest.raises(ValueError) as refused:
        JobConfig(model=ModelConfig(llm=LLMConfig(activation_checkpointing="reentrant")))
    assert str(refused.value) == llm
    vision = "model.encoders.vision.activation_checkpointing must be one of " + POLICIES + ", got 'reentrant'"
    assert _cli_message("--model.encoders.vision.activation_checkpointing=reentrant") == vision
    with pytest.raises(ValueError) as refused:
        ModelConfig(encoders={"vision": EncoderConfig(activation_checkpointing="reentrant")})
    assert str(refused.value) == vision


def test_known_policies_and_following_overrides_are_accepted():
    for policy in ("none", "full", "selective"):
        TrainConfig(activation_checkpointing=policy)
        ModelConfig(llm=LLMConfig(activation_checkpointing=policy),
                    encoders={"vision": EncoderConfig(activation_checkpointing=policy)})
    ModelConfig(llm=LLMConfig(activation_checkpointing=None), encoders={"vision": EncoderConfig()})
