"""Qwen3-VL in and out of plait: ``plait import`` of a saved tiny ``Qwen3VLForConditionalGeneration`` (with its
processor's files: ``Qwen2VLImageProcessorPil``, tokenizer, chat template) then ``plait export --format qwen3_vl``
gives every tensor back bit for bit (fp32, bf16 tied), the config's token ids and the image processor; the exported
folder loads in transformers and its ``generate`` gives the tokens plait's composite loaded from the import decodes
greedily (DeepStack and M-RoPE included)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.data.collate import Batch
from plait.models.generation import greedy_token_ids
from plait.models.multimodal import MultimodalModel
from tests.helpers.qwen3_vl import END, IMAGE, START, VIDEO, rows, save_qwen3_vl
from tests.helpers.safetensors_files import assert_same_tensors


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_import_export_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src = save_qwen3_vl(tmp_path / "src", dtype=dtype, tied=tied)
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    settings = json.loads((model_dir / "plait_config.json").read_text())
    theirs = json.loads((src / "config.json").read_text())
    assert settings["placeholder_ids"] == {"vision": theirs["image_token_id"]}
    assert "--format qwen3_vl" in job.read_text()
    out = export_checkpoint(model_dir, "qwen3_vl", tmp_path / "exported")
    assert_same_tensors(src, out)
    mine = json.loads((out / "config.json").read_text())
    fields = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    assert {k: mine[k] for k in fields} == {k: theirs[k] for k in fields}
    vision = ("depth", "out_hidden_size", "deepstack_visual_indexes", "num_position_embeddings")
    assert {k: mine["vision_config"][k] for k in vision} == {k: theirs["vision_config"][k] for k in vision}
    assert mine["text_config"]["rope_parameters"] == theirs["text_config"]["rope_parameters"]
    assert T.AutoImageProcessor.from_pretrained(str(out)).to_dict() == \
        T.AutoImageProcessor.from_pretrained(str(src)).to_dict()
    assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    hf = T.Qwen3VLForConditionalGeneration.from_pretrained(str(out))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied


def test_export_generates_plaits_tokens(tmp_path):
    src = save_qwen3_vl(tmp_path / "src")
    model_dir, _ = import_checkpoint(src, tmp_path / "imported")
    out = export_checkpoint(model_dir, "qwen3_vl", tmp_path / "exported")
    hf = T.Qwen3VLForConditionalGeneration.from_pretrained(str(out)).eval()
    cfg = hf.config
    ids = {IMAGE: cfg.image_token_id, VIDEO: cfg.video_token_id, START: cfg.vision_start_token_id,
           END: cfg.vision_end_token_id}
    r = rows([[("image", (1, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 4, 4))]], seed=4, left=True)

    def mapped(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        for mine, theirs in ids.items():
            out[t == mine] = theirs
        return out

    model = MultimodalModel.from_pretrained(model_dir).eval()
    empty = {f: None for f in Batch.__dataclass_fields__}
    batch = Batch(**(empty | dict(input_ids=mapped(r.plait_ids), attention_mask=r.attention_mask,
                                  position_ids=r.positions, rope_position_ids=r.rope, item_ids=r.item_ids,
                                  modality_inputs=r.modality_inputs)))
    mine = greedy_token_ids(model, batch, [2], 6, 0)
    inputs = dict(r.hf, input_ids=mapped(r.input_ids))
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    assert mine.tolist() == want[:, r.input_ids.shape[1]:].tolist() and mine.shape[1] >= 2
