"""``plait import`` / ``plait export`` on tiny Hugging Face checkpoints saved locally: import then export gives every
tensor and the config fields that matter back bit-identically (LLaVA, Qwen2-Audio); the imported job trains; the
exported trained model, loaded with transformers, generates the same tokens (greedy) as plait's generation for the
same prompt and image/audio; composites and checkpoints the classes cannot hold are refused with the reason."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from plait.commands.export_hf import export_checkpoint, final_folder
from plait.commands.import_hf import import_checkpoint
from plait.commands.train import train_command
from plait.models.generation import Generator, Prompt, greedy_token_ids
from plait.models.hf_io import HF_FORMATS, check_exportable, composite_from_hf, hf_format_of, hf_from_composite
from plait.models.multimodal import MultimodalModel
from plait.data.collate import collate
from tests.helpers.jobs import demo_records, write_jsonl
from tests.unit.commands.tiny_hf_checkpoints import LLAVA_TEMPLATE, save_llava, save_qwen2_audio

_LLAVA_FIELDS = ("image_token_index", "vision_feature_layer", "vision_feature_select_strategy", "image_seq_length",
                 "projector_hidden_act", "multimodal_projector_bias", "tie_word_embeddings")
_TEXT_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_parameters", "rms_norm_eps",
                "tie_word_embeddings")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _assert_same_tensors(a: Path, b: Path) -> None:
    left, right = _tensors(a), _tensors(b)
    assert sorted(left) == sorted(right)
    for key in left:
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_llava_import_export_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src = save_llava(tmp_path / "src", dtype=dtype, tied=tied)
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    settings = json.loads((model_dir / "plait_config.json").read_text())
    assert settings["placeholder_ids"] == {"vision": 5}
    assert {k: settings["encoders"]["vision"][k] for k in ("modality", "feature_layer", "select", "projector")} == \
        {"modality": "image", "feature_layer": -2, "select": "drop_cls", "projector": "mlp"}
    assert f'pretrained = "{model_dir.resolve()}"' in job.read_text()
    out = export_checkpoint(model_dir, "llava", tmp_path / "exported")
    _assert_same_tensors(src, out)  # names, dtypes and values (no lm_head.weight when tied)
    hf = T.LlavaForConditionalGeneration.from_pretrained(str(out))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied
    mine, theirs = _config(out), _config(src)
    assert mine["dtype"] == theirs["dtype"] == str(dtype).removeprefix("torch.")
    assert {k: mine[k] for k in _LLAVA_FIELDS} == {k: theirs[k] for k in _LLAVA_FIELDS}
    assert {k: mine["text_config"].get(k) for k in _TEXT_FIELDS} == {k: theirs["text_config"].get(k) for k in _TEXT_FIELDS}
    vision = ("model_type", "hidden_size", "num_hidden_layers", "image_size", "patch_size", "hidden_act")
    assert {k: mine["vision_config"][k] for k in vision} == {k: theirs["vision_config"][k] for k in vision}
    a, b = T.AutoProcessor.from_pretrained(str(src)), T.AutoProcessor.from_pretrained(str(out))
    assert (b.patch_size, b.image_token, b.vision_feature_select_strategy, b.num_additional_image_tokens) == \
        (a.patch_size, a.image_token, a.vision_feature_select_strategy, a.num_additional_image_tokens) == \
        (8, "<image>", "default", 1)
    assert b.chat_template == a.chat_template == LLAVA_TEMPLATE  # the typed template given back without plait's prelude
    assert b.image_processor.to_dict() == a.image_processor.to_dict()
    # the imported tokenizer renders plait's string contents through LLaVA's typed template
    tok = T.AutoTokenizer.from_pretrained(str(model_dir / "tokenizer"))
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "USER: <image>\nWhat is it? ASSISTANT:"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_audio_import_export_round_trip_is_bit_identical(tmp_path, dtype):
    src = save_qwen2_audio(tmp_path / "src", dtype=dtype)
    model_dir, _ = import_checkpoint(src, tmp_path / "imported")
    settings = json.loads((model_dir / "plait_config.json").read_text())["encoders"]["audio"]
    assert (settings["projector"], settings["hop_length"], settings["sampling_rate"]) == ("linear", 160, 16000)
    out = export_checkpoint(model_dir, "qwen2_audio", tmp_path / "exported")
    _assert_same_tensors(src, out)
    mine, theirs = _config(out), _config(src)
    assert mine["audio_token_index"] == theirs["audio_token_index"] == 6
    assert {k: mine["text_config"].get(k) for k in _TEXT_FIELDS} == {k: theirs["text_config"].get(k) for k in _TEXT_FIELDS}
    audio = ("model_type", "d_model", "encoder_layers", "num_mel_bins", "max_source_positions")
    assert {k: mine["audio_config"][k] for k in audio} == {k: theirs["audio_config"][k] for k in audio}
    a, b = T.AutoProcessor.from_pretrained(str(src)), T.AutoProcessor.from_pretrained(str(out))
    assert b.audio_token == a.audio_token == "<audio>" and b.chat_template == a.chat_template
    assert b.feature_extractor.to_dict() == a.feature_extractor.to_dict()


def _train_imported(job: Path, records: list[dict], root: Path) -> Path:
    """Two steps of the imported job on ``records``; returns the run's final/ folder."""
    train = write_jsonl(root / "train.jsonl", records)
    run = root / "run"
    overrides = [f"--data.train={train}", f"--metrics.run_dir={run}", "--train.steps=2", "--train.global_batch_size=4",
                 "--train.microbatch_size=2", "--train.lr=1e-3", "--train.warmup_steps=0", "--train.threads=1",
                 "--data.num_workers=0", "--metrics.progress=false", "--metrics.tensorboard=false",
                 "--model.llm.attn_implementation=eager"]
    assert train_command(job, overrides) == 0
    return final_folder(run)


