"""Pixtral and InternVL vision branches under PP=2 (both layouts), PP=3 with the tower split across two ranks (the
per-call hook: Pixtral's 2D RoPE and block mask recomputed on the later stage), CP=2 and (Pixtral) TP=2 (gloo,
``plait train`` under torchrun) equal one process: per-step losses and the final model.

The jobs mix single-image demo records with a two-image record of different sizes (Pixtral packs both into one patch
sequence; InternVL tiles each), so every microbatch holds images of several sizes.
"""

from __future__ import annotations


import pytest

from plait.config.loader import config_from_dict
from plait.train.trainer import Trainer
from tests.helpers.pipeline_training import assert_run_equals, torchrun_train
from tests.helpers.pixtral_internvl import TINY_INTERNVL, TINY_PIXTRAL
from tests.helpers.pixtral_internvl_parallel import vision_job

FAMILIES = {
    "pixtral": ({"modality": "image", "config": dict(TINY_PIXTRAL)}, "encoders.vision.encoder.transformer.layers.1"),
    "internvl": ({"modality": "image", "config": dict(TINY_INTERNVL), "select": "drop_cls", "downsample": 2,
                  "processor": {"max_patches": 4}}, "encoders.vision.encoder.encoder.layer.1"),
}
LAYOUTS = {
    "pp2-encoder_parallel": (2, {"pp": {"degree": 2, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "pp2-encoders_colocated": (2, {"pp": {"degree": 2, "layout": "encoders_colocated", "schedule": "gpipe"}}),
    "pp3-tower_split": (3, {"pp": {"degree": 3, "layout": "encoder_parallel", "schedule": "1f1b"}}),
    "cp2": (2, {"cp": 2}),
    "tp2": (2, {"tp": 2}),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process losses and final parameters of a family (each computed once, when first asked for)."""
    out: dict = {}

    def reference(family: str) -> tuple:
        if family not in out:
            trainer = Trainer.build(config_from_dict(vision_job(tmp_path_factory.mktemp(family), FAMILIES[family][0], "single")))
            assert [len(trainer.train_set[i].meta.items) for i in range(3)] == [1, 1, 2]
            result = trainer.fit()
            out[family] = (result["losses"], {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return out[family]

    return reference


# InternVL's layers take no per-call input: its tower split is checked in one process
# (tests/unit/models/test_pixtral_internvl.py), which keeps this file's runtime down; it has no TP plan
CASES = [(f, layout) for f in FAMILIES for layout in LAYOUTS
         if (f, layout) not in (("internvl", "pp3-tower_split"), ("internvl", "tp2"))]


@pytest.mark.parametrize("family, layout", CASES)
def test_pixtral_and_internvl_under_pp_and_cp_equal_one_process(tmp_path, references, family, layout):
    ref_losses, ref_params = references(family)
    nproc, parallel = LAYOUTS[layout]
    job = vision_job(tmp_path, FAMILIES[family][0], layout)
    job["parallel"].update(parallel)
    if layout == "pp3-tower_split":  # two vision stages on ranks 0 and 1 (the second starts inside the layers)
        job["parallel"]["pp"]["splits"] = {"vision": [FAMILIES[family][1]]}
    torchrun_train(job, tmp_path, layout, nproc=nproc)
    assert_run_equals(tmp_path / layout, ref_losses, ref_params)
