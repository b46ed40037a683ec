"""Gemma 3 (transformers' ``Gemma3ForConditionalGeneration``) as a plait composite: the facts the import, the export
and generation need.

``Gemma3ForConditionalGeneration`` is a plait composite with one image branch:

- its tower ``model.vision_tower`` is a stock ``SiglipVisionModel`` (plait's SigLIP family) whose features are its
  ``last_hidden_state``, after the post-layernorm (plait's ``select = "post_norm"``, ``feature_layer = -1``);
- ``Gemma3MultiModalProjector`` average-pools each ``k x k`` block of the patch grid (``k = (image_size / patch) /
  sqrt(mm_tokens_per_image)``: plait's SigLIP ``downsample``), applies its RMSNorm ``mm_soft_emb_norm`` and
  multiplies by ``mm_input_projection_weight`` ``[vision hidden, text hidden]``: plait's ``"gemma3"`` projector
  (transformers' ``Gemma3RMSNorm``, then a Linear without bias holding the transposed weight);
- its text model ``model.language_model`` with ``lm_head`` is ``Gemma3ForCausalLM`` (``gemma3_text``: scaled
  embeddings, local sliding-window and global layers), the placeholder ``image_token_id`` (``<image_soft_token>``,
  ``mm_tokens_per_image`` per image between ``<start_of_image>`` and ``<end_of_image>``);
- the tokens of one image attend to each other in both directions (transformers builds this from ``token_type_ids``:
  each run of image tokens one block). plait gives the same from its own metadata: ``attention.mask =
  "bidirectional_items"`` (each image one item) with plait's attention, the sliding window of the local layers
  included (:mod:`plait.attention.masks`); :func:`attends_items` names the LLMs that need it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

__all__ = ["GEMMA3_TOKENS", "attends_items", "gemma3_pool", "gemma3_text_config", "load_gemma3_projector",
           "gemma3_projector_state", "check_gemma3_branch", "gemma3_config", "prefill_items"]

GEMMA3_TOKENS = {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>"}
"""Gemma 3's config ids beyond the placeholder, by config field: the tokens around each image's soft tokens."""


def attends_items(config: Any) -> bool:
    """Whether an LLM of ``config`` lets the tokens of one image see each other both ways (Gemma 3's text model:
    its multimodal class builds that mask from ``token_type_ids``), so plait must run it with ``attention.mask =
    "bidirectional_items"`` and generation must prefill with that mask."""
    return getattr(config, "model_type", "") == "gemma3_text"


def gemma3_pool(config: Any) -> int:
    """The pooling kernel ``k`` of a ``Gemma3Config``'s projector (plait's ``downsample``): the patch grid side over
    ``sqrt(mm_tokens_per_image)``.

    Raises:
        ValueError: when ``mm_tokens_per_image`` is not a square or its side does not divide the patch grid.
    """
    vision = config.vision_config
    side = int(vision.image_size) // int(vision.patch_size)
    tokens = int(config.mm_tokens_per_image)
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"mm_tokens_per_image = {tokens} is not a square whose side divides the tower's {side}x{side} "
                         "patch grid")
    return side // per_side


def gemma3_text_config(config: Any) -> Any:
    """The text config plait's LLM is built from: ``config.text_config`` without ``final_logit_softcapping``,
    which ``Gemma3ForConditionalGeneration`` never applies (``Gemma3ForCausalLM`` would), and with the top-level
    ``tie_word_embeddings`` (the multimodal class ties ``lm_head`` by that one)."""
    text = copy.deepcopy(config.get_text_config())
    text.final_logit_softcapping = None
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
    return text


def load_gemma3_projector(projector: nn.Module, hf_projector: nn.Module) -> None:
    """Load ``Gemma3MultiModalProjector`` ``hf_projector``'s tensors into plait's ``"gemma3"`` projector (its norm
    weight; ``mm_input_projection_weight`` ``[D, H]`` transposed into ``linear_1.weight`` ``[H, D]``), in their dtype."""
    source = hf_projector.state_dict()
    weight = source["mm_input_projection_weight"]
    projector.to(weight.dtype)
    projector.load_state_dict({"norm.weight": source["mm_soft_emb_norm.weight"],
                               "linear_1.weight": weight.t().contiguous()}, strict=True)


def gemma3_projector_state(projector: nn.Module) -> dict[str, torch.Tensor]:
    """``Gemma3MultiModalProjector``'s state dict of plait's ``"gemma3"`` projector (the inverse of
    :func:`load_gemma3_projector`, bit for bit)."""
    mine = projector.state_dict()
    return {"mm_soft_emb_norm.weight": mine["norm.weight"],
            "mm_input_projection_weight": mine["linear_1.weight"].t().contiguous()}


def check_gemma3_branch(branch: Any, llm_config: Any, where: str) -> None:
    """Refuse a branch or LLM ``Gemma3ForConditionalGeneration`` cannot hold.

    Raises:
        ValueError: naming the difference: features other than the post-normed last hidden state, a pooling that
            does not divide the tower's square patch grid, or an LLM that is not Gemma 3's text model.
    """
    if branch.select != "post_norm" or branch.feature_layer != -1:
        raise ValueError(f"Gemma3ForConditionalGeneration feeds its projector the tower's last_hidden_state (plait's "
                         f"select = 'post_norm', feature_layer = -1); {where} has select = {branch.select!r}, "
                         f"feature_layer = {branch.feature_layer}")
    cfg = branch.encoder.config
    side = int(cfg.image_size) // int(cfg.patch_size)
    if side % branch.downsample:
        raise ValueError(f"{where} pools {branch.downsample}x{branch.downsample} patches, which does not divide the "
                         f"tower's {side}x{side} patch grid")
    if not attends_items(llm_config):
        raise ValueError(f"Gemma3ForConditionalGeneration's LLM is Gemma 3's text model (gemma3_text); this model's "
                         f"LLM is a {getattr(llm_config, 'model_type', '')}")


def gemma3_config(config_cls: type, branch: Any, text: Any, token: int, token_ids: dict[str, int]) -> Any:
    """``Gemma3Config`` of a composite: the tower's and LLM's configs (``text``), ``mm_tokens_per_image`` from the
    branch's pooling, the placeholder id ``token`` and ``token_ids`` (:data:`GEMMA3_TOKENS` fields)."""
    tower = copy.deepcopy(branch.encoder.config)
    side = int(tower.image_size) // int(tower.patch_size) // branch.downsample
    return config_cls(vision_config=tower.to_dict(), text_config=text.to_dict(), mm_tokens_per_image=side * side,
                      image_token_index=token, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", True)),
                      **token_ids)


