"""A clip record (a video with its audio track, ``video.audio = true``) written without its thinker's audio start and
end tokens is a bad record: the record's processing refuses it naming the record, its file and line and the field
(``videos[0]``), so ``data.on_error = "skip"`` drops and counts it when its step loads it, for the Qwen3-Omni thinker
as for Qwen2.5-Omni; the thinker's own layout still processes, and a prompt without placeholders gets it. A Qwen3-Omni
prompt's audio clip without a placeholder is written ``<|audio_start|><|audio_pad|><|audio_end|>`` as its processor's
tokens (``audio_bos_token``, ``audio_token``, ``audio_eos_token``) and chat template write it: the thinker's
``get_rope_index`` finds it and gives plait's positions."""

from __future__ import annotations

import json
import wave

import numpy as np
import torch

import pytest

from plait.config.loader import load_config
from plait.data.loader import MultimodalDataset, SampleFeed
from plait.data.sources import SampleError
from plait.models.generation import Generator
from plait.models.registry import build_processor
from tests.helpers.jobs import ROOT
from tests.helpers.qwen2_5_omni import write_clip

CLIP = "<|vision_start|><|audio_start|><|video_pad|><|audio_end|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from plait.commands.import_hf import import_checkpoint
    from tests.helpers.qwen3_omni_moe import save_thinker

    tmp = tmp_path_factory.mktemp("q3")
    model_dir, _ = import_checkpoint(save_thinker(tmp / "thinker"), tmp / "imported")
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    config = load_config(ROOT / "configs" / "recipes" / "qwen3_omni_moe.toml", [f"--model.pretrained={model_dir}"])
    return gen, build_processor(config.model, gen.model, gen.tokenizer, 512), tmp / "thinker"


def test_a_qwen3_omni_clip_without_its_audio_tokens_is_refused_and_skipped(qwen3, tmp_path):
    gen, processor, _ = qwen3
    clip = str(write_clip(tmp_path / "clip.mkv", 6, rate=2, audio_s=3.0))
    rows = [{"id": rid, "videos": [clip], "messages": [{"role": "user", "content": f"{text}What?"},
                                                       {"role": "assistant", "content": "a tone"}]}
            for rid, text in (("ok", CLIP), ("bare", "<|vision_start|><|video_pad|><|vision_end|>"))]
    data = tmp_path / "clips.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = MultimodalDataset(data, processor, on_error="skip", cache_dir=tmp_path / "cache")
    good = dataset.load(0)
    ids = good.input_ids.tolist()
    start = good.item_ids.tolist().index(0)
    wrap = gen.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|audio_start|>", "<|audio_end|>",
                                                "<|vision_end|>"])
    assert ids[start - 2:start] == wrap[:2] and ids[start + 12 + 39:start + 12 + 39 + 2] == wrap[2:]
    assert [n for _, n in good.meta.items] == [12, 39]
    message = (rf"record 'bare' \({data}:2\): videos\[0\] \({clip}\): a video with its audio track is written "
               r"<\|vision_start\|><\|audio_start\|><clip><\|audio_end\|><\|vision_end\|> \(its thinker's layout\), "
               r"found .*<\|vision_start\|><clip><\|vision_end\|>")
    with pytest.raises(SampleError, match=message):
        dataset.load(1)
    loaded = SampleFeed(dataset, [(0, 1)]).next()
    assert sorted(loaded.samples) == [0] and list(loaded.failed) == [1] and "videos[0]" in loaded.failed[1]
    # a prompt without placeholders writes each clip in the thinker's layout
    assert Generator(gen.model, processor).item_texts()["video"] == CLIP


def test_a_qwen3_omni_audio_prompt_is_wrapped_in_its_audio_start_and_end(qwen3, tmp_path):
    """``plait generate --audio a.wav --prompt ...`` on a fresh Qwen3-Omni import: the clip goes in between
    ``<|audio_start|>`` and ``<|audio_end|>`` (it went in bare, ``<|audio_pad|>`` being missing from the wrappers),
    the tokens ``Qwen3OmniMoeProcessor`` takes from Qwen3-Omni's tokenizer (``audio_bos_token``, ``audio_eos_token``)
    and the config ids transformers' ``get_rope_index`` counts audio items by; its positions equal plait's."""
    from plait.commands.generate import prompt_sample
    from plait.data.collate import collate
    from plait.models.hf_io_omni import load_thinker

    gen, _, src = qwen3
    assert gen.item_texts()["audio"] == "<|audio_start|><|audio_pad|><|audio_end|>"
    wav = tmp_path / "tone.wav"
    with wave.open(str(wav), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes((np.sin(np.arange(24000) * 0.05) * 12000).astype(np.int16).tobytes())
    sample = gen.processor(prompt_sample(gen, "What is it?", audios=[str(wav)]), prompt_only=True)
    batch = collate([sample], gen.processor.pad_id)
    hf = load_thinker(src)
    cfg = hf.config
    ids = batch.input_ids[0].tolist()
    first, count = ids.index(cfg.audio_token_id), ids.count(cfg.audio_token_id)
    assert count == sample.meta.items[0][1] > 0
    assert ids[first - 1] == cfg.audio_start_token_id and ids[first + count] == cfg.audio_end_token_id
    lengths = batch.modality_inputs["audio"]["num_samples"] // 160  # mel frames (hop 160): 1.5 s, 150
    want, _ = hf.model.get_rope_index(batch.input_ids, None, None, batch.attention_mask, False, lengths, None)
    mine = batch.rope_position_ids  # None: no item moves a position off the 1-D ones (audio runs on like text)
    mine = batch.position_ids[None].expand(3, -1, -1) if mine is None else mine
    assert torch.equal(mine, want.long())
