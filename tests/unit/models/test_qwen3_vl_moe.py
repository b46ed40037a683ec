"""Qwen3-VL-MoE as a plait composite (``plait.models.families.qwen3_vl_moe``): the composite built from a tiny
``Qwen3VLMoeForConditionalGeneration`` (Qwen3-VL tower with DeepStack, 2-layer MoE text model of 4 experts, top-2)
gives the HF model's logits (fp32, 1e-5) with plait's own M-RoPE positions on one image and on rows with several
images (padded batch), and the DeepStack additions matter; greedy decoding gives ``generate``'s tokens on left-padded
prompts; its MoE blocks are what expert parallelism and the router-load measurement find, LoRA's defaults adapt the
attention only, and the planner reads its experts from the config; ``plait import`` then ``plait export --format
qwen3_vl_moe`` gives every tensor back bit for bit (fp32 untied, bf16 tied), and the export loads in transformers and
generates the tokens plait decodes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.data.collate import Batch
from plait.measure.router_load import router_modules
from plait.models.families.qwen3_vl_moe import Qwen3VLMoeTextForCausalLM
from plait.models.generation import greedy_token_ids
from plait.models.hf_io import HF_FORMATS, composite_from_hf
from plait.models.lora import DEFAULT_TARGETS, lora_targets
from plait.models.multimodal import MultimodalModel
from plait.parallel.expert_parallel import experts_modules
from plait.planner.cost.arch import DecoderArch
from tests.helpers.qwen3_vl import END, IMAGE, START, VIDEO, rows
from tests.helpers.qwen3_vl_moe import MOE_TEXT, save_qwen3_vl_moe, tiny_qwen3_vl_moe
from tests.helpers.safetensors_files import assert_same_tensors

LAYOUTS = {
    "one image": [[("image", (1, 4, 6))]],
    "images": [[("image", (1, 4, 4)), ("image", (1, 6, 4))], [("image", (1, 4, 6))]],
    "video": [[("video", (2, 4, 4)), ("image", (1, 4, 4))], [("image", (1, 4, 6))]],
}
PROMPTS = [[("image", (1, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 4, 4))]]


def _batch(r, ids: torch.Tensor) -> Batch:
    empty = {f: None for f in Batch.__dataclass_fields__}
    return Batch(**(empty | dict(input_ids=ids, attention_mask=r.attention_mask, position_ids=r.positions,
                                 rope_position_ids=r.rope, item_ids=r.item_ids, modality_inputs=r.modality_inputs)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_hf_with_deepstack_and_mrope(layout):
    hf = tiny_qwen3_vl_moe()
    model = composite_from_hf(hf, HF_FORMATS["qwen3_vl_moe"]).eval()
    assert isinstance(model.language_model, Qwen3VLMoeTextForCausalLM) and model.deepstack_layers == 2
    r = rows(LAYOUTS[layout])
    real = r.attention_mask.bool()
    with torch.no_grad():
        want = hf(**r.hf).logits
        mine = model(r.plait_ids, r.modality_inputs, r.attention_mask, r.positions, rope_position_ids=r.rope)
        feats = model.encode_all(r.modality_inputs)
        plain = model.language_model(inputs_embeds=model.place_features(r.plait_ids, feats),
                                     attention_mask=r.attention_mask, position_ids=r.rope).logits
    torch.testing.assert_close(mine[real], want[real], rtol=1e-5, atol=1e-5)
    assert (plain - want)[real].abs().max() > 1e-3  # the DeepStack additions matter


def test_greedy_tokens_equal_hf_generate():
    r = rows(PROMPTS, seed=4, left=True)
    hf = tiny_qwen3_vl_moe()
    model = composite_from_hf(tiny_qwen3_vl_moe(), HF_FORMATS["qwen3_vl_moe"]).eval()
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(**r.hf, **settings)[:, r.input_ids.shape[1]:]
    mine = greedy_token_ids(model, _batch(r, r.plait_ids), [2], 8, 0)
    assert mine.tolist() == want.tolist() and mine.shape[1] >= 2


def test_moe_blocks_found_by_expert_parallelism_router_load_lora_and_planner():
    """Every decoder layer's experts (fused ``[E, 2I, H]`` / ``[E, H, I]``) and router are found by their structure;
    LoRA's defaults adapt the attention projections only (the experts are no Linear); the planner counts the LLM's
    parameters and experts from its config as the module holds them."""
    llm = composite_from_hf(tiny_qwen3_vl_moe(), HF_FORMATS["qwen3_vl_moe"]).language_model
    experts = experts_modules(llm)
    assert [n for n, _ in experts] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(tuple(m.gate_up_proj.shape) == (4, 48, 48) and m.num_experts == 4 for _, m in experts)
    assert [n for n, _ in router_modules(llm)] == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    found = lora_targets(llm, DEFAULT_TARGETS[llm.config.model_type])
    assert found == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    arch = DecoderArch.from_config(llm.config.to_dict())
    assert (arch.num_experts, arch.experts_per_token, arch.expert_intermediate) == (4, 2, 24)
    layer = sum(p.numel() for p in llm.model.layers[0].parameters())
    assert arch.layer_params() == layer and arch.layers == MOE_TEXT["num_hidden_layers"]


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_import_export_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src = save_qwen3_vl_moe(tmp_path / "src", dtype=dtype, tied=tied)
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    assert "--format qwen3_vl_moe" in job.read_text()
    out = export_checkpoint(model_dir, "qwen3_vl_moe", tmp_path / "exported")
    assert_same_tensors(src, out)
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out, src))
    fields = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    assert {k: mine[k] for k in fields} == {k: theirs[k] for k in fields}
    text = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "rope_parameters")
    assert {k: mine["text_config"].get(k) for k in text} == {k: theirs["text_config"].get(k) for k in text}
    assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    hf = T.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied


def test_export_generates_plaits_tokens(tmp_path):
    model_dir, _ = import_checkpoint(save_qwen3_vl_moe(tmp_path / "src"), tmp_path / "imported")
    out = export_checkpoint(model_dir, "qwen3_vl_moe", tmp_path / "exported")
    hf = T.Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out)).eval()
    cfg = hf.config
    ids = {IMAGE: cfg.image_token_id, VIDEO: cfg.video_token_id, START: cfg.vision_start_token_id,
           END: cfg.vision_end_token_id}
    r = rows(PROMPTS, seed=4, left=True)

    def mapped(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        for mine, theirs in ids.items():
            out[t == mine] = theirs
        return out

    model = MultimodalModel.from_pretrained(model_dir).eval()
    mine = greedy_token_ids(model, _batch(r, mapped(r.plait_ids)), [2], 6, 0)
    with torch.no_grad():
        want = hf.generate(**dict(r.hf, input_ids=mapped(r.input_ids)), max_new_tokens=6, do_sample=False,
                           eos_token_id=[2], pad_token_id=0)
    assert mine.tolist() == want[:, r.input_ids.shape[1]:].tolist() and mine.shape[1] >= 2
