"""Microbatch cost coefficients of the native-resolution towers (plait/train/cost_coeffs.py): Qwen2.5-VL's window layers
attend a window (linear in tokens), only its full-attention layers are quadratic, and 4 patches make one
placeholder (its 2x2 merger); InternVL attends within each tile and pixel-shuffles d x d patches into one
placeholder. Both were costed as full attention over one token per placeholder (4x too few tokens)."""

from __future__ import annotations

import pytest

from plait.config.loader import config_from_dict
from plait.data.chat_template import tokenizer_dir
from plait.models.registry import build_model, load_tokenizer
from plait.models.plan_inputs import encoder_arch
from plait.train.cost_coeffs import microbatch_cost_coeffs
from tests.helpers.jobs import tiny_config_dict
from tests.helpers.pixtral_internvl import TINY_INTERNVL
from tests.helpers.qwen2_5_vl import TINY_QWEN2_5_VL


def _coeffs(branch: dict):
    job = tiny_config_dict("unused.jsonl")
    job["model"]["encoders"] = {"vision": dict(modality="image", **branch)}
    cfg = config_from_dict(job)
    model = build_model(cfg.model, load_tokenizer(tokenizer_dir(cfg.data, cfg.model)), device="meta")
    arch = encoder_arch(model.encoders["vision"].encoder.config)
    return microbatch_cost_coeffs(model)["vision"], arch, [float(x) for x in arch.layer_flops()]


def test_qwen2_5_vl_window_layers_are_linear_and_four_patches_make_a_placeholder():
    coeffs, arch, (per_token, per_pair) = _coeffs({"config": dict(TINY_QWEN2_5_VL)})
    full = len(arch.full_layers)
    assert 0 < full < arch.layers and arch.window > 0
    assert coeffs.encoder_tokens_per_feature == 4.0
    assert coeffs.quadratic == pytest.approx(full * per_pair)
    assert coeffs.linear == pytest.approx(arch.layers * per_token + (arch.layers - full) * per_pair * arch.window)


def test_internvl_attends_within_tiles_and_shuffles_d_squared_patches_into_a_placeholder():
    coeffs, arch, (per_token, per_pair) = _coeffs({"config": dict(TINY_INTERNVL), "select": "drop_cls",
                                                   "downsample": 2, "processor": {"max_patches": 6}})
    assert coeffs.encoder_tokens_per_feature == 4.0 and coeffs.quadratic == 0.0
    assert coeffs.linear == pytest.approx(arch.layers * (per_token + per_pair * arch.item_len))


def test_plain_vision_towers_keep_full_attention_over_one_token_per_placeholder():
    coeffs, arch, (per_token, per_pair) = _coeffs({"config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                                                              "intermediate_size": 64, "num_hidden_layers": 2,
                                                              "num_attention_heads": 2, "image_size": 16,
                                                              "patch_size": 4}})
    assert coeffs.encoder_tokens_per_feature == 1.0
    assert (coeffs.linear, coeffs.quadratic) == (pytest.approx(2 * per_token), pytest.approx(2 * per_pair))


def test_pixtral_packed_call_is_priced_per_image_like_qwen2_5_vl_packing():
    """A microbatch's Pixtral images are one packed call (block-diagonal mask): its linear layers run over all
    patches (``linear`` per patch: the packed call's matmuls exactly) and attention is priced within each image
    (``quadratic`` per image: the per-image calls' attention exactly), as Qwen2.5-VL's packed call is priced.
    transformers' eager/sdpa Pixtral computes the packed call's attention scores over all P x P pairs and masks
    them (flash attention's ``cu_seq_lens`` does the per-image work), so that path does ``(sum n)^2`` work."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from plait.models.families.pixtral import pixtral_inputs
    from tests.helpers.pixtral_internvl import TINY_PIXTRAL, tiny_pixtral

    coeffs, arch, (per_token, per_pair) = _coeffs({"config": dict(TINY_PIXTRAL)})
    assert coeffs.encoder_tokens_per_feature == 1.0 and coeffs.fixed == 0.0
    assert (coeffs.linear, coeffs.quadratic) == (pytest.approx(arch.layers * per_token),
                                                 pytest.approx(arch.layers * per_pair))
    tower = tiny_pixtral("eager")
    images = [torch.randn(3, 32, 32), torch.randn(3, 16, 24), torch.randn(3, 8, 8)]
    patches = [64, 24, 4]

    def layer_flops(group: list) -> dict[str, int]:
        with FlopCounterMode(display=False) as counter:
            tower(**pixtral_inputs(group))
        return {str(op): n for op, n in counter.get_flop_counts()["PixtralVisionModel.transformer"].items()}

    packed = layer_flops(images)
    assert packed["aten.mm"] == coeffs.linear * sum(patches)  # linear layers over all patches of the call
    assert sum(layer_flops([image])["aten.bmm"] for image in images) == coeffs.quadratic * sum(n * n for n in patches)
    assert packed["aten.bmm"] == coeffs.quadratic * sum(patches) ** 2  # eager: scores of every pair, then masked
