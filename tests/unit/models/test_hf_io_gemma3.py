"""Gemma 3 in and out of plait: ``plait import`` of a tiny saved ``Gemma3ForConditionalGeneration`` with its
``Gemma3Processor`` (``Gemma3ImageProcessorPil``, a tokenizer with Gemma's named image tokens) writes the SigLIP branch
(``post_norm``, 2x2 pooling, ``gemma3`` projector) and a job with the ``bidirectional_items`` mask; ``plait export``
gives back every tensor bit for bit (fp32 untied, bf16 tied), a config and processor transformers loads, and the
exported model, fed by its own processor, generates the tokens ``plait generate``'s decoding gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.config.loader import load_config
from plait.data.collate import collate
from plait.models.generation import Generator, Prompt, greedy_token_ids
from tests.helpers.gemma3 import save_gemma3
from tests.helpers.safetensors_files import assert_same_tensors

ITEM = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"
"""One image as Gemma3Processor expands ``<start_of_image>`` (the soft token is plait's placeholder)."""


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_import_export_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src = save_gemma3(tmp_path / "src", dtype=dtype, tied=tied)
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    settings = json.loads((model_dir / "plait_config.json").read_text())
    theirs = json.loads((src / "config.json").read_text())
    assert settings["placeholder_ids"] == {"vision": theirs["image_token_index"]}
    assert {k: settings["encoders"]["vision"][k] for k in ("select", "downsample", "projector", "feature_layer")} \
        == {"select": "post_norm", "downsample": 2, "projector": "gemma3", "feature_layer": -1}
    assert load_config(job).attention.mask == "bidirectional_items"
    out = export_checkpoint(model_dir, "gemma3", tmp_path / "exported")
    assert_same_tensors(src, out)
    mine = json.loads((out / "config.json").read_text())
    fields = ("image_token_index", "boi_token_index", "eoi_token_index", "mm_tokens_per_image", "tie_word_embeddings")
    assert {k: mine[k] for k in fields} == {k: theirs[k] for k in fields}
    text = ("model_type", "hidden_size", "num_hidden_layers", "layer_types", "sliding_window", "vocab_size")
    assert {k: mine["text_config"][k] for k in text} == {k: theirs["text_config"][k] for k in text}
    hf = T.Gemma3ForConditionalGeneration.from_pretrained(str(out))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied
    processor = T.AutoProcessor.from_pretrained(str(out))
    assert isinstance(processor, T.Gemma3Processor) and processor.image_seq_length == 16


def test_exported_model_generates_plait_tokens(tmp_path):
    src = save_gemma3(tmp_path / "src")
    model_dir, _ = import_checkpoint(src, tmp_path / "imported")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(40, 60), (50, 30)]):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    prompt = Prompt.from_text(f"first{ITEM}then{ITEM}What is it?", images=paths,
                              placeholders={"image": "<image_soft_token>"})
    batch = collate(gen.process([prompt]), gen.processor.pad_id, padding_side="left")
    assert int((batch.item_ids[0] >= 0).sum()) == 32  # two images of 16 soft tokens each
    plait_new = greedy_token_ids(gen.model, batch, gen.stop_ids, 8, gen.processor.pad_id)[0].tolist()

    out = export_checkpoint(model_dir, "gemma3", tmp_path / "exported")
    processor = T.AutoProcessor.from_pretrained(str(out))
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "first<start_of_image>then<start_of_image>What is it?"}], tokenize=False,
        add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.open(p).convert("RGB") for p in paths]], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == batch.input_ids[0].tolist()
    hf = T.Gemma3ForConditionalGeneration.from_pretrained(str(out)).eval()
    with torch.no_grad():
        hf_out = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    assert hf_out[0, inputs["input_ids"].shape[1]:].tolist() == plait_new and len(plait_new) >= 1
