"""Qwen3-VL video records through plait's data path (``plait.models.families.qwen3_vl.TimestampedPatches``): a record
with a video, and one with an image and a video, read by the loader of an imported tiny
``Qwen3VLForConditionalGeneration`` give the token ids ``Qwen3VLProcessor`` writes (a ``<t seconds>`` timestamp and
``<|vision_start|> ... <|vision_end|>`` per temporal patch, the record's wrapper collapsed), the metadata pass's
counts, and logits equal to transformers' model fed the processor's inputs for the same frames (fp32, 1e-5; its own
M-RoPE positions); greedy tokens equal its ``generate``; a train step runs; a video shorter than one temporal patch
and an unreadable one are refused naming record, file and line, and ``data.on_error = "skip"`` counts them; with a
vocabulary that merges `` <``, the text before a video is tokenized with its first timestamp, as the processor's
string is."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from plait.commands.import_hf import import_checkpoint
from plait.config.loader import load_config
from plait.data.collate import collate
from plait.data.record_metadata import record_metadata
from plait.data.sources import SampleError
from plait.models.generation import greedy_token_ids
from plait.train.trainer import Trainer
from tests.helpers.jobs import write_jsonl
from tests.helpers.qwen3_vl import save_qwen3_vl
from tests.media import write_image, write_video

VIDEO_PAD = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
RATE, FRAMES = 4, 6  # a 1.5-s video at 4 frames per second; sampled at 2: frames 0, 2, 4 -> 2 temporal patches


def _records(tmp_path) -> list[dict]:
    video = str(write_video(tmp_path / "clip.mp4", FRAMES, rate=RATE))
    image = str(write_image(tmp_path / "still.png", 16, 24, level=90))
    answer = {"role": "assistant", "content": "it fades"}
    return [{"id": "video", "videos": [video], "messages": [
                {"role": "user", "content": f"{VIDEO_PAD}What happens?"}, answer]},
            {"id": "mixed", "images": [image], "videos": [video], "messages": [
                {"role": "user", "content": f"{IMAGE_PAD}Look, then {VIDEO_PAD}what happens?"}, answer]}]


def _overrides(tmp_path, data, *extra: str) -> list[str]:
    return [f"--data.train={data}", "--train.steps=1", "--train.global_batch_size=2", "--train.microbatch_size=2",
            "--train.device=cpu", "--train.threads=1", "--data.num_workers=0", "--data.metadata_cache=off",
            "--data.shuffle=false", f"--metrics.run_dir={tmp_path / 'run'}", "--metrics.progress=false",
            "--metrics.tensorboard=false", "--checkpoint.every=0", *extra]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("q3vl_video")
    src = save_qwen3_vl(tmp / "src")
    _, job = import_checkpoint(src, tmp / "imported")
    data = write_jsonl(tmp / "train.jsonl", _records(tmp))
    trainer = Trainer.build(load_config(job, _overrides(tmp, data)))
    return SimpleNamespace(tmp=tmp, src=src, job=job, data=data, trainer=trainer)


def _frames(path: str) -> list[Image.Image]:
    """Every frame of the video, decoded here (not by plait)."""
    import av

    with av.open(path) as container:
        return [f.to_image().convert("RGB") for f in container.decode(video=0)]


def _hf_inputs(src, record: dict) -> dict:
    """transformers' inputs of the record's prompt: the text ``Qwen3VLProcessor`` writes (its chat-template wrapper
    collapsed, ``replace_video_token`` per video, ``replace_image_token`` per image), tokenized; the image through
    ``Qwen2VLImageProcessorPil``; the video's sampled frames (0, 2, 4 at 4 fps) resized and normalised by the image
    processor, laid out by ``Qwen3VLVideoProcessor.patchify`` (its own video processor needs torchvision)."""
    tok = T.AutoTokenizer.from_pretrained(str(src))
    images = T.Qwen2VLImageProcessorPil.from_pretrained(str(src))
    proc = _hf_processor(tok, images)
    text = tok.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
    indices = [0, 2, 4]
    frames = [_frames(record["videos"][0])[i] for i in indices]
    rows = [images(images=[f], return_tensors="pt") for f in frames]
    _, h, w = (int(g) for g in rows[0]["image_grid_thw"][0])
    pixels = torch.stack([_unpatched(r["pixel_values"], h, w) for r in rows])[None]  # [1, F, C, H, W]
    videos, t, gh, gw = Qwen3VLVideoProcessor.patchify(None, pixels, 4, 2, 2)
    grid = torch.tensor([[t, gh, gw]])
    meta = SimpleNamespace(fps=float(RATE), frames_indices=list(indices))
    video_text = proc.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    out = {"pixel_values_videos": videos[0], "video_grid_thw": grid}
    image_texts = []
    if record.get("images"):
        image = images(images=[Image.open(record["images"][0]).convert("RGB")], return_tensors="pt")
        out |= {"pixel_values": image["pixel_values"], "image_grid_thw": image["image_grid_thw"]}
        image_texts = [proc.replace_image_token(image, 0)]
    text, _ = proc.get_text_with_replacements([text], image_texts, [video_text])
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_id, video_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    types = (ids == image_id).int() + 2 * (ids == video_id).int()
    return out | {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}


def _hf_processor(tok, images) -> Qwen3VLProcessor:
    """``Qwen3VLProcessor`` with its tokenizer and image processor; its video processor (which needs torchvision)
    stands in with the two values ``replace_video_token`` reads."""
    proc = object.__new__(Qwen3VLProcessor)  # its __init__ builds the video processor
    proc.__dict__.update(image_processor=images, tokenizer=tok, video_processor=SimpleNamespace(
        merge_size=2, temporal_patch_size=2), image_token="<|image_pad|>", video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
    return proc


def _unpatched(rows: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """One frame ``[C, H, W]`` back from the image processor's rows ``[h w, C T p p]`` (temporal slot 0)."""
    x = rows.reshape(h // 2, w // 2, 2, 2, 3, 2, 4, 4)[:, :, :, :, :, 0]  # [h/m, w/m, m, m, C, p, p]
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, h * 4, w * 4)


