"""A tiny ``Qwen2_5OmniThinkerForConditionalGeneration`` (2-block vision tower of 4-pixel patches merged 2x2, 2-layer
audio tower over 16-frame chunks, 2-layer M-RoPE text model) and token rows with images, audio clips and videos
with their audio track (``use_audio_in_video``: video and audio chunks interleaved by 2-s spans), as transformers'
inputs and as plait's (items, M-RoPE positions of :func:`plait.data.omni_positions.omni_positions`). Shared by
tests/unit/models/test_qwen2_5_omni*.py and tests/distributed/test_omni_parallel.py."""

from __future__ import annotations

import math

import torch
import transformers as T

from plait.data.omni_positions import THINKERS, OmniItem, omni_positions

__all__ = ["IMAGE", "VIDEO", "AUDIO", "VSTART", "VEND", "ASTART", "AEND", "MEL", "WINDOW", "thinker_config",
           "tiny_thinker", "Rows", "rows"]

IMAGE, VIDEO, AUDIO, VSTART, VEND, ASTART, AEND = 7, 8, 9, 5, 6, 10, 11
"""Placeholder and start/end token ids of the tiny config."""
MEL, WINDOW, HOP, RATE = 16, 3000, 160, 16000
"""Mel bins, frames of a feature-extractor window, hop (samples) and sampling rate of the tiny audio tower."""
TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=512, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, window_size=16, out_hidden_size=48, fullatt_block_indexes=[1])
AUDIO_TOWER = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                   n_window=8, output_dim=48)


def thinker_config(tied: bool = False) -> T.Qwen2_5OmniThinkerConfig:
    """The tiny ``Qwen2_5OmniThinkerConfig`` (``tied``: ``lm_head`` shares the input embeddings)."""
    return T.Qwen2_5OmniThinkerConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=tied,
                                      audio_config=dict(AUDIO_TOWER), image_token_index=IMAGE,
                                      video_token_index=VIDEO, audio_token_index=AUDIO, vision_start_token_id=VSTART,
                                      vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND)


