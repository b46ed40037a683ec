"""A tiny ``Qwen3OmniMoeThinkerForConditionalGeneration`` (2-block vision tower of 4-pixel patches merged 2x2 with
DeepStack features for both LLM layers, 2-layer audio tower over 100-frame chunks, 2-layer MoE text model of 4
experts, top 2) and its token rows (:func:`tests.helpers.qwen2_5_omni.rows` with ``thinker = "qwen3_omni_moe"``: the
same token ids, audio counted and clips laid out by this thinker). Shared by tests/unit/models/test_qwen3_omni_moe*.py."""

from __future__ import annotations

import torch
import transformers as T

from tests.helpers.qwen2_5_omni import AEND, ASTART, AUDIO, IMAGE, MEL, VEND, VIDEO, VSTART, rows

__all__ = ["THINKER", "TEXT", "VISION", "AUDIO_TOWER", "thinker_config", "tiny_thinker", "q3_rows", "save_thinker"]

THINKER = "qwen3_omni_moe"
TEXT = dict(hidden_size=48, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12, vocab_size=512,
            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2],
                             "interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
AUDIO_TOWER = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                   n_window=50, n_window_infer=200, output_dim=48, downsample_hidden_size=8)


def thinker_config(**ids: int) -> T.Qwen3OmniMoeThinkerConfig:
    """The tiny ``Qwen3OmniMoeThinkerConfig`` (token ids of :mod:`tests.helpers.qwen2_5_omni`, or ``ids``)."""
    tokens = dict(image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO, vision_start_token_id=VSTART,
                  vision_end_token_id=VEND, audio_start_token_id=ASTART, audio_end_token_id=AEND) | ids
    return T.Qwen3OmniMoeThinkerConfig(text_config=dict(TEXT), vision_config=dict(VISION),
                                       audio_config=dict(AUDIO_TOWER), **tokens)


def tiny_thinker(seed: int = 0, **ids: int) -> T.Qwen3OmniMoeThinkerForConditionalGeneration:
    """The tiny thinker in eval mode, every parameter random (norms, mergers and routers not left at their init)."""
    torch.manual_seed(seed)
    model = T.Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config(**ids))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def q3_rows(layout: list[list[tuple[str, object]]], seed: int = 0, left: bool = False,
            second_per_grid: float = 1.0):
    """:func:`tests.helpers.qwen2_5_omni.rows` for this thinker."""
    return rows(layout, seed, left, THINKER, second_per_grid)


QWEN3_OMNI_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|audio_pad|>", "<|vision_start|>", "<|vision_end|>",
                     "<|audio_start|>", "<|audio_end|>"]


def save_thinker(folder, seed: int = 0):
    """A tiny thinker whose ids are the demo tokenizer's (with :data:`QWEN3_OMNI_TOKENS` added) saved as a Hugging
    Face folder with its processor's files (one ``preprocessor_config.json`` of the image processor and feature
    extractor, the tokenizer, its chat template, ``processor_config.json``), as the published thinker ships them."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from tests.helpers.jobs import DEMO
    from tests.helpers.qwen2_5_omni import omni_media_processors

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": QWEN3_OMNI_TOKENS}, replace_extra_special_tokens=False)
    image, video, audio, vs, ve, aus, aue = tok.convert_tokens_to_ids(QWEN3_OMNI_TOKENS)
    model = tiny_thinker(seed, image_token_id=image, video_token_id=video, audio_token_id=audio,
                         vision_start_token_id=vs, vision_end_token_id=ve, audio_start_token_id=aus,
                         audio_end_token_id=aue)
    model.config.text_config.eos_token_id, model.config.text_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(folder)
    image_proc, audio_proc = omni_media_processors()
    merged = {**json.loads(audio_proc.to_json_string()), **json.loads(image_proc.to_json_string())}
    (folder / "preprocessor_config.json").write_text(json.dumps(merged))
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(tok.chat_template)
    (folder / "processor_config.json").write_text('{"processor_class": "Qwen3OmniMoeProcessor"}')
    return folder
