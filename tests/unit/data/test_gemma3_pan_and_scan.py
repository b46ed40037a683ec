"""Gemma 3's pan-and-scan crops through plait's data path (:mod:`plait.data.pan_and_scan`): a job on an imported tiny
Gemma 3 with ``do_pan_and_scan = true`` in its processor table turns an elongated image into the original and its
crops, each one image item with ``Gemma3Processor``'s text between them: the token ids equal the processor's with
``do_pan_and_scan=True``, the logits equal ``Gemma3ForConditionalGeneration`` fed by that processor (fp32, 1e-5),
greedy tokens equal its ``generate``, the metadata pass counts the same tokens from the header, and a small square
image stays one image."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from plait.attention.interface import use_plait_attention
from plait.attention.masks import MaskInfo
from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.config.loader import load_config
from plait.config.schema import EncoderConfig
from plait.data.collate import collate
from plait.data.pan_and_scan import PanAndScan
from plait.data.record_metadata import record_metadata
from plait.data.sources import RawSample, SampleError
from plait.models.generation import Generator, greedy_token_ids
from plait.models.registry import build_processor
from tests.helpers.gemma3 import TOKENS, save_gemma3

ITEM = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"
CROP = 8
"""``pan_and_scan_min_crop_size`` for the tiny images (Gemma 3 ships 256)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pas")
    model_dir, job = import_checkpoint(save_gemma3(tmp / "src"), tmp / "imported")
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    cfg = load_config(job).model
    enc = cfg.encoders.get("vision") or EncoderConfig(modality="image")
    enc = dataclasses.replace(enc, processor={"do_pan_and_scan": True, "pan_and_scan_min_crop_size": CROP})
    cfg = dataclasses.replace(cfg, encoders={**cfg.encoders, "vision": enc})
    processor = build_processor(cfg, gen.model, gen.processor.tokenizer, 512)
    out = export_checkpoint(model_dir, "gemma3", tmp / "exported")
    hf = T.Gemma3ForConditionalGeneration.from_pretrained(str(out)).eval()
    rng = np.random.default_rng(0)
    paths = {}
    for name, (h, w) in {"wide": (24, 80), "square": (32, 32)}.items():
        paths[name] = str(tmp / f"{name}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[name])
    return gen, processor, T.AutoProcessor.from_pretrained(str(out)), hf, paths


def _record(images: list[str], text: str) -> RawSample:
    return RawSample("r0", "t", ({"role": "user", "content": text}, {"role": "assistant", "content": "A cat."}),
                     {"image": tuple(images)}, "data.jsonl:1")


def test_crops_equal_gemma3_processor_logits_and_generate(setup):
    gen, processor, hf_processor, hf, paths = setup
    raw = _record([paths["square"], paths["wide"]], f"first{ITEM}then{ITEM}What is it?")
    sample = processor(raw, prompt_only=True)
    # the square image stays one; the 80x24 one gets round(80/24) = 3 crops: 5 items of 16 soft tokens
    assert sample.meta.items == (("vision", TOKENS),) * 5
    assert processor.crops.count(80, 24) == 3 and processor.crops.count(32, 32) == 0

    text = hf_processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "first<start_of_image>then<start_of_image>What is it?"}], tokenize=False,
        add_generation_prompt=True)
    images = [[Image.open(p).convert("RGB") for p in (paths["square"], paths["wide"])]]
    inputs = hf_processor(text=[text], images=images, return_tensors="pt", do_pan_and_scan=True,
                          pan_and_scan_min_crop_size=CROP)
    assert sample.input_ids.tolist() == inputs["input_ids"][0].tolist()
    assert "Here is the original image" in hf_processor.tokenizer.decode(sample.input_ids)
    assert len(sample.inputs["vision"]) == inputs["pixel_values"].shape[0] == 5
    torch.testing.assert_close(torch.stack([i["pixel_values"] for i in sample.inputs["vision"]]),
                               inputs["pixel_values"], rtol=0, atol=0)

    batch = collate([sample], processor.pad_id, padding_side="left")
    info = MaskInfo(batch.document_ids, batch.item_ids, batch.position_ids, "bidirectional_items")
    assert int(batch.item_ids.max()) == 4  # each original and crop is its own bidirectional block
    llm = gen.model.language_model
    with torch.no_grad():
        want = hf(**inputs).logits[0]
        use_plait_attention(llm, "sdpa")  # the mask from plait's item metadata
        mine = gen.model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                         plait_mask=info)[0]
        llm.set_attn_implementation("sdpa")  # as plait generate loads it: its prefill switches
        hf_new = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=gen.stop_ids,
                             pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
    assert greedy_token_ids(gen.model, batch, gen.stop_ids, 6, processor.pad_id)[0].tolist() == hf_new


@pytest.mark.parametrize("prompt_only", [False, True])
def test_metadata_counts_crops_from_the_header(setup, prompt_only):
    _, processor, _, _, paths = setup
    raw = _record([paths["wide"], paths["square"]], f"a{ITEM}b{ITEM}c")
    meta = record_metadata(processor, raw, prompt_only=prompt_only)
    assert meta == processor(raw, prompt_only=prompt_only).meta
    assert meta.items == (("vision", TOKENS),) * 5


def test_small_image_stays_one_and_unwritten_block_is_refused(setup):
    _, processor, _, _, paths = setup
    sample = processor(_record([paths["square"]], f"x{ITEM}y"))
    assert sample.meta.items == (("vision", TOKENS),)
    assert "Here is" not in processor.tokenizer.decode(sample.input_ids)
    with pytest.raises(SampleError, match=r"record 'r0' .*wide.png has 3 pan-and-scan crops but its placeholder"):
        processor(_record([paths["wide"]], "x<image_soft_token>y"))


def test_pan_and_scan_needs_gemma3_processor_and_image_tokens():
    spec = types.SimpleNamespace(encoder="vision", placeholder="<image_soft_token>",
                                 hf_processor=types.SimpleNamespace(do_pan_and_scan=True))
    tok = types.SimpleNamespace(boi_token="<start_of_image>", eoi_token="<end_of_image>")
    with pytest.raises(ValueError, match="model.encoders.vision.processor.do_pan_and_scan: SimpleNamespace does not"):
        PanAndScan.of(tok, spec)
    spec.hf_processor = T.Gemma3ImageProcessorPil(do_pan_and_scan=True)
    with pytest.raises(ValueError, match="the tokenizer names no boi_token/eoi_token"):
        PanAndScan.of(types.SimpleNamespace(), spec)
    crops = PanAndScan.of(tok, spec)  # the unset settings take Gemma3Processor's defaults (min crop 256)
    assert (crops.count(1024, 512), crops.count(500, 500), crops.count(400, 200)) == (2, 0, 0)
    spec.hf_processor = T.Gemma3ImageProcessorPil()
    assert PanAndScan.of(tok, spec) is None