def tiny_thinker(seed: int = 0, tied: bool = False) -> T.Qwen2_5OmniThinkerForConditionalGeneration:
    """The tiny thinker in eval mode, every parameter random (norms and mergers not left at their init)."""
    torch.manual_seed(seed)
    model = T.Qwen2_5OmniThinkerForConditionalGeneration(thinker_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _audio_tokens(samples: int, thinker: str = "qwen2_5_omni") -> int:
    frames = math.ceil(samples / HOP)
    if thinker == "qwen3_omni_moe":
        from plait.models.families.qwen3_omni_moe import audio_token_count
        return audio_token_count(frames)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class Rows:
    """Token rows and both models' inputs.

    Layout items: ``("image", (1, h, w))``, ``("audio", samples)``, ``("video", (t, h, w))`` (no audio track) or
    ``("clip", ((t, h, w), samples))`` (a video with its audio track; ``second_per_grid`` seconds per temporal patch,
    1 s: sampled at 2 frames per second). A row has clips or silent videos, not both (the thinker positions a row one way).

    Attributes:
        input_ids: ``[B, N]`` transformers' ids (video tokens ``<|VIDEO|>``); attention_mask ``[B, N]``.
        plait_ids: the rows with video tokens as the vision branch's placeholder (``<|IMAGE|>``).
        hf: transformers' keyword arguments; modality_inputs: plait's.
        rope: plait's positions ``[3, B, N]`` (0 on padding); item_ids ``[B, N]`` (-1 on text; items counted per row).
        docs: per row, its items (:class:`plait.data.omni_positions.OmniItem`).
    """

    def __init__(self, layout: list[list[tuple[str, object]]], seed: int, left: bool,
                 thinker: str = "qwen2_5_omni", second_per_grid: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        ids_rows, item_rows, docs = [], [], []
        images, videos, seconds, audio_feats, audio_frames, vis_items = [], [], [], [], [], []
        audio_samples, clips_used = [], False
        for row in layout:
            ids, item = [1] + torch.randint(20, 500, (3,), generator=g).tolist(), [-1] * 4
            items: list[OmniItem] = []
            for kind, spec in row:
                if kind in ("image", "video", "clip"):
                    grid = spec[0] if kind == "clip" else spec
                    t, h, w = grid
                    pixels = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=g)
                    vis_items.append((pixels, grid))
                    (images if kind == "image" else videos).append((pixels, grid))
                    if kind != "image":
                        seconds.append(second_per_grid)
                    vid = len(items)
                    items.append(OmniItem("image" if kind == "image" else "video", tuple(grid),
                                          second_per_grid if kind != "image" else 0.0, 25.0))
                    n = t * h * w // 4
                if kind in ("audio", "clip"):
                    samples = spec[1] if kind == "clip" else spec
                    frames = math.ceil(samples / HOP)
                    feats = torch.zeros(MEL, WINDOW)
                    feats[:, :frames] = torch.randn(MEL, frames, generator=g)
                    audio_feats.append(feats)
                    audio_frames.append(frames)
                    audio_samples.append(samples)
                    aud = len(items)
                    items.append(OmniItem("audio"))
                    k = _audio_tokens(samples, thinker)
                if kind == "clip":
                    clips_used = True
                    items[vid] = OmniItem("video", tuple(grid), second_per_grid, 25.0, clip=aud)
                    ids += [VSTART, ASTART]
                    item += [-1, -1]
                    for what, m in THINKERS[thinker].layout(grid, 2, second_per_grid, k, 25.0, 2.0):
                        ids += [VIDEO if what == "video" else AUDIO] * m
                        item += [vid if what == "video" else aud] * m
                    ids += [AEND, VEND]
                    item += [-1, -1]
                elif kind == "audio":
                    ids += [ASTART] + [AUDIO] * k + [AEND]
                    item += [-1] + [aud] * k + [-1]
                else:
                    ids += [VSTART] + [IMAGE if kind == "image" else VIDEO] * n + [VEND]
                    item += [-1] + [vid] * n + [-1]
                tail = torch.randint(20, 500, (2,), generator=g).tolist()
                ids, item = ids + tail, item + [-1] * 2
            ids_rows.append(ids)
            item_rows.append(item)
            docs.append(items)
        width = max(map(len, ids_rows))
        pad = [width - len(r) for r in ids_rows]

        def padded(rows: list[list[int]], value: int) -> torch.Tensor:
            return torch.tensor([[value] * p + r if left else r + [value] * p for r, p in zip(rows, pad)])

        self.docs = docs
        self.input_ids, self.item_ids = padded(ids_rows, 0), padded(item_rows, -1)
        self.attention_mask = padded([[1] * len(r) for r in ids_rows], 0)
        self.plait_ids = torch.where(self.input_ids == VIDEO, IMAGE, self.input_ids)
        found = [omni_positions(self.plait_ids[r][self.attention_mask[r] == 1],
                                self.item_ids[r][self.attention_mask[r] == 1], items, thinker=thinker)
                 for r, items in enumerate(docs)]
        dtype = torch.float32 if any(p.is_floating_point() for p in found) else torch.long
        self.rope = torch.zeros(3, *self.input_ids.shape, dtype=dtype)
        for r, p in enumerate(found):
            self.rope[:, r, self.attention_mask[r] == 1] = p.to(dtype)
        self.hf = dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                       use_audio_in_video=clips_used)
        if images:
            self.hf |= dict(pixel_values=torch.cat([p for p, _ in images]),
                            image_grid_thw=torch.tensor([g for _, g in images]))
        if videos:
            self.hf |= dict(pixel_values_videos=torch.cat([p for p, _ in videos]),
                            video_grid_thw=torch.tensor([g for _, g in videos]),
                            video_second_per_grid=torch.tensor(seconds))
        self.modality_inputs: dict = {}
        if vis_items:
            self.modality_inputs["vision"] = {"pixel_values": [p for p, _ in vis_items],
                                              "image_grid_thw": [torch.tensor(g) for _, g in vis_items]}
        if audio_feats:
            feats = torch.stack(audio_feats)
            mask = (torch.arange(WINDOW)[None] < torch.tensor(audio_frames)[:, None]).long()
            self.hf |= dict(input_features=feats, feature_attention_mask=mask)
            self.modality_inputs["audio"] = {"input_features": feats, "num_samples": torch.tensor(audio_samples)}

    @property
    def positions(self) -> torch.Tensor:
        """1-D positions ``[B, N]`` (0 on padding)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


def rows(layout: list[list[tuple[str, object]]], seed: int = 0, left: bool = False,
         thinker: str = "qwen2_5_omni", second_per_grid: float = 1.0) -> Rows:
    """:class:`Rows` of ``layout`` (see its docstring; ``second_per_grid``: seconds per temporal patch of every
    video)."""
    return Rows(layout, seed, left, thinker, second_per_grid)


OMNI_TOKENS = ["<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>", "<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>",
               "<|audio_eos|>"]


def omni_tokenizer():
    """The demo tokenizer (ChatML) with the thinker's placeholder and start/end tokens added."""
    from transformers import AutoTokenizer

    from tests.helpers.jobs import DEMO

    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": OMNI_TOKENS}, replace_extra_special_tokens=False)
    return tok


