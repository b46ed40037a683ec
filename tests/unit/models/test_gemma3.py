"""Gemma 3 as a plait composite (``plait.models.gemma3``): the composite built from a tiny
``Gemma3ForConditionalGeneration`` (SigLIP tower pooled 2x2 to 16 tokens per image, Gemma 3 text model with
sliding-window and global layers) gives the HF model's logits (fp32, 1e-5) on one image and on rows with two images,
through plait's own ``bidirectional_items`` mask from the batch metadata (the causal mask would not do, nor would
ignoring the local layers' window), and greedy decoding gives ``generate``'s tokens (left-padded prompts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.attention.interface import use_plait_attention
from plait.data.collate import Batch
from plait.models.families.siglip import PooledFeatureCount
from plait.models.generation import greedy_token_ids
from plait.models.hf_io import HF_FORMATS, composite_from_hf
from tests.helpers.gemma3 import hf_kwargs, mask_info, rows, tiny_gemma3


def _composite(seed: int = 0, tied: bool = False):
    model = composite_from_hf(tiny_gemma3(seed, tied), HF_FORMATS["gemma3"]).eval()
    use_plait_attention(model.language_model, "sdpa")
    return model


@pytest.mark.parametrize("images", [(1,), (2, 1)])
def test_logits_equal_hf_with_images_attending_both_ways(images):
    hf, model = tiny_gemma3(), _composite()
    branch = model.encoders["vision"]
    assert (branch.select, branch.downsample, branch.projector.kind) == ("post_norm", 2, "gemma3")
    ids, mask, pixels = rows(images)
    info = mask_info(ids, mask)
    real = mask.bool()
    with torch.no_grad():
        want = hf(**hf_kwargs(ids, mask, pixels)).logits
        mine = model(ids, {"vision": {"pixel_values": list(pixels)}}, mask, info.positions, plait_mask=info)
        causal = model(ids, {"vision": {"pixel_values": list(pixels)}}, mask, info.positions,
                       plait_mask=dataclasses.replace(info, mode="causal"))
        for layer in model.language_model.model.layers:  # the local layers without their window
            layer.self_attn.sliding_window = None
        global_only = model(ids, {"vision": {"pixel_values": list(pixels)}}, mask, info.positions, plait_mask=info)
    torch.testing.assert_close(mine[real], want[real], rtol=1e-5, atol=1e-5)
    assert (causal - want)[real].abs().max() > 1e-2  # image tokens must see their later tokens
    assert (global_only - want)[real].abs().max() > 1e-2  # and the local layers their window only


def _left_padded(seed: int = 3):
    ids, mask, pixels = rows((2, 1), seed=seed, tail=2)
    n = ids.shape[1]
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    for r, length in enumerate(mask.sum(-1).tolist()):
        left_ids[r, n - length:], left_mask[r, n - length:] = ids[r, :length], 1
    return left_ids, left_mask, pixels


def test_greedy_tokens_equal_hf_generate():
    ids, mask, pixels = _left_padded()
    info = mask_info(ids, mask)
    empty = {f.name: None for f in dataclasses.fields(Batch)}
    batch = Batch(**(empty | dict(input_ids=ids, attention_mask=mask, position_ids=info.positions,
                                  document_ids=info.document_ids, item_ids=info.item_ids,
                                  modality_inputs={"vision": {"pixel_values": list(pixels)}})))
    hf, model = tiny_gemma3(), _composite()
    model.language_model.set_attn_implementation("sdpa")  # as plait generate loads it: the prefill switches
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**hf_kwargs(ids, mask, pixels), **settings)[:, ids.shape[1]:]
        causal = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, **settings)[:, ids.shape[1]:]
    mine = greedy_token_ids(model, batch, [2], 8, 0)
    assert mine.tolist() == want.tolist()
    assert causal.tolist() != want.tolist()  # the prefill's bidirectional images change the answer
    assert model.language_model.config._attn_implementation == "sdpa"
    items = batch.item_ids.clone()
    items[0, -1] = 9
    ends_in_image = dataclasses.replace(batch, item_ids=items)
    with pytest.raises(ValueError, match="ends with an image token"):
        greedy_token_ids(model, ends_in_image, [2], 2, 0)


def test_pooled_feature_count_and_refusals():
    count = PooledFeatureCount(patch_size=4, pool=2)
    assert count((32, 32)) == 16 and count((32, 48)) == 24
    with pytest.raises(ValueError, match="downsample = 2 does not divide the 3x3 patch grid of a 12x12 image"):
        count((12, 12))
    with pytest.raises(ValueError, match="smaller than one 4-pixel patch"):
        count((2, 32))
