"""Numerical check against a peer implementation: transformers' own LLaVA.

A tiny ``LlavaForConditionalGeneration`` is built from a config; its vision tower, projector and language
model weights are copied into a plait ``MultimodalModel`` (CLIP vision tower, second-to-last layer, CLS
dropped, 2-layer MLP projector) and both must give equal logits and loss (fp32, 1e-5).
"""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from plait.models.encoder import ModalityEncoder
from plait.models.hf import build_causal_lm, build_encoder
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector
from plait.train.loss import token_loss_sum

IMAGE_TOKEN = 90


def build_pair():
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=16)
    text = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-2,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    cfg._attn_implementation = "eager"
    llava = LlavaForConditionalGeneration(cfg).eval()

    llm = build_causal_lm(config={**text.to_dict(), "model_type": "llama"}, attn_implementation="eager")
    llm.model.load_state_dict(llava.model.language_model.state_dict())
    llm.lm_head.load_state_dict(llava.lm_head.state_dict())
    tower = build_encoder("image", config={**vision.to_dict(), "model_type": "clip_vision_model"})
    tower.load_state_dict(llava.model.vision_tower.state_dict())
    projector = build_projector("mlp", 32, 48)
    projector.linear_1.load_state_dict(llava.model.multi_modal_projector.linear_1.state_dict())
    projector.linear_2.load_state_dict(llava.model.multi_modal_projector.linear_2.state_dict())
    branch = ModalityEncoder(tower, projector, "image", feature_layer=-2, select="drop_cls")
    plait_model = MultimodalModel(llm, {"vision": branch}, {"vision": IMAGE_TOKEN}).eval()
    return llava, plait_model


def test_logits_and_loss_equal_transformers_llava():
    llava, model = build_pair()
    n_img = model.encoders["vision"].feature_count((32, 32))
    assert n_img == 16  # (32 / 8)^2 patches, CLS dropped
    ids = torch.randint(1, 80, (2, n_img + 10))
    ids[0, 2 : 2 + n_img] = IMAGE_TOKEN
    ids[1, 5 : 5 + n_img] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 32, 32)
    hf_labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)

    with torch.no_grad():
        ref = llava(input_ids=ids, pixel_values=pixels, labels=hf_labels)
        logits = model(ids, {"vision": {"pixel_values": list(pixels)}})
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)

    shifted = torch.full_like(hf_labels, -100)
    shifted[:, :-1] = hf_labels[:, 1:]
    loss = token_loss_sum(logits, shifted) / (shifted != -100).sum()
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-5)
