"""Voxtral under PP=2 (the tower with its frame stacking and projector on one stage, the LLM on the other) and CP=2
(gloo, ``plait train`` under torchrun) equals one process: per-step losses and the final model. The job fine-tunes a
tiny imported ``VoxtralForConditionalGeneration`` (tower and LLM trained) on records with one audio clip each and a
text record."""

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


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """One folder for the imported model, the data and every run."""
    return tmp_path_factory.mktemp("voxtral")


@pytest.fixture(scope="module")
def reference(folder):
    """Single-process losses and final parameters (computed once)."""
    trainer = Trainer.build(config_from_dict(voxtral_job(folder, "single")))
    assert type(trainer.model.encoders["audio"].encoder).__name__ == "VoxtralProjectedEncoder"
    assert [trainer.train_set[i].meta.items for i in range(3)] == [(("audio", 75),), (("audio", 75),), ()]
    result = trainer.fit()
    return result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_voxtral_under_parallel_layouts_equals_one_process(folder, reference, layout):
    ref_losses, ref_params = reference
    nproc, parallel = LAYOUTS[layout]
    job = voxtral_job(folder, layout)
    job["parallel"].update(parallel)
    torchrun_train(job, folder, layout, nproc=nproc)
    assert_run_equals(folder / layout, ref_losses, ref_params)
