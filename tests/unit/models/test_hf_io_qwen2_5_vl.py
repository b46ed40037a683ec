"""Qwen2.5-VL in and out of plait: M-RoPE positions of the collator equal transformers' ``get_rope_index`` (padded and
packed), the imported composite's logits equal ``Qwen2_5_VLForConditionalGeneration`` with its own multimodal
positions on a prompt with two images of different sizes (fp32, 1e-5), import then export gives every tensor back
bit-identically (fp32, bf16 tied), and a model trained from the import, exported and loaded with transformers,
generates plait's tokens from the exported processor's prompt ids. A video (temporal patches) is positioned as
transformers positions a video: the same positions as ``get_rope_index`` with ``video_grid_thw`` and
``second_per_grid_ts``, logits equal to ``Qwen2_5_VLForConditionalGeneration`` given the video as a video, and the
same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image
from safetensors.torch import load_file

from plait.commands.export_hf import export_checkpoint, final_folder
from plait.commands.import_hf import import_checkpoint
from plait.commands.train import train_command
from plait.data.collate import collate
from plait.data.mrope import mrope_positions
from plait.config.loader import load_config
from plait.data.sources import RawSample
from plait.models.families.qwen2_5_vl import Qwen25VLTextForCausalLM, TemporalPatches
from plait.models.generation import Generator, Prompt, greedy_token_ids
from plait.models.hf_io import hf_format_of
from plait.models.registry import build_processor
from plait.train.evaluation import greedy_by_forward
from tests.helpers.jobs import write_jsonl
from tests.media import write_video
from tests.unit.commands.tiny_hf_checkpoints import save_qwen2_5_vl
from tests.helpers.hf_io_qwen2_5_vl import PAD, hf_inputs
from tests.helpers.safetensors_files import assert_same_tensors


def _images(folder: Path, sizes=((60, 90), (100, 150))) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(sizes):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def _prompt(images: list[str], question: str = "What is it?") -> Prompt:
    text = f"{PAD}first {PAD}{question}"
    return Prompt.from_text(text, images=images, placeholders={"image": "<|image_pad|>"})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_vl")
    src = save_qwen2_5_vl(root / "src")
    model_dir, job = import_checkpoint(src, root / "imported")
    return src, model_dir, job, root


def test_mrope_positions_equal_get_rope_index_padded_and_packed(imported):
    src, model_dir, _, root = imported
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(src)).eval()
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    images = _images(root)
    one = Prompt(({"role": "user", "content": f"{PAD}Why?"},), images=tuple(images[1:]))
    samples = gen.process([_prompt(images), one, Prompt.from_text("text only")])
    batch = collate(samples, gen.processor.pad_id, padding_side="left")
    image_id = hf.config.image_token_id
    inputs = hf_inputs(batch, image_id)
    want, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                      attention_mask=inputs["attention_mask"])
    assert batch.rope_position_ids.shape == (3, 3, batch.input_ids.shape[1])
    assert torch.equal(batch.rope_position_ids, want)  # padding 0, as transformers leaves it
    real = batch.attention_mask[2] == 1
    assert torch.equal(batch.position_ids[2][real], torch.arange(int(real.sum())))
    packed = collate(samples, gen.processor.pad_id, pack=True)
    rows = [want[:, r, batch.attention_mask[r] == 1] for r in range(3)]
    assert torch.equal(packed.rope_position_ids[:, 0], torch.cat(rows, dim=1))
    assert collate(samples[2:], gen.processor.pad_id).rope_position_ids is None  # no grid in the batch


def test_mrope_positions_refuse_items_it_cannot_position():
    ids = torch.tensor([1, 9, 9, 9, 9, 9, 9, 9, 9, 2])
    items = torch.tensor([-1, 0, 0, 0, 0, 1, 1, 1, 1, -1])
    with pytest.raises(ValueError, match="follow each other without a text token"):
        mrope_positions(ids, items, [(1, 4, 4), (1, 4, 4)])
    with pytest.raises(ValueError, match="item 0: grid 1x4x6 with 4 placeholder tokens"):
        mrope_positions(ids[:6], torch.tensor([-1, 0, 0, 0, 0, -1]), [(1, 4, 6)])
    text = mrope_positions(ids, torch.full_like(ids, -1), [])
    assert torch.equal(text, torch.arange(10).expand(3, -1))


def test_decoded_tokens_continue_the_mrope_positions(imported):
    """Tokens appended to left-padded prompts (greedy decoding by forward passes) sit at the row's largest position
    + 1 + k on all streams; the shard's tokens are taken after; an LLM without M-RoPE gets ``position_ids``."""
    _, model_dir, _, _ = imported
    model = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32").model
    rope = torch.tensor([[[0, 0, 1, 2, 5]], [[0, 0, 1, 3, 5]], [[0, 0, 1, 4, 5]]])
    pos = torch.tensor([[0, 0, 1, 2, 3]])
    grown = model.llm_positions(pos, rope, tokens=7)
    assert torch.equal(grown[:, 0], torch.tensor([[0, 0, 1, 2, 5, 6, 7], [0, 0, 1, 3, 5, 6, 7], [0, 0, 1, 4, 5, 6, 7]]))
    assert torch.equal(model.llm_positions(pos, rope, torch.tensor([1, 6]), 7)[:, 0], torch.tensor([[0, 7]] * 3))
    assert model.llm_positions(pos, None) is pos