def _plait_tokens(final: Path, prompt: Prompt, new: int) -> tuple[list[int], list[int], Generator]:
    """Prompt ids and greedy new tokens of ``plait generate``'s model (fp32, CPU)."""
    gen = Generator.from_pretrained(final, device="cpu", dtype="fp32", attn_implementation="eager")
    sample = gen.process([prompt])[0]
    batch = collate([sample], gen.processor.pad_id, padding_side="left")
    out = greedy_token_ids(gen.model, batch, gen.stop_ids, new, gen.processor.pad_id)
    return batch.input_ids[0].tolist(), out[0].tolist(), gen


def _hf_tokens(hf: T.PreTrainedModel, inputs: dict, stop: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_llava_trained_from_import_exports_and_generates_like_plait(tmp_path):
    src = save_llava(tmp_path / "src")
    _, job = import_checkpoint(src, tmp_path / "imported")
    records = demo_records("train", ("image_digit",), limit=4)
    final = _train_imported(job, records, tmp_path)
    out = export_checkpoint(final.parent, "llava", tmp_path / "exported")
    image = records[0]["images"][0]
    prompt = Prompt(({"role": "user", "content": "<image>\nWhat digit is shown?"},), images=(image,))
    ids, plait_new, gen = _plait_tokens(final, prompt, 8)

    hf = T.LlavaForConditionalGeneration.from_pretrained(str(out), attn_implementation="eager").eval()
    processor = T.AutoProcessor.from_pretrained(str(out))
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What digit is shown?"}]}]
    text = processor.apply_chat_template(typed, add_generation_prompt=True)
    from PIL import Image

    inputs = processor(text=text, images=Image.open(image).convert("RGB"), return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids  # the exported processor gives plait's prompt, 16 <image> tokens
    assert ids.count(5) == 16
    hf_new = _hf_tokens(hf, dict(inputs), gen.stop_ids, 8)
    assert hf_new == plait_new and len(plait_new) >= 1  # one row: plait keeps its stop token and pads nothing


def _wav(path: Path, seconds: float) -> Path:
    samples = (np.sin(np.arange(int(16000 * seconds)) * 0.05) * 12000).astype(np.int16)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000), f.writeframes(samples.tobytes())
    return path


def test_qwen2_audio_trained_from_import_exports_and_generates_like_plait(tmp_path):
    src = save_qwen2_audio(tmp_path / "src")
    _, job = import_checkpoint(src, tmp_path / "imported")
    records = demo_records("train", ("audio_transcribe",), limit=4)
    final = _train_imported(job, records, tmp_path)
    out = export_checkpoint(final, "qwen2_audio", tmp_path / "exported")
    clip = _wav(tmp_path / "clip.wav", 1.3)
    prompt = Prompt(({"role": "user", "content": "<audio>\nWhich digits are spoken?"},), audios=(str(clip),))
    ids, plait_new, gen = _plait_tokens(final, prompt, 8)

    hf = T.Qwen2AudioForConditionalGeneration.from_pretrained(str(out), attn_implementation="eager").eval()
    processor = T.AutoProcessor.from_pretrained(str(out))
    text = gen.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
    with wave.open(str(clip)) as f:
        audio = np.frombuffer(f.readframes(f.getnframes()), np.int16).astype(np.float32) / 32768.0
    inputs = processor(text=text, audio=audio, sampling_rate=16000, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    hf_new = _hf_tokens(hf, dict(inputs), gen.stop_ids, 8)
    assert hf_new == plait_new and len(plait_new) >= 1


def test_exported_model_stops_at_the_chat_turn_end_where_plait_stops(tmp_path):
    """A model that learnt to end its turn (``seven<|im_end|>``): the export's generation config lists the ChatML
    end of turn, so transformers' greedy generate with the saved config stops where plait's does (with the
    tokenizer's EOS alone it runs on through ``<|im_end|>``); plait's own ``final/llm/`` lists it too."""
    from plait.config.loader import config_from_dict
    from plait.models.generation import save_final
    from plait.train.trainer import Trainer
    from tests.helpers.jobs import tiny_config_dict

    recs = [dict(r, messages=[r["messages"][0], {"role": "assistant", "content": "seven"}])
            for r in demo_records("train", ("image_digit",), limit=8)]
    cfg = tiny_config_dict(str(write_jsonl(tmp_path / "train.jsonl", recs)), None, str(tmp_path / "run"),
                           train={"steps": 30, "lr": 3e-3, "global_batch_size": 8, "microbatch_size": 4})
    del cfg["model"]["encoders"]["audio"]  # LLaVA holds one image branch, of fixed size (the tower's 32 px)
    cfg["model"]["encoders"]["vision"]["processor"] = {"size": {"height": 32, "width": 32}}
    trainer = Trainer.build(config_from_dict(cfg))
    trainer.fit()
    final = tmp_path / "final"
    save_final(trainer.full_model(), trainer.processor, final)
    assert T.GenerationConfig.from_pretrained(str(final / "llm")).eos_token_id == [2, 4]  # <|eos|>, <|im_end|>
    out = export_checkpoint(final, "llava", tmp_path / "exported")
    prompt = Prompt(({"role": "user", "content": recs[0]["messages"][0]["content"]},), images=tuple(recs[0]["images"]))
    ids, plait_new, gen = _plait_tokens(final, prompt, 8)
    assert gen.stop_ids == [2, 4] and plait_new == [gen.tokenizer.convert_tokens_to_ids("seven"), 4]

    hf = T.LlavaForConditionalGeneration.from_pretrained(str(out), attn_implementation="eager").eval()
    assert hf.generation_config.eos_token_id == [2, 4] and hf.generation_config.pad_token_id == 0
    processor = T.AutoProcessor.from_pretrained(str(out))
    text = gen.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
    before, after = prompt.messages[0]["content"].split("<image>")
    typed = [{"role": "user", "content": [{"type": "text", "text": before}, {"type": "image"},
                                          {"type": "text", "text": after}]}]
    assert processor.apply_chat_template(typed, add_generation_prompt=True) == text  # transformers' message form
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable as the umask allows, not 0600
    from PIL import Image

    inputs = processor(text=text, images=Image.open(recs[0]["images"][0]).convert("RGB"), return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == ids
    with torch.no_grad():  # the saved generation config alone: no eos_token_id given
        got = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert got[0, len(ids):].tolist() == plait_new
    with torch.no_grad():
        eos_only = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=2)
    assert eos_only[0, len(ids):len(ids) + 2].tolist() == plait_new and eos_only.shape[1] > len(ids) + 2


def test_import_refuses_what_plait_cannot_compose(tmp_path):
    with pytest.raises(ValueError, match="llava-next-folder: cannot import a llava_next checkpoint: .*anyres tiling"):
        hf_format_of(T.LlavaNextConfig(), "llava-next-folder")
    # Qwen2.5-VL imports now (tests/unit/models/test_hf_io_qwen2_5_vl.py); Qwen2-VL's LLM stays refused
    with pytest.raises(ValueError, match="qwen2vl-folder: cannot import a qwen2_vl checkpoint: Qwen2-VL's LLM takes "
                                         "multimodal rotary positions"):
        hf_format_of(T.Qwen2VLConfig(), "qwen2vl-folder")
    with pytest.raises(ValueError, match="holds a llama; plait import reads LlavaForConditionalGeneration"):
        hf_format_of(T.LlamaConfig(), "llm-folder")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        import_checkpoint(tmp_path / "missing", tmp_path / "out")
    src = save_llava(tmp_path / "src")
    import_checkpoint(src, tmp_path / "out")
    with pytest.raises(ValueError, match="already holds files"):
        import_checkpoint(src, tmp_path / "out")


def test_export_refuses_composites_the_class_cannot_hold(tmp_path):
    model_dir, _ = import_checkpoint(save_llava(tmp_path / "src"), tmp_path / "imported")
    model = MultimodalModel.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="Qwen2AudioForConditionalGeneration takes audio; branch 'vision' is image"):
        check_exportable(model, HF_FORMATS["qwen2_audio"])
    branch = model.encoders["vision"]
    branch.projector.kind = "linear"
    with pytest.raises(ValueError, match="projector is Linear-GELU-Linear .* has a 'linear' projector"):
        check_exportable(model, HF_FORMATS["llava"])
    branch.projector.kind = "mlp"
    model.encoders["second"] = branch
    with pytest.raises(ValueError, match="has one encoder; this model has 2 \\(vision, second\\)"):
        check_exportable(model, HF_FORMATS["llava"])
    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration's tower is qwen2_5_vl_vision; branch "
                                         "'vision' is a clip_vision_model"):
        export_checkpoint(model_dir, "qwen2_5_vl")  # exported since Qwen2.5-VL's M-RoPE LLM; a CLIP branch is not
    with pytest.raises(ValueError, match="--format 'idefics3': plait export writes llava, qwen2_audio"):
        export_checkpoint(model_dir, "idefics3")
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):  # a format now, but not of a CLIP branch
        export_checkpoint(model_dir, "gemma3")
    with pytest.raises(FileNotFoundError, match="neither it nor .* holds plait_config.json"):
        export_checkpoint(tmp_path, "llava")


