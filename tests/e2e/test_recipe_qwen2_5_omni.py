"""The Qwen2.5-Omni recipes (configs/recipes/qwen2_5_omni.toml: LoRA; qwen2_5_omni_full.toml: the whole LLM) train two
steps from a tiny imported thinker on clips (a video with its audio track) and an image record: LoRA changes only its
adapters, the full recipe the LLM's weights, both towers stay as imported; the LoRA run exports as a thinker that
transformers loads and that answers the clip as plait's model does; a prompt without placeholders gets the clip
wrapped as the records write it."""

from __future__ import annotations

import json

import torch

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.commands.train import train_command
from plait.data.collate import collate
from plait.models.generation import Generator, greedy_token_ids
from plait.models.hf_io_omni import load_thinker
from tests.helpers.jobs import ROOT, demo_records, write_jsonl
from tests.helpers.qwen2_5_omni import CLIP_TEXT, save_thinker, write_clip

RECIPES = ROOT / "configs" / "recipes"
SMALL = ["--train.steps=2", "--train.global_batch_size=2", "--train.microbatch_size=1", "--train.warmup_steps=0",
         "--train.threads=1", "--train.device=cpu", "--data.num_workers=0", "--data.max_length=512",
         "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.every=0"]


def _data(tmp_path):
    clip = write_clip(tmp_path / "clip.mkv", 6, rate=2, audio_s=3.0)
    image = demo_records("train", ("image_digit",), limit=1)[0]
    image["messages"][0]["content"] = image["messages"][0]["content"].replace(
        "<image>", "<|vision_bos|><|IMAGE|><|vision_eos|>")
    record = {"id": "clip-0", "task": "clip", "videos": [str(clip)],
              "messages": [{"role": "user", "content": f"{CLIP_TEXT}What is heard?"},
                           {"role": "assistant", "content": "a tone"}]}
    return write_jsonl(tmp_path / "train.jsonl", [record, image]), record


def _weights(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_omni_recipes_train_from_an_import_and_export(tmp_path):
    model_dir, _ = import_checkpoint(save_thinker(tmp_path / "thinker"), tmp_path / "imported")
    data, record = _data(tmp_path)
    paths = [f"--model.pretrained={model_dir}", f"--data.train={data}"]
    runs = {}
    for recipe in ("qwen2_5_omni.toml", "qwen2_5_omni_full.toml"):
        run = tmp_path / recipe.removesuffix(".toml")
        assert train_command(RECIPES / recipe, [*SMALL, f"--metrics.run_dir={run}", *paths]) == 0
        runs[recipe] = run / "final"
    lora, full = runs["qwen2_5_omni.toml"], runs["qwen2_5_omni_full.toml"]
    assert json.loads((lora / "plait_config.json").read_text())["lora"]["llm"]["r"] == 16
    before = _weights(model_dir / "llm")
    assert all(torch.equal(before[k], v) for k, v in _weights(lora / "llm").items())  # the base: LoRA trains adapters
    assert any(not torch.equal(before[k], v) for k, v in _weights(full / "llm").items())
    for final in (lora, full):
        for branch in ("vision", "audio"):
            tower = f"encoders/{branch}/encoder"
            assert _weights(model_dir / tower).keys() == _weights(final / tower).keys()
            assert all(torch.equal(a, _weights(final / tower)[k]) for k, a in _weights(model_dir / tower).items())
    out = export_checkpoint(lora.parent, "qwen2_5_omni", tmp_path / "exported")
    hf = load_thinker(out)
    gen = Generator.from_pretrained(lora, device="cpu", dtype="fp32")
    from plait.data.sources import RawSample
    from plait.config.loader import load_config
    from plait.models.registry import build_processor

    cfg = load_config(RECIPES / "qwen2_5_omni.toml", paths)
    processor = build_processor(cfg.model, gen.model, gen.tokenizer, 512)
    raw = RawSample("clip-0", "clip", tuple(record["messages"]), {"video": tuple(record["videos"])}, "train.jsonl:1")
    batch = collate([processor(raw, prompt_only=True)], processor.pad_id)
    mine = greedy_token_ids(gen.model, batch, gen.stop_ids, 4, processor.pad_id)[0].tolist()
    vision, audio = batch.modality_inputs["vision"], batch.modality_inputs["audio"]
    video_id = hf.config.video_token_id
    frames = -(-audio["num_samples"] // 160)
    inputs = dict(input_ids=torch.where(batch.item_ids == 0, video_id, batch.input_ids),
                  attention_mask=batch.attention_mask, pixel_values_videos=vision["pixel_values"][0],
                  video_grid_thw=vision["image_grid_thw"][0][None], video_second_per_grid=torch.tensor([1.0]),
                  input_features=audio["input_features"],
                  feature_attention_mask=(torch.arange(audio["input_features"].shape[-1])[None]
                                          < frames[:, None]).long(), use_audio_in_video=True)
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    assert theirs[0, batch.input_ids.shape[1]:].tolist() == mine and len(mine) >= 1
    # plait generate --video clip --prompt text: the clip wrapped as the records write it, its audio track in
    from plait.commands.generate import prompt_sample

    auto = gen.processor(prompt_sample(gen, "What is heard?", videos=record["videos"]), prompt_only=True)
    written = RawSample("w", "t", ({"role": "user", "content": f"{CLIP_TEXT}\nWhat is heard?"},
                                   {"role": "assistant", "content": ""}), {"video": tuple(record["videos"])}, "-")
    assert torch.equal(auto.input_ids, gen.processor(written, prompt_only=True).input_ids)
    assert [b for b, _ in auto.meta.items] == ["vision", "audio"]