def tokenizer_thinker(tok, seed: int = 0) -> T.Qwen2_5OmniThinkerForConditionalGeneration:
    """:func:`tiny_thinker` whose token ids are ``tok``'s (:data:`OMNI_TOKENS`), eos and pad the tokenizer's."""
    image, video, audio, vbos, veos, abos, aeos = tok.convert_tokens_to_ids(OMNI_TOKENS)
    cfg = thinker_config()
    cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id = image, video, audio
    cfg.vision_start_token_id, cfg.vision_end_token_id = vbos, veos
    cfg.audio_start_token_id, cfg.audio_end_token_id = abos, aeos
    cfg.text_config.eos_token_id, cfg.text_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    torch.manual_seed(seed)
    model = T.Qwen2_5OmniThinkerForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval()


def omni_media_processors():
    """The tiny towers' processors: ``Qwen2VLImageProcessorPil`` (4-pixel patches, merge 2) and a 16-bin
    ``WhisperFeatureExtractor`` (30-s windows, 16 kHz)."""
    image = T.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64,
                                       max_pixels=32 * 32)
    return image, T.WhisperFeatureExtractor(feature_size=MEL, sampling_rate=RATE, hop_length=HOP)


def write_clip(path, frames: int, rate: int = 2, audio_s: float | None = None, width: int = 16,
               height: int = 16):
    """A Matroska video of ``frames`` frames (FFV1) at ``rate`` frames per second with a mono 16-kHz PCM audio track
    of ``audio_s`` seconds (a 440-Hz tone; None: no audio track)."""
    import av
    import numpy as np

    from tests.media import frame_array

    with av.open(str(path), "w", format="matroska") as container:
        video = container.add_stream("ffv1", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        sound = None
        if audio_s is not None:
            sound = container.add_stream("pcm_s16le", rate=RATE)
            sound.layout = "mono"
        for i in range(frames):
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame_array(i, width, height), format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            n = int(audio_s * RATE)
            wave = (np.sin(np.arange(n) * 2 * np.pi * 440 / RATE) * 12000).astype(np.int16)
            for start in range(0, n, 1600):
                block = av.AudioFrame.from_ndarray(wave[None, start:start + 1600], format="s16", layout="mono")
                block.sample_rate = RATE
                container.mux(sound.encode(block))
            container.mux(sound.encode())
    return path


def save_thinker(folder, seed: int = 0):
    """:func:`tokenizer_thinker` saved as a Hugging Face thinker folder with the files of its processor (one
    ``preprocessor_config.json`` of the image processor and feature extractor, the tokenizer, its chat template,
    ``processor_config.json`` naming ``Qwen2_5OmniProcessor``), as the published thinker ships them."""
    import json
    from pathlib import Path

    folder = Path(folder)
    tok = omni_tokenizer()
    tokenizer_thinker(tok, seed).save_pretrained(folder)
    image, audio = omni_media_processors()
    merged = {**json.loads(audio.to_json_string()), **json.loads(image.to_json_string())}
    (folder / "preprocessor_config.json").write_text(json.dumps(merged))
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(tok.chat_template)
    (folder / "processor_config.json").write_text('{"processor_class": "Qwen2_5OmniProcessor"}')
    return folder


OMNI_LLM = dict(model_type="qwen2_5_omni_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
"""The thinker's text model at the tiny LLM's sizes (M-RoPE sections of the 8-wide heads)."""
CLIP_TEXT = "<|vision_bos|><|audio_bos|><|VIDEO|><|audio_eos|><|vision_eos|>"


def omni_job(tmp_path, run: str) -> dict:
    """A 2-step job (run folder ``<tmp_path>/<run>``) of the thinker's composition built from config tables (Omni
    vision tower, Omni audio tower with a 4-s window, the thinker's text model) on two clips (a video with its audio
    track: 4 s of video at 2 frames per second, 3 s and 4 s of audio), an image record and a text record; videos take
    their audio tracks (``video.audio = true``)."""
    from tests.helpers.jobs import demo_records, tiny_config_dict, write_jsonl

    folder = tmp_path / "tokenizer"
    if not folder.is_dir():
        omni_tokenizer().save_pretrained(folder)
    clips = [write_clip(tmp_path / f"clip{i}.mkv", 8, rate=2, audio_s=s) for i, s in enumerate((3.0, 4.0))]
    records = [{"id": f"clip-{i}", "task": "clip", "videos": [str(c)],
                "messages": [{"role": "user", "content": f"{CLIP_TEXT}What is heard?"},
                             {"role": "assistant", "content": "a tone" if i else "a beep"}]}
               for i, c in enumerate(clips)]
    image = demo_records("train", ("image_digit",), limit=1)[0]
    image["messages"][0]["content"] = image["messages"][0]["content"].replace(
        "<image>", "<|vision_bos|><|IMAGE|><|vision_eos|>")
    records = [records[0], image, records[1]] + demo_records("train", ("text",), limit=1)
    data = write_jsonl(tmp_path / "train.jsonl", records)
    job = tiny_config_dict(str(data), None, str(tmp_path / run), data={"shuffle": False, "tokenizer": str(folder)},
                           train={"steps": 2, "global_batch_size": 4, "microbatch_size": 2, "threads": 1},
                           attention={"block_size": 16}, parallel={"timeout_s": 60})
    job["model"]["llm"]["config"] = dict(OMNI_LLM)
    vision = dict(model_type="qwen2_5_omni_vision_encoder", **VISION, )
    vision["out_hidden_size"] = 32
    audio = dict(model_type="qwen2_5_omni_audio_encoder", **AUDIO_TOWER, max_source_positions=200)
    audio["output_dim"] = 32
    job["model"]["encoders"] = {
        "vision": {"modality": "image", "config": vision, "projector": "linear", "placeholder": "<|IMAGE|>",
                   "processor": {"min_pixels": 64, "max_pixels": 32 * 32},
                   "video": {"placeholder": "<|VIDEO|>", "fps": 2.0, "audio": True}},
        "audio": {"modality": "audio", "config": audio, "projector": "linear", "placeholder": "<|AUDIO|>"},
    }
    return job
