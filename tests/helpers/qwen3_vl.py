"""A tiny ``Qwen3VLForConditionalGeneration`` (3-block tower of 4-pixel patches merged 2x2, DeepStack after blocks 0
and 1 into LLM layers 0 and 1 of a 3-layer text model with interleaved M-RoPE) and its inputs as token rows with
images and videos between ``<|vision_start|>`` and ``<|vision_end|>``, and the same rows as plait's inputs (items,
grids, M-RoPE positions). Shared by tests/unit/models/test_qwen3_vl.py and the distributed Qwen3-VL tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from plait.data.mrope import mrope_positions

__all__ = ["IMAGE", "VIDEO", "START", "END", "TEXT", "VISION", "qwen3_vl_config", "tiny_qwen3_vl", "Rows", "rows",
           "save_qwen3_vl"]

IMAGE, VIDEO, START, END = 7, 8, 5, 6
"""``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>`` ids of the tiny config."""
TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])


def qwen3_vl_config(tied: bool = False) -> T.Qwen3VLConfig:
    """The tiny ``Qwen3VLConfig``."""
    return T.Qwen3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                           tie_word_embeddings=tied)


def tiny_qwen3_vl(seed: int = 0, tied: bool = False) -> T.Qwen3VLForConditionalGeneration:
    """The tiny model in eval mode, every tensor random (norms and mergers not left at their init)."""
    torch.manual_seed(seed)
    model = T.Qwen3VLForConditionalGeneration(qwen3_vl_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


class Rows:
    """Token rows and both models' inputs.

    Attributes:
        input_ids: ``[B, N]`` with video tokens as ``<|video_pad|>`` (transformers' ids); attention_mask ``[B, N]``.
        plait_ids: the same rows with every visual token the branch's placeholder (``<|image_pad|>``).
        pixels, grids: plait's items (each image, each video frame pair) ``[t h w, C T p p]`` and ``(1, h, w)``.
        hf: transformers' keyword arguments (``pixel_values``, ``image_grid_thw``, videos, ``mm_token_type_ids``).
        rope: plait's M-RoPE positions ``[3, B, N]`` (:func:`plait.data.mrope.mrope_positions` per row, 0 on padding).
        item_ids: ``[B, N]`` the item of each visual token (-1 on text).
    """

    def __init__(self, layout: list[list[tuple[str, tuple[int, int, int]]]], seed: int, left: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        per_patch = 3 * 2 * 4 * 4
        ids_rows, item_rows, grid_rows, images, videos, items = [], [], [], [], [], []
        for row in layout:
            ids, item, row_grids = [1] + torch.randint(20, 500, (3,), generator=g).tolist(), [-1] * 4, []
            for kind, (t, h, w) in row:
                pixels = torch.randn(t * h * w, per_patch, generator=g)
                (videos if kind == "video" else images).append((pixels, (t, h, w)))
                for frame in range(t):  # a video: a timestamp, then each temporal patch wrapped as one item
                    if kind == "video":
                        ids += [30 + frame, 31]
                        item += [-1, -1]
                    n = h * w // 4
                    ids += [START] + [VIDEO if kind == "video" else IMAGE] * n + [END]
                    item += [-1] + [len(items)] * n + [-1]
                    items.append((pixels[frame * h * w:(frame + 1) * h * w], (1, h, w)))
                    row_grids.append((1, h, w))
                tail = torch.randint(20, 500, (3,), generator=g).tolist()
                ids, item = ids + tail, item + [-1] * 3
            ids_rows.append(ids)
            item_rows.append(item)
            grid_rows.append(row_grids)
        width = max(map(len, ids_rows))
        pad = [width - len(r) for r in ids_rows]

        def padded(rows: list[list[int]], value: int) -> torch.Tensor:
            return torch.tensor([[value] * p + r if left else r + [value] * p for r, p in zip(rows, pad)])

        self.input_ids, self.item_ids = padded(ids_rows, 0), padded(item_rows, -1)
        self.attention_mask = padded([[1] * len(r) for r in ids_rows], 0)
        self.plait_ids = torch.where(self.input_ids == VIDEO, IMAGE, self.input_ids)
        self.pixels = [p for p, _ in items]
        self.grids = [torch.tensor(g) for _, g in items]
        self.rope = torch.zeros(3, *self.input_ids.shape, dtype=torch.long)
        for r in range(len(layout)):
            real = self.attention_mask[r] == 1
            local = self.item_ids[r][real]
            first = int(local[local >= 0].min()) if bool((local >= 0).any()) else 0
            grids = [tuple(int(v) for v in g) for g in self.grids]
            self.rope[:, r, real] = mrope_positions(self.plait_ids[r][real], torch.where(local >= 0, local - first, -1),
                                                    grids[first:])
        types = (self.input_ids == IMAGE).int() + 2 * (self.input_ids == VIDEO).int()
        self.hf = dict(input_ids=self.input_ids, attention_mask=self.attention_mask, mm_token_type_ids=types)
        if images:
            self.hf |= dict(pixel_values=torch.cat([p for p, _ in images]),
                            image_grid_thw=torch.tensor([g for _, g in images]))
        if videos:
            self.hf |= dict(pixel_values_videos=torch.cat([p for p, _ in videos]),
                            video_grid_thw=torch.tensor([g for _, g in videos]))

    @property
    def modality_inputs(self) -> dict:
        """plait's inputs of the vision branch."""
        return {"vision": {"pixel_values": self.pixels, "image_grid_thw": self.grids}} if self.pixels else {}

    @property
    def positions(self) -> torch.Tensor:
        """1-D positions ``[B, N]`` (0 on padding)."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)


def rows(layout: list[list[tuple[str, tuple[int, int, int]]]], seed: int = 0, left: bool = False) -> Rows:
    """:class:`Rows` of ``layout``: per row its items, ``("image", (1, h, w))`` or ``("video", (t, h, w))``."""
    return Rows(layout, seed, left)


def save_qwen3_vl(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, tied: bool = False,
                  build=None) -> Path:
    """The tiny model in ``dtype`` with the files of its processor: ``Qwen2VLImageProcessorPil`` (4-pixel patches,
    merge 2) and the demo tokenizer with Qwen's vision tokens added (ids set in the config); ``build(seed, tied)``
    makes another tiny model of the family (default :func:`tiny_qwen3_vl`)."""
    from tests.unit.commands.tiny_hf_checkpoints import tokenizer

    tok = tokenizer()
    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    start, end, image, video = tok.convert_tokens_to_ids(names)
    model = (build or tiny_qwen3_vl)(seed, tied)
    cfg = model.config
    cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id = start, end, image, video
    cfg.text_config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(dtype).save_pretrained(folder)
    T.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64,
                               max_pixels=64 * 64).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(tok.chat_template)
    (folder / "processor_config.json").write_text('{"processor_class": "Qwen3VLProcessor"}')
    return folder