@pytest.mark.parametrize("index", [0, 1], ids=["video", "image+video"])
def test_a_video_record_gives_the_processors_tokens_and_hf_logits(job, index):
    record = _records(job.tmp)[index]
    hf = T.Qwen3VLForConditionalGeneration.from_pretrained(str(job.src)).eval()
    want = _hf_inputs(job.src, record)
    processor = job.trainer.processor
    from plait.data.sources import parse_record

    raw = parse_record(record, f"train.jsonl:{index + 1}", job.tmp)
    sample = processor(raw, prompt_only=True)
    assert record_metadata(processor, raw, prompt_only=True) == sample.meta
    cfg = hf.config
    mine = torch.where(sample.input_ids == cfg.image_token_id, -1, sample.input_ids)
    theirs = torch.where((want["input_ids"][0] == cfg.image_token_id) | (want["input_ids"][0] == cfg.video_token_id),
                         -1, want["input_ids"][0])
    assert mine.tolist() == theirs.tolist()  # timestamps, wrappers and the prompt's text as the processor writes them
    assert [n for _, n in sample.meta.items] == [6] * index + [12, 12]  # the image, then a patch per 2 frames
    batch = collate([sample], processor.pad_id)
    model = job.trainer.model.eval()
    with torch.no_grad():
        stock = hf(**want).logits
        logits = model(batch.input_ids, batch.modality_inputs, batch.attention_mask, batch.position_ids,
                       rope_position_ids=batch.rope_position_ids)
    torch.testing.assert_close(logits, stock, rtol=1e-5, atol=1e-5)
    settings = dict(max_new_tokens=6, do_sample=False, eos_token_id=[cfg.text_config.eos_token_id], pad_token_id=0)
    with torch.no_grad():
        tokens = hf.generate(**want, **settings)[:, want["input_ids"].shape[1]:]
    assert greedy_token_ids(model, batch, [cfg.text_config.eos_token_id], 6, 0).tolist() == tokens.tolist()


def test_the_text_holds_each_temporal_patchs_timestamp(job):
    """Frames 0, 2 | 4 (4 repeated) of a 4-fps video: patches at 0.25 s and 1.0 s, written as Qwen3VLProcessor
    rounds them; each patch between its own vision start and end, the record's wrapper gone."""
    from plait.data.sources import parse_record

    sample = job.trainer.processor(parse_record(_records(job.tmp)[0], "train.jsonl:1", job.tmp), prompt_only=True)
    text = job.trainer.tokenizer.decode(torch.unique_consecutive(sample.input_ids))
    assert "user\n<0.2 seconds><|vision_start|><|image_pad|><|vision_end|><1.0 seconds><|vision_start|><|image_pad|>" \
           "<|vision_end|>What ha" in text  # (repeated tokens collapsed)


