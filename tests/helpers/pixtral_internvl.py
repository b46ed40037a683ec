"""Helpers of several test modules, taken from tests/unit/models/test_pixtral_internvl.py: a test module imports these
from here, never from another test module."""

from __future__ import annotations

import numpy as np
import torch
import transformers as T
from PIL import Image

from plait.models.encoder import ModalityEncoder
from tests.helpers.jobs import tiny_config_dict, write_jsonl


TINY_PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, head_dim=16, patch_size=4, image_size=32, num_channels=3)
TINY_INTERNVL = dict(model_type="internvl_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, patch_size=4, image_size=32, num_channels=3)


def config_kwargs(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "model_type"}


def random_images(sizes) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def tiny_pixtral(attn: str = "eager", layers: int = 2) -> T.PixtralVisionModel:
    torch.manual_seed(0)
    cfg = T.PixtralVisionConfig(**dict(config_kwargs(TINY_PIXTRAL), num_hidden_layers=layers), attn_implementation=attn)
    return T.PixtralVisionModel(cfg).eval()


def internvl_model(ratio: float = 0.5) -> T.InternVLModel:
    torch.manual_seed(0)
    text = T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    full = T.InternVLConfig(vision_config=config_kwargs(TINY_INTERNVL), text_config=text.to_dict(), downsample_ratio=ratio)
    full.vision_config._attn_implementation = "eager"
    return T.InternVLModel(full).eval()


def tiling_processor(**kwargs) -> T.GotOcr2ImageProcessorPil:
    return T.GotOcr2ImageProcessorPil(crop_to_patches=True, size={"height": 32, "width": 32}, max_patches=6,
                                      **kwargs)


def stock_projector_input(model: T.InternVLModel, pixel_values: torch.Tensor, branch: ModalityEncoder,
                          tiles: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(get_image_features' output, its projector's input, the branch's features of tiles)`` (no grad)."""
    seen = {}
    hook = model.multi_modal_projector.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        stock = model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-1,
                                         vision_feature_select_strategy="default").pooler_output
        mine = branch.encoder_forward({"pixel_values": tiles})
    hook.remove()
    return stock, seen["x"], mine


def vision_family_job(tmp_path, family: str, processor: dict) -> dict:
    image = tmp_path / "wide.png"
    random_images([(24, 40)])[0].save(image)
    ask = {"role": "user", "content": "<image>\nWhat is it?"}
    data = write_jsonl(tmp_path / "train.jsonl", [{"id": "wide-0", "task": "t", "images": [str(image)],
                                                   "messages": [ask, {"role": "assistant", "content": "six"}]}])
    cfg = tiny_config_dict(str(data), None, str(tmp_path / "run"))
    branch = {"modality": "image", "config": dict(TINY_PIXTRAL if family == "pixtral" else TINY_INTERNVL),
              "processor": processor}
    if family == "internvl":
        branch.update(select="drop_cls", downsample=2)
    cfg["model"]["encoders"] = {"vision": branch}
    return cfg
