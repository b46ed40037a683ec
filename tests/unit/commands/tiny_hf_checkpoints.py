"""Tiny Hugging Face checkpoints of the architectures plait imports, exports and whose recipes it ships, built from
configs and saved locally with their processors (the demo tokenizer, whose vocabulary holds ``<image>`` and
``<audio>``). Shared by tests/unit/commands/test_import_export_hf.py and tests/e2e/test_recipes.py."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from tests.helpers.jobs import DEMO

__all__ = ["LLAVA_TEMPLATE", "VOCAB", "tokenizer", "save_llava", "save_qwen2_audio", "save_qwen2_5_vl",
           "QWEN_VL_TOKENS", "QWEN_VL_PIXELS", "save_llm", "save_clip",
           "save_siglip", "save_whisper"]

VOCAB = 512
"""LLM vocabulary rows: more than the demo tokenizer has tokens (spare rows, as Qwen2's)."""
IMAGE_ID, AUDIO_ID = 5, 6
"""``<image>`` and ``<audio>`` in the demo tokenizer."""

LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
"""The typed-content chat template of llava-hf/llava-1.5-7b-hf's processor (string contents render as nothing)."""

_TEXT = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32,
             patch_size=8, projection_dim=16)
_QWEN2_AUDIO = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                    max_source_positions=150)


def tokenizer() -> T.PreTrainedTokenizerBase:
    """The demo tokenizer (ChatML template, ``<|eos|>``, ``<image>``, ``<audio>``)."""
    return T.AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))


def _image_processor() -> T.CLIPImageProcessorPil:
    return T.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _feature_extractor() -> T.WhisperFeatureExtractor:
    return T.WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=3)


def save_llava(folder: Path, seed: int = 0, typed_template: bool = True, dtype: torch.dtype = torch.float32,
               tied: bool = False) -> Path:
    """A tiny LLaVA-1.5-style checkpoint (CLIP tower, layer -2, CLS dropped, Linear-GELU-Linear, Llama; ``tied``: the
    LLM's input and output embeddings tied) in ``dtype`` with its ``LlavaProcessor``; ``typed_template``: LLaVA's own
    typed-content chat template, else the demo's ChatML."""
    torch.manual_seed(seed)
    text = T.LlamaConfig(**(_TEXT | {"tie_word_embeddings": tied}))
    cfg = T.LlavaConfig(vision_config=T.CLIPVisionConfig(**_CLIP), text_config=text,
                        image_token_id=IMAGE_ID, vision_feature_layer=-2, vision_feature_select_strategy="default",
                        image_seq_length=16)
    model = T.LlavaForConditionalGeneration(cfg)
    _randomise(model)
    model.to(dtype).save_pretrained(folder)
    tok = tokenizer()
    template = LLAVA_TEMPLATE if typed_template else tok.chat_template
    T.LlavaProcessor(image_processor=_image_processor(), tokenizer=tok, patch_size=8, chat_template=template,
                     vision_feature_select_strategy="default", image_token="<image>",
                     num_additional_image_tokens=1).save_pretrained(folder)
    return folder


def save_qwen2_audio(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                     qwen_tokens: bool = False) -> Path:
    """A tiny Qwen2-Audio checkpoint (Qwen2AudioEncoder with a 3 s window, one-Linear projector, Qwen2) in ``dtype``
    with its ``Qwen2AudioProcessor`` (placeholder ``<audio>``; ``qwen_tokens``: Qwen2-Audio's own
    ``<|audio_bos|>``, ``<|AUDIO|>`` (the placeholder) and ``<|audio_eos|>`` added as special tokens)."""
    torch.manual_seed(seed)
    tok = tokenizer()
    if qwen_tokens:
        tok.add_special_tokens({"additional_special_tokens": ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]})
    token = "<|AUDIO|>" if qwen_tokens else "<audio>"
    text = T.Qwen2Config(**_TEXT)
    cfg = T.Qwen2AudioConfig(audio_config=T.Qwen2AudioEncoderConfig(**_QWEN2_AUDIO), text_config=text,
                             audio_token_id=tok.convert_tokens_to_ids(token))
    model = T.Qwen2AudioForConditionalGeneration(cfg)
    _randomise(model)
    model.to(dtype).save_pretrained(folder)
    T.Qwen2AudioProcessor(feature_extractor=_feature_extractor(), tokenizer=tok, chat_template=tok.chat_template,
                          audio_token=token).save_pretrained(folder)
    return folder


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2.5-VL's vision tokens, added to the demo tokenizer as special tokens."""
_QWEN_VL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, window_size=56,
                       out_hidden_size=48, fullatt_block_indexes=[1], temporal_patch_size=2, spatial_merge_size=2)
QWEN_VL_PIXELS = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 30)
"""The tiny Qwen2.5-VL image processor's pixel range (a few merged blocks per image)."""


def save_qwen2_5_vl(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, tied: bool = False) -> Path:
    """A tiny ``Qwen2_5_VLForConditionalGeneration`` (window attention, 2x2 merger to the LLM width, M-RoPE sections
    [2, 2, 2] of the 12-wide heads) in ``dtype`` with its ``Qwen2_5_VLProcessor`` files (PIL image processor, no video
    processor: it needs torchvision): the demo tokenizer with :data:`QWEN_VL_TOKENS` and its ChatML template."""
    torch.manual_seed(seed)
    tok = tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_VL_TOKENS)})
    start, end, image, video = tok.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    text = dict(_TEXT | {"tie_word_embeddings": tied},
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
    cfg = T.Qwen2_5_VLConfig(vision_config=_QWEN_VL_VISION, text_config=text, image_token_id=image,
                             video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                             tie_word_embeddings=tied)
    model = T.Qwen2_5_VLForConditionalGeneration(cfg)
    _randomise(model)
    model.to(dtype).save_pretrained(folder)
    # Qwen2_5_VLProcessor's own save needs torchvision (its video processor): the files it would write
    T.Qwen2VLImageProcessorPil(**QWEN_VL_PIXELS).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(tok.chat_template)
    (folder / "processor_config.json").write_text('{"processor_class": "Qwen2_5_VLProcessor"}')
    return folder


def _randomise(model: torch.nn.Module) -> None:
    """Every tensor random (HF's init leaves biases and norms at 0/1, which would hide a mapping mistake)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)


def save_llm(folder: Path, model_type: str = "llama") -> Path:
    """A tiny causal LM (``llama`` or ``qwen2``) with the demo tokenizer, as a Hugging Face folder."""
    cfg = (T.LlamaConfig if model_type == "llama" else T.Qwen2Config)(**_TEXT)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def save_clip(folder: Path) -> Path:
    """A tiny CLIP vision tower with its image processor."""
    T.CLIPVisionModel(T.CLIPVisionConfig(**_CLIP)).save_pretrained(folder)
    _image_processor().save_pretrained(folder)
    return folder


def save_siglip(folder: Path) -> Path:
    """A tiny SigLIP vision tower with its image processor (32 px, no resize needed)."""
    cfg = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                               image_size=32, patch_size=8)
    T.SiglipVisionModel(cfg).save_pretrained(folder)
    T.SiglipImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def save_whisper(folder: Path) -> Path:
    """A tiny Whisper model (plait takes its encoder) with a 3 s feature extractor."""
    cfg = T.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          num_mel_bins=80, max_source_positions=150, decoder_layers=1, decoder_attention_heads=2,
                          decoder_ffn_dim=32, vocab_size=64, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, decoder_start_token_id=1)
    T.WhisperForConditionalGeneration(cfg).save_pretrained(folder)
    _feature_extractor().save_pretrained(folder)
    return folder
