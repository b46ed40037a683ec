"""plait attention inside HF causal LMs vs the same models with HF attention and an explicit dense mask."""

from __future__ import annotations

import pytest
import torch
from attn_cases import brute_mask, random_info
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from plait.attention.interface import (
    plait_attention,
    plait_attention_forward,
    register_plait_attention,
    use_plait_attention,
)
from plait.attention.masks import MaskInfo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = dict(rtol=1e-5, atol=1e-5)
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**SMALL))
    return model.eval()


def _reference_logits(model, ids, info, impl: str):
    """HF's own attention with the 4-D mask of the brute-force semantics (additive for eager)."""
    model.set_attn_implementation(impl)
    mask = brute_mask(info)[:, None]
    if impl == "eager":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return model(input_ids=ids, attention_mask=mask, position_ids=info.positions).logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["causal", "bidirectional_items"])
def test_logits_match_hf_with_dense_mask(kind, mode):
    model = _model(kind)
    info = random_info(7, 2, 37, mode, max_pad=5, max_docs=3)
    ids = torch.randint(0, SMALL["vocab_size"], info.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_eager = _reference_logits(model, ids, info, "eager")
        ref_sdpa = _reference_logits(model, ids, info, "sdpa")
        for backend in ("flex", "sdpa"):
            use_plait_attention(model, backend)
            got = model(input_ids=ids, position_ids=info.positions, plait_mask=info).logits
            assert not got.isnan().any()
            torch.testing.assert_close(got, ref_eager, **TOL)
            torch.testing.assert_close(got, ref_sdpa, **TOL)


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_gradients_match_eager_reference(backend):
    model = _model("llama")
    model.train()
    info = random_info(3, 2, 29, "bidirectional_items")
    ids = torch.randint(0, SMALL["vocab_size"], info.shape, generator=torch.Generator().manual_seed(2))
    _reference_logits(model, ids, info, "eager").square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    use_plait_attention(model, backend)  # flex on CPU with gradients runs the SDPA path
    model(input_ids=ids, position_ids=info.positions, plait_mask=info).logits.square().mean().backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref[name], **TOL, msg=name)


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_single_causal_document_equals_default_attention(backend):
    model = _model("qwen2")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids).logits
        use_plait_attention(model, backend)
        info = MaskInfo.from_padding(None, shape=(2, 33))
        torch.testing.assert_close(model(input_ids=ids, plait_mask=info).logits, ref, **TOL)
        torch.testing.assert_close(model(input_ids=ids).logits, ref, **TOL)  # no plait_mask: causal


def test_padding_mask_without_plait_mask():
    model = _model("llama")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(4))
    pad = torch.ones(2, 20, dtype=torch.long)
    pad[1, 14:] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, attention_mask=pad).logits
        use_plait_attention(model, "sdpa")
        got = model(input_ids=ids, attention_mask=pad).logits
    assert not got.isnan().any()
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1, :14], ref[1, :14], **TOL)


def _math_attention(q, k, v, mask):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_query_subset_and_small_chunks_match_math(backend):
    info = random_info(9, 2, 45, "bidirectional_items", max_docs=4)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 45, 8, generator=gen) for h in (4, 2, 2))
    subset = torch.tensor([0, 3, 4, 5, 17, 30, 31, 44]).expand(2, -1)
    ref = _math_attention(q, k, v, brute_mask(info))
    with torch.no_grad():
        got = plait_attention(q[:, :, subset[0]], k, v, info, q_global=subset, backend=backend, chunk=3)
        full = plait_attention(q, k, v, info, backend=backend, chunk=7)
    torch.testing.assert_close(got, ref[:, :, subset[0]], **TOL)
    torch.testing.assert_close(full, ref, **TOL)


def test_config_registration_and_errors():
    register_plait_attention()
    config = LlamaConfig(**SMALL)
    assert use_plait_attention(config, "sdpa") == "plait_sdpa"
    assert LlamaForCausalLM(config).config._attn_implementation == "plait_sdpa"
    with pytest.raises(ValueError, match="backend"):
        use_plait_attention(config, "flash")
    with pytest.raises(ValueError, match="PreTrainedModel"):
        use_plait_attention(object())
    q = torch.zeros(1, 2, 4, 8)
    info = MaskInfo.from_padding(None, shape=(1, 4))
    with pytest.raises(ValueError, match="softcap"):
        plait_attention_forward(torch.nn.Module(), q, q, q, None, softcap=2.0, plait_mask=info)
    with pytest.raises(ValueError, match="covers"):
        plait_attention(q, q, q, MaskInfo.from_padding(None, shape=(1, 5)))
    with pytest.raises(ValueError, match="dropout"):
        plait_attention(q, q, q, info, backend="flex", dropout=0.1)


def test_resolve_implementation_picks_hf_only_when_it_suffices():
    from plait.attention.interface import resolve_implementation

    assert resolve_implementation("auto", "causal", False, 1, "cpu") == "hf"
    assert resolve_implementation("auto", "causal", False, 1, "cuda") == "hf"
    assert resolve_implementation("auto", "causal", True, 1, "cpu") == "plait_sdpa"  # packing needs documents
    assert resolve_implementation("auto", "causal", False, 2, "cuda") == "plait"  # context parallelism
    assert resolve_implementation("auto", "bidirectional_items", False, 1, "cpu") == "plait_sdpa"
    assert resolve_implementation("plait", "causal", False, 1, "cpu") == "plait"
    assert resolve_implementation("hf", "bidirectional_items", True, 1, "cuda") == "hf"