def test_imported_logits_equal_hf_with_its_own_multimodal_positions(imported):
    src, model_dir, _, root = imported
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(src), attn_implementation="eager").eval()
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32", attn_implementation="eager")
    assert isinstance(gen.model.language_model, Qwen25VLTextForCausalLM)
    batch = collate(gen.process([_prompt(_images(root))]), gen.processor.pad_id)
    grids = batch.modality_inputs["vision"]["image_grid_thw"]
    assert len({tuple(g.tolist()) for g in grids}) == 2  # two images of different sizes
    with torch.no_grad():
        stock = hf(**hf_inputs(batch, hf.config.image_token_id)).logits
        mine = gen.model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                         rope_position_ids=batch.rope_position_ids)
        one_d = gen.model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)
    assert (one_d - stock).abs().max() > 1e-3  # 1-D positions would not do


@pytest.mark.parametrize("dtype,tied", [(torch.float32, False), (torch.bfloat16, True)])
def test_import_export_round_trip_is_bit_identical(tmp_path, dtype, tied):
    src = save_qwen2_5_vl(tmp_path / "src", dtype=dtype, tied=tied)
    model_dir, job = import_checkpoint(src, tmp_path / "imported")
    settings = json.loads((model_dir / "plait_config.json").read_text())
    image_id = json.loads((src / "config.json").read_text())["image_token_id"]
    assert settings["placeholder_ids"] == {"vision": image_id}
    assert settings["encoders"]["vision"]["projector"] == "linear"
    assert "--format qwen2_5_vl" in job.read_text() and "\nfreeze_projector = true  # the identity" in job.read_text()
    out = export_checkpoint(model_dir, "qwen2_5_vl", tmp_path / "exported")
    assert_same_tensors(src, out)
    mine, theirs = (json.loads((f / "config.json").read_text()) for f in (out, src))
    fields = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
    assert {k: mine[k] for k in fields} == {k: theirs[k] for k in fields}
    assert mine["dtype"] == str(dtype).removeprefix("torch.")
    text = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "rope_parameters", "rms_norm_eps")
    assert {k: mine["text_config"][k] for k in text} == {k: theirs["text_config"][k] for k in text}
    vision = ("depth", "hidden_size", "out_hidden_size", "window_size", "fullatt_block_indexes", "spatial_merge_size")
    assert {k: mine["vision_config"][k] for k in vision} == {k: theirs["vision_config"][k] for k in vision}
    assert T.AutoImageProcessor.from_pretrained(str(out)).to_dict() == \
        T.AutoImageProcessor.from_pretrained(str(src)).to_dict()
    assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out))
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied


