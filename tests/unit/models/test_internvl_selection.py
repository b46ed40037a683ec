"""InternVL's feature selection against transformers' own: ``downsample = 1`` (``downsample_ratio = 1``) gives
``InternVLModel.get_image_features``' projector input and is kept; ``select = "full"`` (the CLS kept) has no
transformers counterpart (its ``"full"`` strategy fails) and is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.models.encoder import ModalityEncoder
from plait.models.projector import build_projector
from tests.helpers.pixtral_internvl import (random_images, vision_family_job, tiling_processor, internvl_model,
    stock_projector_input)


def test_downsample_1_features_equal_get_image_features_with_downsample_ratio_1():
    model, processor = internvl_model(1.0), tiling_processor()
    images = random_images([(24, 80), (16, 16)])
    batch = processor(images=images, return_tensors="pt")
    tiles = [processor(images=[img], return_tensors="pt")["pixel_values"] for img in images]
    branch = ModalityEncoder(model.vision_tower, build_projector("linear", 32, 32), "image", select="drop_cls",
                             downsample=1)
    stock, projector_input, mine = stock_projector_input(model, batch["pixel_values"], branch, tiles)
    assert [branch.feature_count((int(t.shape[0]), 32, 32)) for t in tiles] == [4 * 64, 64]
    assert mine.shape == (5 * 64, 32) and stock.shape == (5, 64, 32)
    torch.testing.assert_close(mine, projector_input.reshape(-1, 32), rtol=1e-5, atol=1e-5)


def test_transformers_internvl_has_no_full_selection_and_plait_refuses_it(tmp_path):
    model = internvl_model(1.0)
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        model.get_image_features(pixel_values=torch.randn(2, 3, 32, 32), vision_feature_layer=-1,
                                 vision_feature_select_strategy="full")
    with pytest.raises(ValueError, match=r"select = 'full': an InternVL branch takes select = 'drop_cls'"):
        ModalityEncoder(model.vision_tower, build_projector("linear", 32, 32), "image", select="full")
    from plait.models.registry import build_model, load_tokenizer

    job = vision_family_job(tmp_path, "internvl", {})
    job["model"]["encoders"]["vision"].update(select="full", downsample=1)
    cfg = config_from_dict(job)
    with pytest.raises(ValueError, match=r"^model\.encoders\.vision: select = 'full': an InternVL branch"):
        build_model(cfg.model, load_tokenizer(cfg.data.tokenizer))