def prefill_items(llm: Any, embeds: torch.Tensor, batch: Any) -> Any:
    """The KV cache of all but the last token of a left-padded batch of prompts, its image tokens attending to each
    other both ways (plait's ``bidirectional_items`` mask from the batch's metadata, the LLM switched to plait's
    attention for this one call), as ``Gemma3ForConditionalGeneration.generate`` prefills with ``token_type_ids``;
    ``llm.generate`` continues from it (the last token and every decoded one attend causally, as transformers'
    decoding steps do).

    Args:
        llm: the composite's LLM; embeds: the prompts' embeddings ``[B, N, hidden]`` (features placed);
        batch: the collated prompts (``attention_mask``, ``position_ids``, ``item_ids`` ``[B, N]``).

    Returns:
        The LLM's cache of the first ``N - 1`` tokens.

    Raises:
        ValueError: when a prompt ends with an image token (the generation prompt's text must follow its images).
    """
    from plait.attention.interface import PLAIT_IMPLEMENTATIONS, use_plait_attention
    from plait.attention.masks import MaskInfo

    items = batch.item_ids.to(embeds.device)
    if bool((items[:, -1] >= 0).any()):
        raise ValueError("a prompt ends with an image token: end it with text after its images (the chat template's "
                         "generation prompt)")
    mask = batch.attention_mask.to(embeds.device)
    docs = torch.where(mask.bool(), 0, -1)
    info = MaskInfo(docs[:, :-1].long(), items[:, :-1].long(), batch.position_ids[:, :-1].to(embeds.device).long(),
                    "bidirectional_items")
    before = llm.config._attn_implementation
    if before not in PLAIT_IMPLEMENTATIONS.values():
        use_plait_attention(llm, "sdpa")
    try:
        out = llm(inputs_embeds=embeds[:, :-1], attention_mask=mask[:, :-1],
                  position_ids=batch.position_ids[:, :-1].to(embeds.device), plait_mask=info, use_cache=True)
    finally:
        if before not in PLAIT_IMPLEMENTATIONS.values():
            llm.set_attn_implementation(before)
    return out.cache
