"""Qwen3-VL as a plait composite (``plait.models.families.qwen3_vl``, ``plait.models.deepstack``): the composite built
from a tiny ``Qwen3VLForConditionalGeneration`` gives the HF model's logits (fp32, 1e-5) with plait's own M-RoPE
positions on one image, on rows with several images of different grids (padded batch), and on a video (each
temporal patch one item after its timestamp, as Qwen3-VL writes videos); without the DeepStack additions the logits
differ; a context-parallel shard (``token_index``) gets the shard's additions; greedy decoding gives ``generate``'s
tokens on left-padded prompts."""

from __future__ import annotations

import pytest
import torch

from plait.data.collate import Batch
from plait.models.deepstack import DEEPSTACK_KWARG
from plait.models.families.qwen3_vl import Qwen3VLTextForCausalLM
from plait.models.generation import greedy_token_ids
from plait.models.hf_io import HF_FORMATS, composite_from_hf
from tests.helpers.qwen3_vl import rows, tiny_qwen3_vl

LAYOUTS = {
    "one image": [[("image", (1, 4, 6))]],
    "images": [[("image", (1, 4, 4)), ("image", (1, 6, 4))], [("image", (1, 4, 6))]],
    "video": [[("image", (1, 4, 4)), ("video", (2, 4, 6))]],
}


def _composite(seed: int = 0):
    return composite_from_hf(tiny_qwen3_vl(seed), HF_FORMATS["qwen3_vl"]).eval()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_hf_with_deepstack_and_mrope(layout):
    hf, model = tiny_qwen3_vl(), _composite()
    assert isinstance(model.language_model, Qwen3VLTextForCausalLM) and model.deepstack_layers == 2
    r = rows(LAYOUTS[layout])
    real = r.attention_mask.bool()
    with torch.no_grad():
        want = hf(**r.hf).logits
        mine = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        feats = model.encode_all(r.modality_inputs)
        assert feats["vision"].shape[1] == 3 * 48  # merged feature + 2 DeepStack features per visual token
        plain = model.language_model(inputs_embeds=model.place_features(r.plait_ids, feats),
                                     attention_mask=r.attention_mask, position_ids=r.rope).logits
    torch.testing.assert_close(mine[real], want[real], rtol=1e-5, atol=1e-5)
    assert (plain - want)[real].abs().max() > 1e-3  # the DeepStack additions matter


def test_a_context_parallel_shard_gets_its_tokens_additions():
    """With ``token_index`` the LLM runs on those tokens only, with their DeepStack additions: a prefix of the row
    (causal attention) gives the full row's logits of the prefix."""
    model = _composite()
    r = rows([[("image", (1, 4, 4)), ("image", (1, 6, 4))]])
    prefix = torch.arange(12)  # through the first image and into the second
    with torch.no_grad():
        full = model(r.plait_ids, r.modality_inputs, None, r.positions, rope_position_ids=r.rope)
        shard = model(r.plait_ids, r.modality_inputs, None, r.positions[:, prefix], token_index=prefix,
                      rope_position_ids=r.rope)
        extras = model.deepstack(r.plait_ids, model.encode_all(r.modality_inputs))[DEEPSTACK_KWARG]
    torch.testing.assert_close(shard, full[:, prefix], rtol=1e-5, atol=1e-5)
    assert len(extras.dense) == 2 and extras.dense[0].shape == (1, r.plait_ids.shape[1], 48)
    visual = (r.plait_ids == 7).unsqueeze(-1)
    assert bool((extras.dense[0].ne(0) <= visual).all()) and bool(extras.dense[1][visual.expand_as(extras.dense[1])]
                                                                   .ne(0).any())  # on the visual tokens only


def test_greedy_tokens_equal_hf_generate():
    r = rows([[("image", (1, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 4, 4))]], seed=4, left=True)
    hf, model = tiny_qwen3_vl(), _composite()
    empty = {f: None for f in Batch.__dataclass_fields__}
    batch = Batch(**(empty | dict(input_ids=r.plait_ids, attention_mask=r.attention_mask, position_ids=r.positions,
                                  rope_position_ids=r.rope, item_ids=r.item_ids,
                                  modality_inputs=r.modality_inputs)))
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**r.hf, **settings)[:, r.input_ids.shape[1]:]
    mine = greedy_token_ids(model, batch, [2], 8, 0)
    assert mine.tolist() == want.tolist() and mine.shape[1] >= 2
    model.deepstack_layers = 0  # the same decoding without the DeepStack additions answers otherwise
    assert greedy_token_ids(model, batch, [2], 8, 0).tolist() != want.tolist()