def test_cli_import_and_export(tmp_path, capsys, monkeypatch):
    from plait.cli import main

    src = save_qwen2_audio(tmp_path / "src")
    monkeypatch.chdir(tmp_path)  # the relative --train file exists (import refuses a missing one)
    (tmp_path / "data.jsonl").write_text("")
    assert main(["import", "--from", str(src), "--out", str(tmp_path / "imp"), "--train", "data.jsonl"]) == 0
    assert f'train = "{Path("data.jsonl").resolve()}"' in (tmp_path / "imp" / "job.toml").read_text()
    assert main(["export", "--run", str(tmp_path / "imp" / "model"), "--format", "llava"]) == 2
    assert "LlavaForConditionalGeneration takes image; branch 'audio' is audio" in capsys.readouterr().err
    assert main(["export", "--run", str(tmp_path / "imp" / "model"), "--format", "qwen2_audio"]) == 0
    assert (tmp_path / "imp" / "hf-qwen2_audio" / "model.safetensors").is_file()
    assert "as Qwen2AudioForConditionalGeneration to" in capsys.readouterr().out


def test_import_prints_the_train_command_and_asks_for_data_only_when_no_train_file_was_given(tmp_path, capsys):
    from plait.commands.import_hf import import_command

    src = save_qwen2_audio(tmp_path / "src")
    (tmp_path / "data.jsonl").write_text("")  # import refuses a --train file that does not exist
    assert import_command(src, tmp_path / "with", train=str(tmp_path / "data.jsonl")) == 0
    job = tmp_path / "with" / "job.toml"
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"plait: train with: plait train --config {job}"
    assert "set data.train" not in out
    assert import_command(src, tmp_path / "without") == 0
    job = tmp_path / "without" / "job.toml"
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"plait: set data.train in {job}, then: plait train --config {job}"


