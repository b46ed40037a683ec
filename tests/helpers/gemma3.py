"""A tiny ``Gemma3ForConditionalGeneration`` (SigLIP tower of 8x8 patches pooled 2x2 to 16 tokens per image, a
3-layer Gemma 3 text model whose local layers have a 6-token sliding window) and its inputs: token rows with images
between ``<start_of_image>`` and ``<end_of_image>``, as ``Gemma3Processor`` writes them, and the same rows as plait's
mask metadata. Shared by tests/unit/models/test_gemma3.py and the distributed Gemma 3 tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from plait.attention.masks import MaskInfo

__all__ = ["IMAGE", "BOI", "EOI", "TOKENS", "gemma3_config", "tiny_gemma3", "rows", "hf_kwargs", "mask_info",
           "save_gemma3"]

IMAGE, BOI, EOI = 7, 8, 9
"""``<image_soft_token>``, ``<start_of_image>``, ``<end_of_image>`` ids of the tiny config."""
TOKENS = 16
"""Soft tokens per image (``mm_tokens_per_image``)."""
TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, max_position_embeddings=512, vocab_size=512, sliding_window=6, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4)


def gemma3_config(tied: bool = False, **text: object) -> T.Gemma3Config:
    """The tiny ``Gemma3Config`` (``tied``: ``lm_head`` tied to the embeddings, as Gemma 3 ships; ``text``
    overrides text-config fields)."""
    return T.Gemma3Config(text_config=TEXT | text, vision_config=VISION, mm_tokens_per_image=TOKENS,
                          image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI, tie_word_embeddings=tied)


def tiny_gemma3(seed: int = 0, tied: bool = False, **text: object) -> T.Gemma3ForConditionalGeneration:
    """The tiny model in eval mode, every tensor random (norms and the projector are not left at their init)."""
    torch.manual_seed(seed)
    model = T.Gemma3ForConditionalGeneration(gemma3_config(tied, **text))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def _image_run() -> list[int]:
    return [BOI] + [IMAGE] * TOKENS + [EOI]


def rows(images_per_row: tuple[int, ...] = (2, 1), seed: int = 0, tail: int = 4
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [B, N], attention_mask [B, N], pixel_values [images, 3, 32, 32])``: row ``r`` holds
    ``images_per_row[r]`` images with text before, between and after them (``tail`` tokens after each image),
    right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in images_per_row:
        ids = [1] + torch.randint(20, 500, (3,), generator=g).tolist()
        for _ in range(n):
            ids += _image_run() + torch.randint(20, 500, (tail,), generator=g).tolist()
        out.append(ids)
    width = max(map(len, out))
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in out])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in out])
    pixels = torch.randn(sum(images_per_row), 3, 32, 32, generator=g)
    return input_ids, mask, pixels


def hf_kwargs(input_ids: torch.Tensor, attention_mask: torch.Tensor, pixels: torch.Tensor) -> dict:
    """``Gemma3ForConditionalGeneration``'s inputs of the rows (``token_type_ids`` 1 on image tokens)."""
    return dict(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels,
                token_type_ids=(input_ids == IMAGE).long())


def mask_info(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> MaskInfo:
    """plait's metadata of the rows, as the collator writes it: one document per row (-1 on padding), each image's
    soft tokens one item, positions from 0; ``bidirectional_items``."""
    docs = torch.where(attention_mask.bool(), 0, -1)
    is_image = input_ids == IMAGE
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    items = torch.where(is_image, starts.long().cumsum(-1) - 1, -1)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return MaskInfo(docs.long(), items.long(), positions.long(), "bidirectional_items")


def save_gemma3(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, tied: bool = False) -> Path:
    """The tiny model in ``dtype`` with its ``Gemma3Processor`` (``Gemma3ImageProcessorPil`` at 32x32 pixels; the
    demo tokenizer with ``<start_of_image>``, ``<end_of_image>`` and ``<image_soft_token>`` added as its named special
    tokens, ids :data:`BOI`, :data:`EOI`, :data:`IMAGE` set in the config)."""
    from tests.unit.commands.tiny_hf_checkpoints import tokenizer

    tok = tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]})
    tok._set_model_specific_special_tokens(special_tokens={  # Gemma's tokenizer names them so
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    boi, eoi, image = tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    model = tiny_gemma3(seed, tied)
    model.config.image_token_id, model.config.boi_token_index, model.config.eoi_token_index = image, boi, eoi
    model.config.text_config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.to(dtype).save_pretrained(folder)
    T.Gemma3Processor(image_processor=T.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok,
                      chat_template=tok.chat_template, image_seq_length=TOKENS).save_pretrained(folder)
    return folder