def test_trained_import_exports_and_generates_like_plait(imported, tmp_path):
    src, _, job, root = imported
    images = _images(root)
    records = [{"id": f"r{i}", "images": images[i % 2:i % 2 + 1],
                "messages": [{"role": "user", "content": f"{PAD}What is it?"},
                             {"role": "assistant", "content": "a picture"}]} for i in range(4)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    run = tmp_path / "run"
    overrides = [f"--data.train={train}", f"--metrics.run_dir={run}", "--train.steps=2", "--train.global_batch_size=4",
                 "--train.microbatch_size=2", "--train.lr=1e-2", "--train.warmup_steps=0", "--train.threads=1",
                 "--data.num_workers=0", "--metrics.progress=false", "--metrics.tensorboard=false",
                 "--model.llm.attn_implementation=eager", "--model.encoders.vision.freeze=false",
                 "--model.encoders.vision.freeze_projector=false"]  # trained: the export folds it into the merger
    assert train_command(job, overrides) == 0
    final = final_folder(run)
    out = export_checkpoint(final.parent, "qwen2_5_vl", tmp_path / "exported")

    gen = Generator.from_pretrained(final, device="cpu", dtype="fp32", attn_implementation="eager")
    batch = collate(gen.process([_prompt(images)]), gen.processor.pad_id, padding_side="left")
    plait_new = greedy_token_ids(gen.model, batch, gen.stop_ids, 8, gen.processor.pad_id)[0].tolist()

    def forward(batches):  # validation's decoding by forward passes (no KV cache): appended tokens continue M-RoPE
        with torch.no_grad():
            return [gen.model(b.input_ids, b.modality_inputs, b.attention_mask, b.position_ids,
                              rope_position_ids=b.rope_position_ids)[:, -1].argmax(-1) for b in batches]

    assert greedy_by_forward(forward, [batch], gen.stop_ids, 8, gen.processor.pad_id)[0][0].tolist() == plait_new

    # the exported processor's parts (Qwen2_5_VLProcessor itself needs torchvision): its chat template renders the
    # prompt, each <|image_pad|> becomes t*h*w/merge^2 pads of its image's grid, the tokenizer gives plait's ids
    tok = T.AutoTokenizer.from_pretrained(str(out))
    pil = [Image.open(p).convert("RGB") for p in images]
    images_out = T.AutoImageProcessor.from_pretrained(str(out))(images=pil, return_tensors="pt")
    text = tok.apply_chat_template([{"role": "user", "content": f"{PAD}first {PAD}What is it?"}], tokenize=False,
                                   add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    merge = images_out.get("merge_size", 2)
    counts = [int(g.prod()) // 4 for g in images_out["image_grid_thw"]]
    text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == batch.input_ids[0].tolist() and merge == 2
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out), attn_implementation="eager").eval()
    image_id = hf.config.image_token_id
    with torch.no_grad():
        hf_out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values=images_out["pixel_values"], image_grid_thw=images_out["image_grid_thw"],
                             mm_token_type_ids=(ids == image_id).int(),
                             max_new_tokens=8, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    hf_new = hf_out[0, ids.shape[1]:].tolist()
    assert hf_new == plait_new and len(plait_new) >= 1
    projector = load_file(str(final / "encoders" / "vision" / "projector.safetensors"))["linear_1.weight"]
    assert not torch.equal(projector, torch.eye(projector.shape[0]))  # it trained: the export folded it
    key = "visual.merger.mlp.2.weight"
    exported, source = (load_file(str(f / "model.safetensors"))[key] for f in (out, src))
    assert not torch.equal(exported, source)


def test_export_refuses_a_composite_qwen2_5_vl_cannot_hold():
    from plait.models.encoder import ModalityEncoder
    from plait.models.hf import build_causal_lm, build_encoder
    from plait.models.hf_io import HF_FORMATS, check_exportable
    from plait.models.multimodal import MultimodalModel
    from plait.models.projector import build_projector
    from tests.helpers.qwen2_5_vl import TINY_QWEN2_5_VL

    def model(llm: dict, width: int) -> MultimodalModel:
        tower = build_encoder("image", config=dict(TINY_QWEN2_5_VL))
        branch = ModalityEncoder(tower, build_projector("linear", 48, width), "image")
        return MultimodalModel(build_causal_lm(config=llm), {"vision": branch}, {"vision": 5})

    sizes = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64)
    fmt = HF_FORMATS["qwen2_5_vl"]
    with pytest.raises(ValueError, match="LLM is Qwen2.5-VL's text model .*; this model's LLM is a llama"):
        check_exportable(model(dict(sizes, model_type="llama"), 48), fmt)
    with pytest.raises(ValueError, match="projector maps 48 to 32 features, which cannot fold into the merger"):
        check_exportable(model(dict(sizes, model_type="qwen2_5_vl_text", hidden_size=32), 32), fmt)


def test_qwen2_vl_stays_refused_with_its_reason():
    cfg = T.Qwen2VLConfig()
    with pytest.raises(ValueError, match="cannot import a qwen2_vl checkpoint: .*M-RoPE"):
        hf_format_of(cfg, "ckpt")


VIDEO_FPS = 3.0  # sampled frames per second of a 4 fps video: 2/3 s per temporal patch, a fractional time step


