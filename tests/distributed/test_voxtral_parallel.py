"""Voxtral under PP=2 (the tower with its frame stacking and projector on one stage, the LLM on the other) and CP=2,
the tower and LLM trained, and FSDP2 ``dp_shard = 2`` with the tower frozen (as the recipe has it: a trained
Whisper-style tower's position table is read as a weight, outside any module call, which FSDP2's per-module
gathering does not cover) (gloo, ``plait train`` under torchrun) equal one process: per-step losses and the final
model. The job fine-tunes a tiny imported ``VoxtralForConditionalGeneration`` on records with one audio clip each
and a text record."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.voxtral import voxtral_job

LAYOUTS = {
    "pp2": (2, {"pp": {"degree": 2, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "cp2": (2, {"cp": 2}),
}
FROZEN_TOWER_LAYOUTS = {"fsdp2": (2, {"dp_shard": 2})}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One folder for the imported model, the data and every run."""
    return tmp_path_factory.mktemp("voxtral")


def _job(folder, run: str, frozen_tower: bool) -> dict:
    job = voxtral_job(folder, run)
    job["model"]["encoders"]["audio"]["freeze"] = frozen_tower
    return job


def _reference(folder, frozen_tower: bool):
    trainer = Trainer.build(config_from_dict(_job(folder, f"single-{frozen_tower}", frozen_tower)))
    assert type(trainer.model.encoders["audio"].encoder).__name__ == "VoxtralProjectedEncoder"
    assert [trainer.train_set[i].meta.items for i in range(3)] == [(("audio", 75),), (("audio", 75),), ()]
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def reference(folder):
    """Single-process losses and final parameters, the tower trained (computed once)."""
    return _reference(folder, False)


@pytest.fixture(scope="module")
def frozen_reference(folder):
    """Single-process losses and final parameters, the tower frozen (computed once)."""
    return _reference(folder, True)


def _check(folder, ref, layout: str, layouts: dict, frozen_tower: bool) -> None:
    ref_losses, ref_params = ref
    nproc, parallel = layouts[layout]
    job = _job(folder, layout, frozen_tower)
    job["parallel"].update(parallel)
    torchrun_train(job, folder, layout, nproc=nproc)
    assert_run_equals(folder / layout, ref_losses, ref_params)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_voxtral_under_parallel_layouts_equals_one_process(folder, reference, layout):
    _check(folder, reference, layout, LAYOUTS, False)


@pytest.mark.parametrize("layout", list(FROZEN_TOWER_LAYOUTS))
def test_voxtral_with_a_frozen_tower_under_fsdp2_equals_one_process(folder, frozen_reference, layout):
    _check(folder, frozen_reference, layout, FROZEN_TOWER_LAYOUTS, True)
