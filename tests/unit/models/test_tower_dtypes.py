"""Tower dtypes: a tower computes in the dtype its job table or checkpoint gives it, and its features reach the
projector in the projector's dtype.

(a) A vision tower saved in bf16 (``save_pretrained``) and an fp32 LLM and projectors, built on the CPU without
    autocast (``train.dtype`` fp32, or auto on a CPU): the tower stays bf16, the forward and backward run, the
    logits are fp32. A bf16 Whisper tower, whose stock forward does not cast its input, too.
(b) ``dtype = "bfloat16"`` in a ``[model.encoders.<name>.config]`` table builds that tower in bf16, as the same
    field in ``[model.llm.config]`` builds the LLM in bf16.
"""

from __future__ import annotations

import pytest
import torch

from plait.config.loader import config_from_dict
from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_encoder
from plait.models.projector import build_projector
from plait.models.registry import build_model, load_tokenizer
from tests.helpers.jobs import TINY_AUDIO, TINY_VISION, tiny_config_dict


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_config_dict("unused.jsonl")["data"]["tokenizer"])


def dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in module.parameters() if p.is_floating_point()}


def one_image_batch(model, tok):
    vision = model.encoders["vision"]
    n = vision.feature_count((32, 32))
    ids = torch.full((1, n + 4), int(tok.convert_tokens_to_ids("a")))
    ids[0, 2:2 + n] = model.placeholder_ids["vision"]
    return ids, {"vision": {"pixel_values": [torch.randn(3, 32, 32)]}}


def test_a_tower_saved_in_bf16_feeds_an_fp32_projector_without_autocast(tok, tmp_path):
    build_encoder("image", config=dict(TINY_VISION)).to(torch.bfloat16).save_pretrained(tmp_path / "vision")
    cfg = tiny_config_dict("unused.jsonl")
    vision = cfg["model"]["encoders"]["vision"]
    vision.pop("config")
    vision["path"] = str(tmp_path / "vision")
    model = build_model(config_from_dict(cfg).model, tok)
    assert dtypes(model.encoders["vision"].encoder) == {torch.bfloat16}  # the checkpoint's dtype
    assert dtypes(model.encoders["vision"].projector) == {torch.float32}
    ids, inputs = one_image_batch(model, tok)
    logits = model(ids, inputs)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(p.grad is not None for p in model.encoders["vision"].projector.parameters())


def test_a_bf16_whisper_tower_gets_its_input_in_its_dtype():
    encoder = build_encoder("audio", config=dict(TINY_AUDIO)).to(torch.bfloat16)
    branch = ModalityEncoder(encoder, build_projector("linear", 32, 16), "audio")
    out = branch({"input_features": torch.randn(1, 80, 300), "num_samples": torch.tensor([8000])})
    assert out.dtype == torch.float32 and out.shape == (branch.feature_count(8000), 16)


def test_dtype_in_an_encoder_config_table_is_honoured_as_for_the_llm(tok):
    cfg = tiny_config_dict("unused.jsonl")
    cfg["model"]["llm"]["config"]["dtype"] = "bfloat16"
    for name in ("vision", "audio"):
        cfg["model"]["encoders"][name]["config"]["dtype"] = "bfloat16"
    model = build_model(config_from_dict(cfg).model, tok)
    assert dtypes(model.language_model) == {torch.bfloat16}
    for name in ("vision", "audio"):
        assert dtypes(model.encoders[name].encoder) == {torch.bfloat16}, name
        assert dtypes(model.encoders[name].projector) == {torch.float32}, name
    ids, inputs = one_image_batch(model, tok)
    assert torch.isfinite(model(ids, inputs).float()).all()