def test_a_train_step_runs_and_bad_videos_are_named_and_skipped(job):
    """The two records and two bad videos: one frame (shorter than a temporal patch of 2) and a file that is no
    video. ``on_error = "skip"`` trains a step on the good ones and reports the bad ones by id, file and line;
    ``"raise"`` stops naming the record, its file and line, and the video."""
    short = str(write_video(job.tmp / "short.mp4", 1, rate=RATE))
    broken = job.tmp / "broken.mp4"
    broken.write_bytes(b"this is not a video" * 8)
    ask = [{"role": "user", "content": f"{VIDEO_PAD}What happens?"}, {"role": "assistant", "content": "nothing"}]
    bad = [{"id": "short", "videos": [short], "messages": ask}, {"id": "broken", "videos": [str(broken)],
                                                                 "messages": ask}]
    data = write_jsonl(job.tmp / "mixed.jsonl", [*_records(job.tmp), *bad])
    run = job.tmp / "train-run"
    trainer = Trainer.build(load_config(job.job, _overrides(run, data, "--data.on_error=skip")))
    skipped = {s.id: s for s in trainer.train_set.skipped}
    assert set(skipped) == {"short", "broken"} and len(trainer.train_set) == 2
    assert skipped["short"].source == f"{data}:3" and f"video {short}: 1 sampled frame(s) is shorter than one " \
                                                      "temporal patch of 2 frames" in skipped["short"].reason
    assert skipped["broken"].source == f"{data}:4" and f"cannot decode video {broken}" in skipped["broken"].reason
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    result = trainer.fit()
    assert result["steps"] == 1 and all(np.isfinite(result["losses"]))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)
    with pytest.raises(SampleError, match=rf"^record 'short' \({data}:3\): video {short}: 1 sampled frame"):
        Trainer.build(load_config(job.job, _overrides(job.tmp / "raise-run", data, "--data.on_error=raise")))


def _merging_tokenizer() -> T.PreTrainedTokenizerFast:
    """A byte-level BPE trained here whose merges join a space and ``<`` (``Ġ<``, as Qwen's vocabulary does), with
    Qwen's vision tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    bpe.train_from_iterator(["Look, then <0.2 seconds> what happens <1.0 seconds> user assistant it fades"] * 20,
                            trainer)
    tok = T.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                                          "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_the_text_before_a_video_joins_its_first_timestamp_as_in_the_processors_string(tmp_path):
    """``Look, then <|vision_start|><|video_pad|><|vision_end|>``: the processor's string reads ``then <0.2
    seconds>`` and a tokenizer that merges `` <`` writes one token for the space and ``<``; plait tokenizes the text
    before the video again with the timestamp (processing and the metadata pass alike)."""
    from plait.data.processing import ModalitySpec, MultimodalProcessor
    from plait.data.sources import RawSample
    from plait.data.video import VideoSpec
    from plait.models.families.qwen3_vl import TimestampedPatches
    from plait.models.families.qwen2_5_vl import Qwen25VLFeatureCount

    tok = _merging_tokenizer()
    assert tok.encode("then <0.2") != tok.encode("then ") + tok.encode("<0.2")  # the case this test is about
    images = T.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64,
                                        max_pixels=4096)
    image_id, video_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    video = VideoSpec("<|video_pad|>", video_id, 2.0, 8, "model.encoders.vision.video", TimestampedPatches(2, 2))
    spec = ModalitySpec("vision", "image", "<|image_pad|>", image_id, images, Qwen25VLFeatureCount(2, 4096),
                        video=video)
    processor = MultimodalProcessor(tok, [spec], 512)
    clip = str(write_video(tmp_path / "clip.mp4", FRAMES, rate=RATE))
    messages = ({"role": "user", "content": f"Look, then {VIDEO_PAD}what happens?"},
                {"role": "assistant", "content": "it fades"})
    raw = RawSample("look", "t", messages, {"video": (clip,)}, "look.jsonl:1")
    sample = processor(raw)
    assert record_metadata(processor, raw) == sample.meta
    text = tok.apply_chat_template(list(messages), tokenize=False)
    meta = SimpleNamespace(fps=float(RATE), frames_indices=[0, 2, 4])
    run = _hf_processor(tok, images).replace_video_token({"video_grid_thw": torch.tensor([[2, 6, 8]]),
                                                         "video_metadata": [meta]}, 0)
    hf_text, _ = _hf_processor(tok, images).get_text_with_replacements([text], [], [run])
    want = torch.tensor(tok(hf_text[0], add_special_tokens=False)["input_ids"])
    assert sample.input_ids.tolist() == torch.where(want == video_id, image_id, want).tolist()
    assert "Ġ<" in tok.convert_ids_to_tokens(sample.input_ids.tolist())
