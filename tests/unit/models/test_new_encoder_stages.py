"""Pipeline stage chains of the issue-18 encoder families in one process: a SigLIP2 branch cut into one stage per
unit reproduces the branch's features (images of different patch grids); a Qwen2-Audio branch gives the same
features when its norm and projector form a later stage, and a stage that would start inside its layers is
refused clearly."""

from __future__ import annotations

import pytest
import torch

from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from plait.models.units import model_units
from plait.parallel.stages import build_rank_stages
from plait.planner.pipeline.plan import plan_pipeline
from tests.helpers.jobs import TINY_LLM
from tests.distributed.pipeline_worker import make_batch
from tests.helpers.qwen2_audio import TINY_QWEN2_AUDIO
from tests.helpers.siglip2 import TINY_SIGLIP2
from tests.helpers.stages import check_branch_chain, on_one_rank


def _model(modality: str, cfg: dict, feature_layer: int = -1) -> MultimodalModel:
    torch.manual_seed(0)
    llm = build_causal_lm(config=TINY_LLM, vocab_size=50, attn_implementation="eager")
    branch = ModalityEncoder(build_encoder(modality, config=cfg), build_projector("mlp", 32, 32), modality,
                             feature_layer)
    return MultimodalModel(llm, {modality: branch}, {modality: 48})


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_siglip2_branch_split_at_every_unit_reproduces_its_features(feature_layer):
    model = _model("image", dict(TINY_SIGLIP2, num_hidden_layers=3), feature_layer)
    grids = [(3, 5), (4, 4), (3, 5)]
    inputs = {"pixel_values": [torch.randn(h * w, 48) for h, w in grids],
              "spatial_shapes": [torch.tensor([h, w]) for h, w in grids]}
    check_branch_chain(model, "image", inputs)


def _audio_stages(model: MultimodalModel, splits: list[str]) -> list:
    plan = on_one_rank(plan_pipeline(model_units(model), splits={"audio": splits}))
    stages = build_rank_stages(model, plan, 0)
    return [stages.stages[i] for i in plan.module_stages("audio")]


def test_qwen2_audio_branch_stages_keep_layers_with_the_embedding():
    model = _model("audio", dict(TINY_QWEN2_AUDIO))
    inputs = {"input_features": torch.randn(2, 80, 300), "num_samples": torch.tensor([48000, 9000])}
    expected = model.encoders["audio"](inputs)
    batch = make_batch("t", 0)
    batch.modality_inputs = {"audio": inputs}
    first, second = _audio_stages(model, ["encoders.audio.encoder.layer_norm"])
    hidden = first.forward(batch, {}, None, {})
    out = second.forward(batch, {first.index: hidden}, None, {})
    torch.testing.assert_close(out["audio"][0], expected, rtol=1e-5, atol=1e-6)
    first, second = _audio_stages(model, ["encoders.audio.encoder.layers.1"])
    hidden = first.forward(batch, {}, None, {})
    with pytest.raises(ValueError, match="cannot start a pipeline stage"):
        second.forward(batch, {first.index: hidden}, None, {})
