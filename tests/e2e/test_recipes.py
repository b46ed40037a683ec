"""Every recipe of configs/recipes/ trains (two steps) on tiny models of the same architectures saved locally, its
paths overridden from the test: LLaVA-1.5 stage 1 (only the projector changes) then stage 2 from stage 1's model
(projector and LLM change, the tower does not; exported as LLaVA), Qwen2-Audio (from an imported checkpoint, LoRA on
the LLM), Qwen2.5-VL (imported, LoRA on its M-RoPE LLM, answers generated, exported), vision + audio (SigLIP,
Whisper, Qwen2), and Qwen3-VL, Gemma 3 and Qwen3-VL-MoE (imported, LoRA on the LLM, exported: the adapters merged into
it; Qwen3-VL-MoE's experts unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from plait.commands.export_hf import export_checkpoint
from plait.commands.import_hf import import_checkpoint
from plait.commands.train import train_command
from plait.config.loader import load_config
from plait.models.multimodal import MultimodalModel
from tests.helpers.jobs import ROOT, demo_records, write_jsonl
from tests.unit.commands.tiny_hf_checkpoints import (save_clip, save_llm, save_qwen2_5_vl, save_qwen2_audio,
                                                     save_siglip, save_whisper)

RECIPES = ROOT / "configs" / "recipes"
SMALL = ["--train.steps=2", "--train.global_batch_size=4", "--train.microbatch_size=2", "--train.warmup_steps=0",
         "--train.threads=1", "--train.device=cpu", "--data.num_workers=0", "--data.max_length=256",
         "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.every=0"]


def _train(recipe: str, run: Path, *overrides: str) -> Path:
    assert train_command(RECIPES / recipe, [*SMALL, f"--metrics.run_dir={run}", *overrides]) == 0
    return run / "final"


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    assert sorted(before) == sorted(after)
    return {k for k in before if not torch.equal(before[k], after[k])}


def _llava_json(path: Path, records: list[dict]) -> Path:
    rows = [{"id": r["id"], "image": r["images"][0],
             "conversations": [{"from": "human", "value": r["messages"][0]["content"]},
                               {"from": "gpt", "value": r["messages"][1]["content"]}]} for r in records]
    path.write_text(json.dumps(rows))
    return path


def test_every_recipe_loads():
    for recipe in sorted(RECIPES.glob("*.toml")):
        load_config(recipe)  # fields and values valid (paths are checked when a job builds)
    assert {p.name for p in RECIPES.glob("*.toml")} == {"llava15_stage1.toml", "llava15_stage2.toml", "qwen2_audio.toml",
                                                        "qwen2_5_vl.toml", "vision_audio.toml", "qwen2_5_omni.toml",
                                                        "qwen2_5_omni_full.toml", "gemma3.toml", "qwen3_vl.toml",
                                                        "voxtral.toml", "qwen3_vl_moe.toml",
                                                        "qwen3_omni_moe.toml"}


def test_qwen3_vl_moe_recipe_reads_videos_as_qwen3_vl_does():
    """Both recipes share Qwen3-VL's vision tower, so both take a record's videos with its video token and fps."""
    dense = load_config(RECIPES / "qwen3_vl.toml").model.encoders["vision"].video
    moe = load_config(RECIPES / "qwen3_vl_moe.toml").model.encoders["vision"].video
    assert (moe.placeholder, moe.fps) == ("<|video_pad|>", 2.0)
    assert moe == dense


def test_llava15_stages_train_and_export(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes name configs/recipes/vicuna_v1.jinja from the repository root
    llm, clip = save_llm(tmp_path / "vicuna"), save_clip(tmp_path / "clip")
    data = _llava_json(tmp_path / "pretrain.json", demo_records("train", ("image_digit",), limit=4))
    paths = [f"--model.llm.path={llm}", f"--model.encoders.vision.path={clip}", f"--data.train={data}"]
    stage1 = _train("llava15_stage1.toml", tmp_path / "stage1", *paths)
    assert _changed(_weights(llm), _weights(stage1 / "llm")) == set()
    assert _changed(_weights(clip), _weights(stage1 / "encoders/vision/encoder")) == set()
    before = load_file(str(stage1 / "encoders/vision/projector.safetensors"))
    stage2 = _train("llava15_stage2.toml", tmp_path / "stage2", f"--model.pretrained={stage1}", f"--data.train={data}")
    assert _changed(_weights(stage1 / "llm"), _weights(stage2 / "llm"))
    assert _changed(_weights(clip), _weights(stage2 / "encoders/vision/encoder")) == set()
    assert _changed(before, load_file(str(stage2 / "encoders/vision/projector.safetensors"))) == set(before)
    text = (stage2 / "tokenizer" / "chat_template.jinja").read_text()
    assert "A chat between a curious human" in text  # the recipe's Vicuna template went with the model
    out = export_checkpoint(stage2.parent, "llava")
    assert (out / "model.safetensors").is_file()


def test_qwen2_audio_recipe_trains_from_an_import(tmp_path):
    model_dir, _ = import_checkpoint(save_qwen2_audio(tmp_path / "qwen2-audio"), tmp_path / "imported")
    data = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("audio_transcribe",), limit=4))
    final = _train("qwen2_audio.toml", tmp_path / "run", f"--model.pretrained={model_dir}", f"--data.train={data}")
    saved = json.loads((final / "plait_config.json").read_text())
    assert saved["lora"]["llm"]["r"] == 16 and (final / "llm" / "adapter").is_dir()
    assert _changed(_weights(model_dir / "encoders/audio/encoder"), _weights(final / "encoders/audio/encoder")) == set()
    # the export merges the adapters as plait's own merged save does (checkpoint.merge_lora)
    MultimodalModel.from_pretrained(final).save_pretrained(tmp_path / "merged", merge_lora=True)
    merged = _weights(tmp_path / "merged" / "llm")
    assert _changed(_weights(model_dir / "llm"), merged)  # the adapters changed the LLM's weights
    hf = T.Qwen2AudioForConditionalGeneration.from_pretrained(str(export_checkpoint(final, "qwen2_audio")))
    exported = {f"model.{k}": v for k, v in hf.model.language_model.state_dict().items()} | {
        "lm_head.weight": hf.lm_head.weight}
    assert sorted(exported) == sorted(merged)
    assert all(torch.equal(merged[k], exported[k]) for k in merged)


def test_vision_audio_recipe_trains(tmp_path):
    llm = save_llm(tmp_path / "qwen2.5", "qwen2")
    paths = [f"--model.llm.path={llm}", f"--model.encoders.vision.path={save_siglip(tmp_path / 'siglip')}",
             f"--model.encoders.audio.path={save_whisper(tmp_path / 'whisper')}"]
    data = write_jsonl(tmp_path / "train.jsonl", demo_records("train", ("image_audio",), limit=4))
    final = _train("vision_audio.toml", tmp_path / "run", *paths, f"--data.train={data}")
    saved = json.loads((final / "plait_config.json").read_text())
    assert (saved["encoders"]["audio"]["downsample"], saved["encoders"]["vision"]["projector"]) == (2, "mlp")
    assert saved["lora"]["llm"]["r"] == 16


def test_qwen2_5_vl_recipe_trains_from_an_import_generates_and_exports(tmp_path):
    """Import -> train (LoRA on the M-RoPE LLM; tower, merger and identity projector frozen) -> generate -> export:
    the exported model's logits equal plait's trained model with its M-RoPE positions."""
    from plait.commands.generate import generate_command
    from plait.data.collate import collate
    from plait.models.generation import Generator
    from tests.helpers.hf_io_qwen2_5_vl import PAD, hf_inputs

    model_dir, _ = import_checkpoint(save_qwen2_5_vl(tmp_path / "qwen2.5-vl"), tmp_path / "imported")
    records = [dict(r, messages=[{"role": "user", "content": r["messages"][0]["content"].replace("<image>", PAD)},
                                 r["messages"][1]]) for r in demo_records("train", ("image_digit",), limit=4)]
    data = write_jsonl(tmp_path / "train.jsonl", records)
    final = _train("qwen2_5_vl.toml", tmp_path / "run", f"--model.pretrained={model_dir}", f"--data.train={data}")
    saved = json.loads((final / "plait_config.json").read_text())
    assert saved["lora"]["llm"]["r"] == 16 and (final / "llm" / "adapter").is_dir()
    for part in ("encoders/vision/encoder", "encoders/vision"):  # the tower with its merger, the identity projector
        assert _changed(_weights(model_dir / part), _weights(final / part)) == set()
    out = tmp_path / "predictions.jsonl"
    assert generate_command(final, input_path=data, output_path=out, max_new_tokens=4, device="cpu") == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [r["id"] for r in records]

    gen = Generator.from_pretrained(final, device="cpu", dtype="fp32")
    batch = collate([gen.processor(gen.prompt("Which digit is this?", records[0]["images"]).raw(), prompt_only=True)],
                    gen.processor.pad_id)
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(export_checkpoint(final, "qwen2_5_vl"))).eval()
    with torch.no_grad():
        mine = gen.model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                         rope_position_ids=batch.rope_position_ids)
        stock = hf(**hf_inputs(batch, hf.config.image_token_id)).logits
    torch.testing.assert_close(mine, stock, rtol=1e-4, atol=1e-4)
    q_proj = "model.layers.0.self_attn.q_proj.weight"  # the adapters trained and were merged into the export
    exported = hf.model.language_model.state_dict()[q_proj.removeprefix("model.")]
    assert not torch.equal(_weights(model_dir / "llm")[q_proj], exported)


@pytest.mark.parametrize("recipe", ["qwen3_vl", "gemma3", "qwen3_vl_moe"])
def test_new_family_recipes_train_lora_from_an_import_and_export(tmp_path, recipe):
    """LoRA on the LLM (its model type has default targets), the tower frozen; the export holds the merged weights."""
    from tests.helpers.gemma3 import save_gemma3
    from tests.helpers.hf_io_qwen2_5_vl import PAD
    from tests.helpers.qwen3_vl import save_qwen3_vl
    from tests.helpers.qwen3_vl_moe import save_qwen3_vl_moe

    save, item, hf_class = {
        "qwen3_vl": (save_qwen3_vl, PAD, T.Qwen3VLForConditionalGeneration),
        "qwen3_vl_moe": (save_qwen3_vl_moe, PAD, T.Qwen3VLMoeForConditionalGeneration),
        "gemma3": (save_gemma3, "\n\n<start_of_image><image_soft_token><end_of_image>\n\n",
                   T.Gemma3ForConditionalGeneration)}[recipe]
    model_dir, _ = import_checkpoint(save(tmp_path / recipe), tmp_path / "imported")
    records = [dict(r, messages=[{"role": "user", "content": r["messages"][0]["content"].replace("<image>", item)},
                                 r["messages"][1]]) for r in demo_records("train", ("image_digit",), limit=4)]
    final = _train(f"{recipe}.toml", tmp_path / "run", f"--model.pretrained={model_dir}",
                   f"--data.train={write_jsonl(tmp_path / 'train.jsonl', records)}")
    saved = json.loads((final / "plait_config.json").read_text())
    assert saved["lora"]["llm"]["r"] == 16 and (final / "llm" / "adapter").is_dir()
    assert _changed(_weights(model_dir / "encoders/vision/encoder"), _weights(final / "encoders/vision/encoder")) == set()
    hf = hf_class.from_pretrained(str(export_checkpoint(final, recipe)))
    q_proj = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(_weights(model_dir / "llm")[f"model.{q_proj}"],
                           hf.model.language_model.state_dict()[q_proj])  # the adapters trained and were merged
    if recipe == "qwen3_vl_moe":  # LoRA's defaults leave the fused experts and the router as imported
        for name in ("layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj", "layers.1.mlp.gate.weight"):
            assert torch.equal(_weights(model_dir / "llm")[f"model.{name}"], hf.model.language_model.state_dict()[name])


def test_voxtral_recipe_trains_lora_from_an_import_and_exports(tmp_path):
    """LoRA on the LLM, the tower with its projector frozen; the export holds the merged weights."""
    from tests.helpers.voxtral import save_voxtral

    model_dir, _ = import_checkpoint(save_voxtral(tmp_path / "voxtral"), tmp_path / "imported")
    item = "[BEGIN_AUDIO][AUDIO]"
    records = [dict(r, messages=[{"role": "user", "content": r["messages"][0]["content"].replace("<audio>", item)},
                                 r["messages"][1]]) for r in demo_records("train", ("audio_transcribe",), limit=4)]
    final = _train("voxtral.toml", tmp_path / "run", f"--model.pretrained={model_dir}",
                   f"--data.train={write_jsonl(tmp_path / 'train.jsonl', records)}")
    saved = json.loads((final / "plait_config.json").read_text())
    assert saved["lora"]["llm"]["r"] == 16 and (final / "llm" / "adapter").is_dir()
    assert _changed(_weights(model_dir / "encoders/audio/encoder"), _weights(final / "encoders/audio/encoder")) == set()
    hf = T.VoxtralForConditionalGeneration.from_pretrained(str(export_checkpoint(final, "voxtral")))
    q_proj = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(_weights(model_dir / "llm")[f"model.{q_proj}"],
                           hf.model.language_model.state_dict()[q_proj])  # the adapters trained and were merged