def _siglip_llava(**fields) -> T.LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    text = T.LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=False)
    cfg = T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=90, **fields)
    cfg._attn_implementation = "eager"
    return T.LlavaForConditionalGeneration(cfg).eval()


def test_siglip_llava_maps_both_ways_with_equal_logits():
    hf = _siglip_llava(vision_feature_layer=-1, vision_feature_select_strategy="full")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    model = composite_from_hf(hf, HF_FORMATS["llava"]).eval()
    branch = model.encoders["vision"]
    assert (branch.feature_layer, branch.select, branch.feature_count((32, 32))) == (-1, "full", 16)
    ids = torch.randint(1, 80, (1, 20))
    ids[0, 2:18] = 90
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, {"vision": {"pixel_values": list(pixels)}}),
                                   hf(input_ids=ids, pixel_values=pixels).logits, rtol=1e-5, atol=1e-5)
    back = hf_from_composite(model, HF_FORMATS["llava"]).state_dict()
    assert sorted(back) == sorted(before) and all(torch.equal(back[k], before[k]) for k in before)


def test_llava_configs_plait_cannot_express_are_refused():
    with pytest.raises(ValueError, match="vision_feature_layer = \\[-2, -1\\]: plait's branch takes one hidden state"):
        composite_from_hf(_siglip_llava(vision_feature_layer=[-2, -1], vision_feature_select_strategy="full"),
                          HF_FORMATS["llava"])
    with pytest.raises(ValueError, match="'default' drops the first position of a siglip_vision_model tower"):
        composite_from_hf(_siglip_llava(vision_feature_select_strategy="default"), HF_FORMATS["llava"])
    with pytest.raises(ValueError, match="projector_hidden_act = 'relu'"):
        composite_from_hf(_siglip_llava(vision_feature_select_strategy="full", projector_hidden_act="relu"),
                          HF_FORMATS["llava"])


