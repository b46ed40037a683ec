"""The Qwen3-Omni-MoE recipe (configs/recipes/qwen3_omni_moe.toml: LoRA) trains two steps from a tiny thinker brought
in by ``plait import`` on a clip (a video with its audio track) and an image record: only the LLM's adapters change,
both towers stay as imported; ``plait export --format qwen3_omni_moe`` gives a thinker that transformers loads, whose
untrained tensors are the imported ones bit for bit, and that answers the clip as plait's model does."""

from __future__ import annotations

import json

import torch

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.commands.train import train_command
from plait.config.loader import load_config
from plait.data.collate import collate
from plait.data.sources import RawSample
from plait.models.generation import Generator, greedy_token_ids
from plait.models.hf_io_omni import load_thinker
from plait.models.registry import build_processor
from tests.helpers.jobs import ROOT, demo_records, write_jsonl
from tests.helpers.qwen2_5_omni import write_clip
from tests.helpers.qwen3_omni_moe import save_thinker

RECIPE = ROOT / "configs" / "recipes" / "qwen3_omni_moe.toml"
SMALL = ["--train.steps=2", "--train.global_batch_size=2", "--train.microbatch_size=1", "--train.warmup_steps=0",
         "--train.threads=1", "--train.device=cpu", "--data.num_workers=0", "--data.max_length=512",
         "--train.activation_checkpointing=none", "--metrics.progress=false", "--metrics.tensorboard=false",
         "--checkpoint.every=0"]
CLIP = "<|vision_start|><|audio_start|><|video_pad|><|audio_end|><|vision_end|>"


def _weights(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_the_recipe_trains_from_an_import_and_exports(tmp_path):
    src = save_thinker(tmp_path / "thinker")
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    assert load_config(job).model.encoders["vision"].video.placeholder == "<|video_pad|>"
    clip = write_clip(tmp_path / "clip.mkv", 6, rate=2, audio_s=3.0)
    image = demo_records("train", ("image_digit",), limit=1)[0]
    image["messages"][0]["content"] = image["messages"][0]["content"].replace(
        "<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    record = {"id": "clip-0", "task": "clip", "videos": [str(clip)],
              "messages": [{"role": "user", "content": f"{CLIP}What is heard?"},
                           {"role": "assistant", "content": "a tone"}]}
    data = write_jsonl(tmp_path / "train.jsonl", [record, image])
    paths = [f"--model.pretrained={model_dir}", f"--data.train={data}"]
    run = tmp_path / "run"
    assert train_command(RECIPE, [*SMALL, f"--metrics.run_dir={run}", *paths]) == 0
    final = run / "final"
    assert json.loads((final / "plait_config.json").read_text())["lora"]["llm"]["r"] == 16
    before = _weights(model_dir / "llm")
    changed = [k for k, v in _weights(final / "llm").items() if not torch.equal(before[k], v)]
    assert not changed, changed[:6]  # LoRA trains adapters only
    for branch in ("vision", "audio"):
        tower = f"encoders/{branch}/encoder"
        assert all(torch.equal(a, _weights(final / tower)[k]) for k, a in _weights(model_dir / tower).items())

    out = export_checkpoint(run, "qwen3_omni_moe", tmp_path / "exported")
    hf = load_thinker(out)
    assert type(hf).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    left, right = _weights(src), _weights(out)
    assert sorted(left) == sorted(right)
    towers = [k for k in left if k.startswith(("visual.", "audio_tower."))]
    assert towers and all(torch.equal(left[k], right[k]) for k in towers)
    experts = [k for k in left if ".experts." in k]  # LoRA adapts the attention: the experts stay as imported
    assert experts and all(torch.equal(left[k], right[k]) for k in experts)

    gen = Generator.from_pretrained(final, device="cpu", dtype="fp32")
    processor = build_processor(load_config(RECIPE, paths).model, gen.model, gen.tokenizer, 512)
    raw = RawSample("clip-0", "clip", tuple(record["messages"]), {"video": tuple(record["videos"])}, "train.jsonl:1")
    batch = collate([processor(raw, prompt_only=True)], processor.pad_id)
    mine = greedy_token_ids(gen.model, batch, gen.stop_ids, 4, processor.pad_id)[0].tolist()
    vision, audio = batch.modality_inputs["vision"], batch.modality_inputs["audio"]
    frames = -(-audio["num_samples"] // 160)
    inputs = dict(input_ids=torch.where(batch.item_ids == 0, hf.config.video_token_id, batch.input_ids),
                  attention_mask=batch.attention_mask, pixel_values_videos=vision["pixel_values"][0],
                  video_grid_thw=vision["image_grid_thw"][0][None], video_second_per_grid=torch.tensor([1.0]),
                  input_features=audio["input_features"],
                  feature_attention_mask=(torch.arange(audio["input_features"].shape[-1])[None]
                                          < frames[:, None]).long(), use_audio_in_video=True)
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    assert theirs[0, batch.input_ids.shape[1]:].tolist() == mine and len(mine) >= 1