def _video_batch(gen: Generator, job: Path, root: Path, frames: int = 5):
    """plait's collated sample of an image then a video (``frames`` at 4 fps, sampled at :data:`VIDEO_FPS`; 5: 4
    frames, 2 temporal patches) through the processor of the imported job (its video placeholder ``<|video_pad|>``)."""
    cfg = load_config(job, [f"--model.encoders.vision.video.fps={VIDEO_FPS}"])
    processor = build_processor(cfg.model, gen.model, gen.processor.tokenizer, 512)
    video = processor.specs["image"].video
    assert video.placeholder == "<|video_pad|>" and isinstance(video.encoding, TemporalPatches)
    clip = write_video(root / f"clip{frames}.mkv", frames, width=84, height=56, rate=4)
    text = f"{PAD}first <|vision_start|><|video_pad|><|vision_end|>What happens?"
    sample = RawSample("v", "t", ({"role": "user", "content": text}, {"role": "assistant", "content": "x"}),
                       {"image": (_images(root)[0],), "video": (str(clip),)}, "test")
    return collate([processor(sample, prompt_only=True)], processor.pad_id)


def _hf_video_inputs(batch, hf) -> dict:
    """transformers' inputs for the same prompt with the video as a video: its tokens ``<|video_pad|>`` (type 2),
    ``pixel_values_videos``, ``video_grid_thw`` and ``second_per_grid_ts = temporal_patch_size / fps`` (what
    ``Qwen2_5_VLProcessor`` computes from the sampled fps; the patch rows are its video processor's layout, checked
    in test_qwen2_5_vl's temporal-patch test)."""
    vision = batch.modality_inputs["vision"]
    video_item = 1  # the image is item 0
    on_video = batch.item_ids == video_item
    ids = torch.where(on_video, hf.config.video_token_id, batch.input_ids)
    types = (ids == hf.config.image_token_id).int() + 2 * on_video.int()
    step = hf.config.vision_config.temporal_patch_size / VIDEO_FPS
    return {"input_ids": ids, "attention_mask": batch.attention_mask, "mm_token_type_ids": types,
            "pixel_values": vision["pixel_values"][0], "image_grid_thw": vision["image_grid_thw"][0][None],
            "pixel_values_videos": vision["pixel_values"][1], "video_grid_thw": vision["image_grid_thw"][1][None],
            "second_per_grid_ts": torch.tensor([step])}


def test_a_video_is_positioned_and_computed_as_transformers_does_a_video(imported):
    src, model_dir, job, root = imported
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(src), attn_implementation="eager").eval()
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32", attn_implementation="eager")
    batch = _video_batch(gen, job, root)
    assert batch.modality_inputs["vision"]["image_grid_thw"][1][0] == 2  # 4 frames: 2 temporal patches
    inputs = _hf_video_inputs(batch, hf)
    want, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                      inputs["video_grid_thw"], inputs["second_per_grid_ts"])
    assert torch.equal(batch.rope_position_ids, want)
    on_video = inputs["mm_token_type_ids"][0] == 2
    steps = want[0, 0, on_video].unique().tolist()
    tps = hf.config.vision_config.tokens_per_second
    assert steps[1] - steps[0] == int(tps * 2 / VIDEO_FPS) != 1  # video timing, not an image's temporal step 1
    with torch.no_grad():
        stock = hf(**inputs).logits
        mine = gen.model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                         rope_position_ids=batch.rope_position_ids)
    torch.testing.assert_close(mine, stock, rtol=1e-5, atol=1e-5)
    # greedy generation: plait's (M-RoPE positions continued past the prompt) equals transformers' with the video
    plait_new = greedy_token_ids(gen.model, batch, gen.stop_ids, 6, gen.processor.pad_id)[0].tolist()
    with torch.no_grad():
        hf_out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    assert hf_out[0, batch.input_ids.shape[1]:].tolist() == plait_new and len(plait_new) >= 1


def test_a_long_video_generates_as_transformers_does(imported):
    """A 6 s clip: its time positions run past the text after it (which continues from its spatial size), so the
    prompt's last token is below its largest position; plait decodes the first token at the largest position + 1
    (transformers' rope_deltas rule) and then generates; the tokens equal transformers' generate (it was refused)."""
    src, model_dir, job, root = imported
    hf = T.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(src), attn_implementation="eager").eval()
    gen = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32", attn_implementation="eager")
    batch = _video_batch(gen, job, root, frames=25)
    last, largest = batch.rope_position_ids[:, 0, -1].max(), batch.rope_position_ids.max()
    assert last < largest  # the case generate alone would misplace
    inputs = _hf_video_inputs(batch, hf)
    plait_new = greedy_token_ids(gen.model, batch, gen.stop_ids, 6, gen.processor.pad_id)[0].tolist()
    with torch.no_grad():
        hf_out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=gen.stop_ids, pad_token_id=0)
    assert hf_out[0, batch.input_ids.shape[1]:].tolist() == plait_new and len(plait_new) >= 2