def test_import_without_a_chat_template_needs_one_named(tmp_path):
    src = save_llava(tmp_path / "src")
    for f in src.glob("chat_template*"):
        f.unlink()
    with pytest.raises(ValueError, match="no chat template in the processor or tokenizer; give --chat-template"):
        import_checkpoint(src, tmp_path / "a")
    model_dir, _ = import_checkpoint(src, tmp_path / "b", chat_template="chatml")
    assert "<|im_start|>" in T.AutoTokenizer.from_pretrained(str(model_dir / "tokenizer")).chat_template


def test_import_refuses_a_placeholder_that_is_not_the_models(tmp_path):
    src = save_llava(tmp_path / "src")
    cfg = _config(src) | {"image_token_index": 7}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="the processor's placeholder '<image>' is token 5, but the model's "
                                         "image_token_id is 7"):
        import_checkpoint(src, tmp_path / "out")


def test_a_prompt_without_placeholders_gets_qwen2_audios_wrapped_placeholder(tmp_path):
    """``plait generate --audio x --prompt text`` on an imported Qwen2-Audio: the clip goes in as the README's record
    convention ``<|audio_bos|><|AUDIO|><|audio_eos|>``, the same input ids as that prompt written out."""
    from plait.commands.generate import prompt_sample

    src = save_qwen2_audio(tmp_path / "src", qwen_tokens=True)
    model_dir, _ = import_checkpoint(src, tmp_path / "imported")
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    clip = str(_wav(tmp_path / "clip.wav", 1.3))
    auto = gen.processor(prompt_sample(gen, "which digits?", audios=[clip]), prompt_only=True)
    wrapped = gen.processor(prompt_sample(gen, "<|audio_bos|><|AUDIO|><|audio_eos|>\nwhich digits?", audios=[clip]),
                            prompt_only=True)
    assert gen.item_texts()["audio"] == "<|audio_bos|><|AUDIO|><|audio_eos|>"
    assert torch.equal(auto.input_ids, wrapped.input_ids)
    bos = gen.tokenizer.convert_tokens_to_ids("<|audio_bos|>")
    assert int((auto.input_ids == bos).sum()) == 1


def test_the_export_command_offers_every_format_plait_writes():
    from plait.cli import EXPORT_FORMATS, parse_command_line

    assert EXPORT_FORMATS == tuple(HF_FORMATS)
    for name in HF_FORMATS:
        args, _ = parse_command_line(["export", "--run", "r", "--format", name])
        assert args.format == name


def test_the_import_help_names_every_importable_format():
    import contextlib
    import io

    from plait.cli import build_parser

    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        build_parser().parse_args(["import", "--help"])
    help_text = " ".join(text.getvalue().split())  # argparse wraps lines
    listed = ", ".join(HF_FORMATS)
    assert f"any format plait export writes ({listed})" in help_text
    assert f"model_type one of {listed}" in help_text