def test_a_prompt_without_placeholders_gets_the_wrapped_image_and_video(imported):
    """``plait generate --image x --video v --prompt text`` on an imported Qwen2.5-VL: each item goes in as its
    records write it (``<|vision_start|><|image_pad|><|vision_end|>``, ``<|video_pad|>`` for the video; transformers'
    positions find items by ``vision_start``): the same input ids and M-RoPE positions as that prompt written out."""
    from plait.commands.generate import prompt_sample

    src, model_dir, job, root = imported
    base = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    gen = Generator(base.model, build_processor(load_config(job).model, base.model, base.tokenizer, 512), "cpu", "fp32")
    image, clip = _images(root)[0], str(write_video(root / "clip2.mkv", 4, width=56, height=56, rate=2))
    auto = prompt_sample(gen, "What happens?", [image], videos=[clip])
    written = prompt_sample(gen, "<|vision_start|><|image_pad|><|vision_end|>\n<|vision_start|><|video_pad|>"
                                 "<|vision_end|>\nWhat happens?", [image], videos=[clip])
    a, b = (collate([gen.processor(r, prompt_only=True)], gen.processor.pad_id) for r in (auto, written))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rope_position_ids, b.rope_position_ids)
    start = gen.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert int((a.input_ids == start).sum()) == 2


def test_generate_video_on_a_fresh_import_reads_it_as_the_imported_job_does(imported, capsys):
    """``plait import`` saves the video settings its job writes (``<|video_pad|>``, 2 fps) in the model folder, so
    ``plait generate --model <import>/model --video clip --prompt ...`` is answered (it was refused: no video
    placeholder), with the same answer as a generator built from the imported job's processor."""
    from plait.commands.generate import generate_command

    src, model_dir, job, root = imported
    clip = str(write_video(root / "clip3.mkv", 4, width=56, height=56, rate=2))
    fresh = Generator.from_pretrained(model_dir, device="cpu", dtype="fp32")
    video = fresh.processor.specs["image"].video
    assert (video.placeholder, video.placeholder_id, video.fps, video.audio) == (
        "<|video_pad|>", fresh.tokenizer.convert_tokens_to_ids("<|video_pad|>"), 2.0, False)
    assert load_config(job).model.encoders["vision"].video.fps == video.fps  # the job says the same
    by_job = Generator(fresh.model, build_processor(load_config(job).model, fresh.model, fresh.tokenizer, 512), "cpu",
                       "fp32")
    want = by_job.ask("What happens?", videos=[clip], max_new_tokens=3)
    capsys.readouterr()
    assert generate_command(model_dir, prompt="What happens?", videos=[clip], max_new_tokens=3, device="cpu",
                            dtype="fp32", threads=1) == 0
    assert capsys.readouterr().out.splitlines()[-1:] == [want]


def test_the_export_needs_torchvision_only_for_autoprocessors_video_processor(imported, tmp_path, capsys):
    """``AutoProcessor`` builds ``Qwen2_5_VLProcessor`` with its video processor, which transformers implements with
    torchvision only: without torchvision it is refused naming it (and ``plait export`` says so), while the image
    processor (its PIL class) and the tokenizer load from the same folder; with torchvision it loads."""
    import importlib.util

    from plait.commands.export_hf import export_command, torchvision_note

    src, model_dir, job, root = imported
    assert export_command(model_dir, "qwen2_5_vl", tmp_path / "hf") == 0
    image = T.AutoImageProcessor.from_pretrained(str(tmp_path / "hf"))
    assert type(image).__name__ in ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor")
    assert T.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).convert_tokens_to_ids("<|image_pad|>") == \
        T.AutoConfig.from_pretrained(str(src)).image_token_id
    printed = capsys.readouterr().out
    assert torchvision_note("llava") == "" and torchvision_note("gemma3") == ""
    if importlib.util.find_spec("torchvision") is None:
        assert f"plait: {torchvision_note('qwen2_5_vl')}" in printed and "needs torchvision" in printed
        with pytest.raises(ImportError, match="Torchvision"):
            T.AutoProcessor.from_pretrained(str(tmp_path / "hf"))
    else:
        assert type(T.AutoProcessor.from_pretrained(str(tmp_path / "hf"))).__name__ == "Qwen2_5_VLProcessor"
