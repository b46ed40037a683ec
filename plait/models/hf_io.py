"""Hugging Face multimodal checkpoints in and out of plait's composite: the weight and config mapping.

A ``LlavaForConditionalGeneration`` (LLaVA-1.5 style) or ``Qwen2AudioForConditionalGeneration`` is exactly a plait
composite with one branch: its tower (``model.vision_tower`` / ``model.audio_tower``, a stock CLIP/SigLIP vision
model or ``Qwen2AudioEncoder``), its projector (``model.multi_modal_projector``: LLaVA's Linear-GELU-Linear is
plait's ``"mlp"``, Qwen2-Audio's one Linear is plait's ``"linear"``), its LLM (``model.language_model``, the
decoder stack, plus ``lm_head``: the text config's ``*ForCausalLM``), the placeholder id (``image_token_id`` /
``audio_token_id``) and the feature selection (LLaVA's ``vision_feature_layer``, ``vision_feature_select_strategy``
``"default"`` = plait's ``drop_cls``; Qwen2-Audio's pooled last hidden state). :func:`composite_from_hf` and
:func:`hf_from_composite` move the same module objects and tensors from one class to the other (nothing is copied
or computed, so a round trip is bit-identical); :func:`check_exportable` refuses a composite that the class cannot
hold, naming what differs. The processors (Hugging Face's ``LlavaProcessor`` / ``Qwen2AudioProcessor`` around the
branch's image processor or feature extractor) are built by :func:`hf_processor`.

``Qwen2_5_VLForConditionalGeneration`` maps too: its tower ``model.visual`` (blocks and patch merger) is the branch's
encoder, its text model ``model.language_model`` with ``lm_head`` is plait's LLM
(:class:`plait.models.families.qwen2_5_vl.Qwen25VLTextForCausalLM`, M-RoPE positions from the collator), and it has
no projector: the merger already maps to the LLM width. plait's branch keeps a ``"linear"`` projector after the
merger; the import makes it the identity (weight ``I``, bias 0), and the export folds it into the merger's last
Linear (``W_p (W_2 x + b_2) + b_p``: weight ``W_p W_2``, bias ``W_p b_2 + b_p``, computed in fp32), leaving an
identity projector out entirely, so a round trip is bit-identical and a trained projector is kept exactly (up to
rounding). Its processor (``Qwen2_5_VLProcessor``) needs torchvision for its video processor, which plait does not
use: :func:`save_hf_processor` writes the processor folder's files (``Qwen2VLImageProcessorPil`` settings, tokenizer,
chat template, ``processor_config.json``), which ``AutoProcessor`` loads where torchvision is installed.

``Gemma3ForConditionalGeneration`` maps as :mod:`plait.models.gemma3` describes (SigLIP tower with ``select =
"post_norm"`` and a ``downsample`` for its average pooling, plait's ``"gemma3"`` projector, ``Gemma3ForCausalLM``,
images attending bidirectionally through ``attention.mask = "bidirectional_items"``); its processor
(``Gemma3Processor``: ``Gemma3ImageProcessorPil`` and the tokenizer with its ``boi_token``, ``eoi_token`` and
``image_token``) is rebuilt and saved by :func:`hf_processor`.

``Qwen3VLForConditionalGeneration`` maps as Qwen2.5-VL does (its tower ``Qwen3VLVisionModel`` with the merger and the
DeepStack mergers is the branch's encoder, an identity projector folded into ``merger.linear_fc2`` on export, its
text model with ``lm_head`` is :class:`plait.models.families.qwen3_vl.Qwen3VLTextForCausalLM`); the DeepStack
features reach the LLM's first decoder layers through :mod:`plait.models.deepstack`.
``Qwen3VLMoeForConditionalGeneration`` maps the same way, its text model with ``lm_head`` being
:class:`plait.models.families.qwen3_vl_moe.Qwen3VLMoeTextForCausalLM` (mixture-of-experts MLPs).

Refused on import with the reason (:func:`hf_format_of`): LLaVA-NeXT's anyres tiling and Qwen2-VL's LLM (M-RoPE
positions without Qwen2.5-VL's text class; plait registers a causal LM for ``qwen2_5_vl_text`` only).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import peft
import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from plait.models.encoder import ModalityEncoder
from plait.models.families import encoder_family
from plait.models.families.qwen2_5_vl import takes_mrope
from plait.models.gemma3 import (check_gemma3_branch, gemma3_config, gemma3_pool, gemma3_projector_state,
                                 gemma3_text_config, load_gemma3_projector)
from plait.models.hf import encoder_feature_size, llm_layout
from plait.models.lora import ADAPTER, base_state_dict, has_lora
from plait.models.multimodal import MultimodalModel
from plait.models.projector import build_projector

__all__ = ["HfFormat", "HF_FORMATS", "REFUSED_EXPORTS", "hf_format_of", "composite_from_hf", "hf_from_composite",
           "check_exportable", "hf_processor", "save_hf_processor", "merge_adapters", "string_content_template",
           "export_chat_template", "fold_into_linear", "identity_projector", "assemble_causal_lm",
           "QWEN_VL_TOKENS", "QWEN_VL_FORMATS", "QWEN3_VL_TEXT"]


@dataclass(frozen=True)
class HfFormat:
    """One Hugging Face multimodal class plait maps to and from a one-branch composite.

    Attributes:
        name: the ``--format`` name (``"llava"``).
        model_type: the checkpoint's ``config.model_type``.
        model_class: the transformers class.
        processor_class: its transformers processor class.
        modality: the branch's modality; ``branch`` its name in plait.
        tower: attribute of ``model.model`` holding the encoder.
        projector: plait's projector kind; ``projector_keys`` maps plait's projector state-dict keys to the
            class's ``multi_modal_projector`` keys (empty: the class has no projector, plait's is the identity
            on import and folded into the tower's merger on export).
        token_field: the config field of the placeholder id.
        encoder_types: encoder ``model_type`` values the class accepts.
    """

    name: str
    model_type: str
    model_class: str
    processor_class: str
    modality: str
    branch: str
    tower: str
    projector: str
    projector_keys: tuple[tuple[str, str], ...]
    token_field: str
    encoder_types: tuple[str, ...]


_MLP_KEYS = tuple((f"linear_{i}.{p}", f"linear_{i}.{p}") for i in (1, 2) for p in ("weight", "bias"))
HF_FORMATS = {
    "llava": HfFormat("llava", "llava", "LlavaForConditionalGeneration", "LlavaProcessor", "image", "vision",
                      "vision_tower", "mlp", _MLP_KEYS, "image_token_id",
                      ("clip_vision_model", "siglip_vision_model")),
    "qwen2_audio": HfFormat("qwen2_audio", "qwen2_audio", "Qwen2AudioForConditionalGeneration", "Qwen2AudioProcessor",
                            "audio", "audio", "audio_tower", "linear",
                            (("linear_1.weight", "linear.weight"), ("linear_1.bias", "linear.bias")), "audio_token_id",
                            ("qwen2_audio_encoder",)),
    "qwen2_5_vl": HfFormat("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor",
                           "image", "vision", "visual", "linear", (), "image_token_id", ("qwen2_5_vl_vision",)),
    "gemma3": HfFormat("gemma3", "gemma3", "Gemma3ForConditionalGeneration", "Gemma3Processor", "image", "vision",
                       "vision_tower", "gemma3", (("norm.weight", "mm_soft_emb_norm.weight"),
                                                  ("linear_1.weight", "mm_input_projection_weight")),
                       "image_token_id", ("siglip_vision_model",)),
    "qwen3_vl": HfFormat("qwen3_vl", "qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", "image",
                         "vision", "visual", "linear", (), "image_token_id", ("qwen3_vl_vision",)),
    # two branches (vision and audio): mapped by plait.models.hf_io_omni, this entry names the format
    "qwen2_5_omni": HfFormat("qwen2_5_omni", "qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration",
                             "Qwen2_5OmniProcessor", "image", "vision", "visual", "linear", (), "image_token_id",
                             ("qwen2_5_omni_vision_encoder",)),
    # one audio branch whose tower holds the projector: mapped by plait.models.hf_io_voxtral, this entry names it
    "voxtral": HfFormat("voxtral", "voxtral", "VoxtralForConditionalGeneration", "VoxtralProcessor", "audio", "audio",
                        "audio_tower", "linear", (), "audio_token_id", ("voxtral_encoder",)),
    # Qwen3-VL's tower and DeepStack in front of a mixture-of-experts text model (plait.models.families.qwen3_vl_moe)
    "qwen3_vl_moe": HfFormat("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor",
                             "image", "vision", "visual", "linear", (), "image_token_id", ("qwen3_vl_moe_vision",)),
    # the Qwen3-Omni-MoE thinker: mapped by plait.models.hf_io_omni, as Qwen2.5-Omni's
    "qwen3_omni_moe": HfFormat("qwen3_omni_moe", "qwen3_omni_moe_thinker",
                               "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeProcessor", "image",
                               "vision", "visual", "linear", (), "image_token_id", ("qwen3_omni_moe_vision_encoder",)),
}
"""The supported classes by ``--format`` name."""

_REFUSED = {
    "llava_next": "LLaVA-NeXT's anyres tiling (several crops per image chosen from image_grid_pinpoints, plus the "
                  "learned image_newline row embedding) is not in plait's composition, which feeds one fixed-size "
                  "image per <image> placeholder; import a LLaVA-1.5-style LlavaForConditionalGeneration",
    "llava_next_video": "LLaVA-NeXT-Video's anyres tiling and video pooling are not in plait's composition",
    "llava_onevision": "LLaVA-OneVision's anyres tiling is not in plait's composition",
    "qwen2_vl": "Qwen2-VL's LLM takes multimodal rotary positions (M-RoPE: position_ids [3, B, N] per image grid), "
                "which plait has for Qwen2.5-VL's text model only (qwen2_5_vl_text; Qwen2-VL's qwen2_vl_text has no "
                "causal-LM class in plait), so its LLM would see images at 1-D positions; import a Qwen2.5-VL "
                "checkpoint",
}
REFUSED_EXPORTS: dict[str, str] = {}
"""``--format`` names plait export knows but refuses, with what is missing."""


def hf_format_of(config: PretrainedConfig, where: str) -> HfFormat:
    """The :class:`HfFormat` of a checkpoint's config (``where``: its folder, for errors).

    Raises:
        ValueError: for a refused family (with what plait lacks) or any other ``model_type`` (naming the supported).
    """
    model_type = getattr(config, "model_type", "")
    model_type = "qwen2_5_omni_thinker" if model_type == "qwen2_5_omni" else model_type  # a full Omni: its thinker
    model_type = "qwen3_omni_moe_thinker" if model_type == "qwen3_omni_moe" else model_type
    if model_type in _REFUSED:
        raise ValueError(f"{where}: cannot import a {model_type} checkpoint: {_REFUSED[model_type]}")
    for fmt in HF_FORMATS.values():
        if fmt.model_type == model_type:
            return fmt
    raise ValueError(f"{where} holds a {model_type or 'model without model_type'}; plait import reads "
                     + ", ".join(f.model_class for f in HF_FORMATS.values()))


# ----------------------------------------------------------------------------------------------- import
def _feature_selection(fmt: HfFormat, config: PretrainedConfig, tower: PreTrainedModel) -> tuple[int, str]:
    """``(feature_layer, select)`` of the checkpoint's branch.

    Raises:
        ValueError: for a LLaVA config plait's branch cannot express (several feature layers, another projector
            activation or no projector bias, dropping the first position of a tower without a CLS token).
    """
    if fmt.name == "gemma3":
        return -1, "post_norm"  # its projector reads the tower's last_hidden_state
    if fmt.name != "llava":
        return -1, "full"
    layer, strategy = config.vision_feature_layer, config.vision_feature_select_strategy
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer = {layer!r}: plait's branch takes one hidden state, not a "
                         "concatenation of several layers")
    if config.projector_hidden_act != "gelu" or not getattr(config, "multimodal_projector_bias", True):
        raise ValueError(f"projector_hidden_act = {config.projector_hidden_act!r}, multimodal_projector_bias = "
                         f"{config.multimodal_projector_bias}: plait's mlp projector is Linear(bias)-GELU-Linear(bias)")
    if strategy == "default" and not encoder_family(tower.config.model_type, "image").has_cls:
        raise ValueError(f"vision_feature_select_strategy = 'default' drops the first position of a "
                         f"{tower.config.model_type} tower, which has no CLS token; plait's drop_cls refuses that")
    return layer, ("drop_cls" if strategy == "default" else "full")


def composite_from_hf(hf: PreTrainedModel, fmt: HfFormat, hop_length: int = 160,
                      sampling_rate: int = 16000) -> MultimodalModel:
    """The plait composite holding ``hf``'s own modules (tower, decoder stack, ``lm_head``: shared, not copied) and
    its projector's tensors; ``hop_length``/``sampling_rate`` (samples) are the audio feature extractor's.

    Raises:
        ValueError: as :func:`_feature_selection`, for a tower plait does not know, or a decoder stack that does
            not fit the text config's ``*ForCausalLM``.
    """
    tower = getattr(hf.model, fmt.tower)
    if tower.config.model_type not in fmt.encoder_types:
        raise ValueError(f"{fmt.model_class} with a {tower.config.model_type} tower: plait maps "
                         f"{', '.join(fmt.encoder_types)}")
    layer, select = _feature_selection(fmt, hf.config, tower)
    gemma = fmt.name == "gemma3"
    text = gemma3_text_config(hf.config) if gemma else hf.config.get_text_config()
    if fmt.name in QWEN3_VL_TEXT:  # the multimodal class ties lm_head by its top-level flag
        text = copy.deepcopy(text)
        text.tie_word_embeddings = bool(getattr(hf.config, "tie_word_embeddings", False))
    llm = assemble_causal_lm(text, hf.model.language_model, hf.lm_head)
    hidden = llm.get_input_embeddings().embedding_dim
    downsample = gemma3_pool(hf.config) if gemma else 1
    if gemma:
        projector = build_projector("gemma3", int(tower.config.hidden_size), hidden,
                                    float(tower.config.layer_norm_eps))
        load_gemma3_projector(projector, hf.model.multi_modal_projector)
    elif not fmt.projector_keys:  # the merger is the projector (Qwen2.5-VL): plait's is the identity
        projector = identity_projector(encoder_feature_size(tower, 1), hidden, next(tower.parameters()).dtype)
    else:
        width = int(getattr(tower.config, "hidden_size", None) or tower.config.d_model)
        source = hf.model.multi_modal_projector.state_dict()
        projector = build_projector(fmt.projector, width, hidden).to(next(iter(source.values())).dtype)
        projector.load_state_dict({mine: source[theirs] for mine, theirs in fmt.projector_keys}, strict=True)
    branch = ModalityEncoder(tower, projector, fmt.modality, layer, select, downsample, hop_length, sampling_rate)
    token = int(getattr(hf.config, fmt.token_field))
    return MultimodalModel(llm, {fmt.branch: branch}, {fmt.branch: token})


def identity_projector(width: int, hidden: int, dtype: torch.dtype) -> nn.Module:
    """A ``"linear"`` projector that passes ``width`` features through unchanged (weight ``I``, bias 0).

    Raises:
        ValueError: when ``width`` differs from the LLM's ``hidden`` size (the tower's merger must map to it).
    """
    if width != hidden:
        raise ValueError(f"the tower's merger gives {width} features but the LLM's hidden size is {hidden}")
    projector = build_projector("linear", width, hidden).to(dtype)
    with torch.no_grad():
        projector.linear_1.weight.copy_(torch.eye(width, dtype=dtype))
        projector.linear_1.bias.zero_()
    return projector


def _fold_projector(branch: ModalityEncoder) -> None:
    """Fold the branch's ``"linear"`` projector into the tower's merger (``merger.mlp[-1]``, a Linear) in place:
    weight ``W_p W_2``, bias ``W_p b_2 + b_p`` in fp32, cast back to the merger's dtype; an identity projector
    (weight exactly ``I``, bias exactly 0) leaves the merger untouched (bit-identical round trips)."""
    merger = branch.encoder.merger
    fold_into_linear(branch.projector.linear_1, merger.linear_fc2 if hasattr(merger, "linear_fc2") else merger.mlp[-1])


def fold_into_linear(proj: nn.Linear, last: nn.Linear) -> None:
    """Fold the Linear ``proj`` applied after the Linear ``last`` into ``last`` in place (weight ``W_p W``, bias
    ``W_p b + b_p`` in fp32, cast back to ``last``'s dtype); an identity ``proj`` (weight exactly ``I``, bias exactly
    0) leaves ``last`` untouched."""
    w_p, b_p = proj.weight.detach().float(), proj.bias.detach().float()
    if torch.equal(w_p, torch.eye(*w_p.shape)) and not bool(b_p.any()):
        return
    with torch.no_grad():
        w2, b2 = last.weight.float(), last.bias.float()
        last.weight.copy_((w_p @ w2).to(last.weight.dtype))
        last.bias.copy_((w_p @ b2 + b_p).to(last.bias.dtype))


def assemble_causal_lm(text_config: PretrainedConfig, base: nn.Module, head: nn.Module) -> PreTrainedModel:
    """The text config's ``*ForCausalLM`` holding the decoder stack ``base`` and ``head`` (built on the meta
    device, its own submodules replaced): the LLM of a Hugging Face multimodal model as a stand-alone causal LM,
    sharing its modules (the LLaVA-style and Voxtral imports).

    Raises:
        ValueError: when the text config has no causal-LM class or the class holds more than the two.
    """
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text_config), None)
    if cls is None:
        raise ValueError(f"the text model {text_config.model_type} has no *ForCausalLM class in transformers")
    with torch.device("meta"):
        llm = cls(copy.deepcopy(text_config))
    setattr(llm, llm.base_model_prefix, base)
    llm.set_output_embeddings(head)
    left = [n for n, t in [*llm.named_parameters(), *llm.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{cls.__name__} holds tensors beyond its decoder stack and lm_head ({left[:3]}); plait "
                         "cannot assemble it from the multimodal checkpoint")
    return llm


# ----------------------------------------------------------------------------------------------- export
def merge_adapters(part: nn.Module) -> None:
    """Merge the LoRA adapters of a loaded part into its base weights in place (``W + alpha / r * B A``, the one
    merge of :func:`plait.models.lora.base_state_dict`) and put the plain base layers back, so the part is a
    stock Hugging Face module again; a part without adapters is left as it is."""
    if not has_lora(part):
        return
    state = base_state_dict(part, merge=True)
    for name, layer in list(part.named_modules()):
        if isinstance(layer, peft.tuners.lora.LoraLayer) and ADAPTER in layer.lora_A:
            part.set_submodule(name, layer.get_base_layer())
    part.load_state_dict(state, strict=True)


def check_exportable(model: MultimodalModel, fmt: HfFormat) -> None:
    """Refuse a composite ``fmt``'s class cannot hold.

    Raises:
        ValueError: naming the difference: several branches or another modality, another tower family, another
            projector kind, audio ``downsample``, a LLaVA feature selection HF cannot express, an LLM whose output
            head has a bias or is not a plain ``*ForCausalLM``; for Qwen2.5-VL a projector that changes the width
            (it cannot fold into the merger) or an LLM that is not Qwen2.5-VL's text model.
    """
    if len(model.encoders) != 1:
        raise ValueError(f"{fmt.model_class} has one encoder; this model has {len(model.encoders)} "
                         f"({', '.join(model.encoders)})")
    name, branch = next(iter(model.encoders.items()))
    where = f"branch {name!r}"
    if branch.modality != fmt.modality:
        raise ValueError(f"{fmt.model_class} takes {fmt.modality}; {where} is {branch.modality}")
    kind = branch.encoder.config.model_type
    if kind not in fmt.encoder_types:
        raise ValueError(f"{fmt.model_class}'s tower is {' or '.join(fmt.encoder_types)}; {where} is a {kind}")
    if branch.projector.kind != fmt.projector:
        shape = "Linear-GELU-Linear" if fmt.projector == "mlp" else "one Linear"
        raise ValueError(f"{fmt.model_class}'s projector is {shape} (plait's {fmt.projector!r}); {where} has a "
                         f"{branch.projector.kind!r} projector")
    if not fmt.projector_keys and branch.projector.linear_1.in_features != branch.projector.linear_1.out_features:
        raise ValueError(f"{fmt.model_class} has no projector after its merger; {where}'s projector maps "
                         f"{branch.projector.linear_1.in_features} to {branch.projector.linear_1.out_features} "
                         "features, which cannot fold into the merger")
    if fmt.name == "gemma3":
        check_gemma3_branch(branch, model.language_model.config, where)
    elif branch.downsample != 1:
        raise ValueError(f"{fmt.model_class} feeds every pooled feature; {where} averages {branch.downsample}")
    if fmt.name == "llava" and branch.select == "drop_cls" and kind != "clip_vision_model":
        raise ValueError(f"{where} drops the CLS position of a {kind}, which LLaVA's 'default' strategy cannot")
    text_type = model.language_model.config.model_type
    if fmt.name in QWEN3_VL_TEXT and text_type != QWEN3_VL_TEXT[fmt.name]:
        raise ValueError(f"{fmt.model_class}'s LLM is its own text model ({QWEN3_VL_TEXT[fmt.name]}, DeepStack, "
                         f"interleaved M-RoPE); this model's LLM is a {text_type}")
    if not fmt.projector_keys and not takes_mrope(model.language_model.config):
        raise ValueError(f"{fmt.model_class}'s LLM is Qwen2.5-VL's text model (qwen2_5_vl_text, M-RoPE); this "
                         f"model's LLM is a {text_type}")
    head = model.language_model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{fmt.model_class}'s lm_head has no bias; this LLM's output head has one")
    llm_layout(model.language_model)  # a decoder stack with layers, norm and both embeddings


def hf_from_composite(model: MultimodalModel, fmt: HfFormat, token_ids: dict[str, int] | None = None
                      ) -> PreTrainedModel:
    """``fmt``'s class holding the composite's modules (tower, decoder stack, ``lm_head``: shared, not copied) and
    its projector's tensors (Qwen2.5-VL: the projector folded into the tower's merger in place,
    :func:`_fold_projector`); LoRA adapters must be merged first (:func:`merge_adapters`). ``token_ids``: further
    config ids (Qwen2.5-VL's ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``).

    Raises:
        ValueError: as :func:`check_exportable`, when a part still holds adapters, or when the assembled state
            dict differs in names or shapes from the class built from the same config.
    """
    check_exportable(model, fmt)
    name, branch = next(iter(model.encoders.items()))
    if has_lora(model):
        raise ValueError("merge the LoRA adapters first (plait.models.hf_io.merge_adapters)")
    llm = model.language_model
    cfg = _hf_config(model, fmt, name, token_ids or {})
    with torch.device("meta"):
        hf = getattr(transformers, fmt.model_class)(cfg)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    setattr(hf.model, fmt.tower, branch.encoder)
    hf.model.language_model = llm.get_submodule(llm.base_model_prefix)
    hf.lm_head = llm.get_output_embeddings()
    if fmt.name == "gemma3":
        hf.model.multi_modal_projector.load_state_dict(gemma3_projector_state(branch.projector), strict=True,
                                                       assign=True)
    elif fmt.projector_keys:
        mine = branch.projector.state_dict()
        hf.model.multi_modal_projector.load_state_dict({theirs: mine[m] for m, theirs in fmt.projector_keys},
                                                       strict=True, assign=True)
    else:
        _fold_projector(branch)
    got = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"the composite does not fit {fmt.model_class}: tensors differ in name or shape ({diff})")
    hf.generation_config = copy.deepcopy(llm.generation_config)
    return hf


def _hf_config(model: MultimodalModel, fmt: HfFormat, name: str, token_ids: dict[str, int]) -> PretrainedConfig:
    """The config of ``fmt``'s class for the composite: its tower's and LLM's configs, placeholder id, feature
    selection (LLaVA) and the image feature count at the tower's native size (``image_seq_length``); Qwen2.5-VL's
    further ``token_ids``."""
    branch = model.encoders[name]
    text = copy.deepcopy(model.language_model.config)
    tower = copy.deepcopy(branch.encoder.config)
    token = model.placeholder_ids[name]
    config_cls = getattr(transformers, fmt.model_class).config_class
    if fmt.name == "llava":
        size = int(tower.image_size)
        return config_cls(vision_config=tower, text_config=text, image_token_id=token,
                          vision_feature_layer=branch.feature_layer,
                          vision_feature_select_strategy="default" if branch.select == "drop_cls" else "full",
                          projector_hidden_act="gelu", multimodal_projector_bias=True,
                          image_seq_length=branch.feature_count((size, size)),
                          tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)))
    if fmt.name == "gemma3":
        return gemma3_config(config_cls, branch, text, token, token_ids)
    if fmt.name in QWEN_VL_FORMATS:
        return config_cls(vision_config=tower.to_dict(), text_config=text.to_dict(), image_token_id=token,
                          tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), **token_ids)
    return config_cls(audio_config=tower, text_config=text, audio_token_id=token)


QWEN3_VL_TEXT = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
"""The Qwen3-VL formats (``lm_head`` tied by the class's top-level flag) and the text model each class holds."""


# -------------------------------------------------------------------------------------------- processors
def hf_processor(fmt: HfFormat, model: MultimodalModel, tokenizer: Any, media_processor: Any) -> Any:
    """``fmt``'s Hugging Face processor for the composite: the branch's image processor or feature extractor
    (``media_processor``), the tokenizer with its chat template (without the string-content prelude
    :func:`string_content_template` may have added on import: the template the checkpoint came with), and the
    placeholder token (LLaVA: the tower's patch size, the feature selection and the CLS position it counts).

    Raises:
        ValueError: for Qwen2.5-VL (:func:`save_hf_processor` writes its files instead).
    """
    if fmt.name in QWEN_VL_FORMATS:
        raise ValueError(f"{fmt.processor_class} needs torchvision (its video processor); write its files with "
                         "save_hf_processor")
    name, branch = next(iter(model.encoders.items()))
    token = tokenizer.convert_ids_to_tokens(model.placeholder_ids[name])
    cls = getattr(transformers, fmt.processor_class)
    template = export_chat_template(tokenizer, token)
    if fmt.name == "llava":
        cfg = branch.encoder.config
        return cls(image_processor=media_processor, tokenizer=tokenizer, chat_template=template,
                   patch_size=int(cfg.patch_size), image_token=token,
                   vision_feature_select_strategy="default" if branch.select == "drop_cls" else "full",
                   num_additional_image_tokens=int(encoder_family(cfg.model_type, "image").has_cls))
    if fmt.name == "gemma3":
        return cls(image_processor=media_processor, tokenizer=tokenizer, chat_template=template,
                   image_seq_length=branch.feature_count((branch.encoder.config.image_size,) * 2))
    return cls(feature_extractor=media_processor, tokenizer=tokenizer, chat_template=template, audio_token=token)


QWEN_VL_FORMATS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""Formats whose processor (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``) is written as its files
(:func:`save_hf_processor`)."""

QWEN_VL_TOKENS = {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
                  "vision_end_token_id": "<|vision_end|>"}
"""Qwen2.5-VL's config ids beyond the placeholder, by config field: the tokens its chat template writes."""


def save_hf_processor(fmt: HfFormat, model: MultimodalModel, tokenizer: Any, media_processor: Any,
                      folder: Path) -> None:
    """Write ``fmt``'s processor for the composite to ``folder``: :func:`hf_processor` saved, or for Qwen2.5-VL
    (whose ``Qwen2_5_VLProcessor`` cannot be built without torchvision, for its video processor) the files it
    loads from: the image processor's ``preprocessor_config.json``, the tokenizer with the chat template
    (without plait's string-content prelude) and ``processor_config.json`` naming the class."""
    if fmt.name not in QWEN_VL_FORMATS:
        hf_processor(fmt, model, tokenizer, media_processor).save_pretrained(folder)
        return
    name = next(iter(model.encoders))
    template = export_chat_template(tokenizer, tokenizer.convert_ids_to_tokens(model.placeholder_ids[name]))
    media_processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if template:
        (Path(folder) / "chat_template.jinja").write_text(template)
    (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class": fmt.processor_class}, indent=2))


_STRING_PRELUDE = (
    "{#- plait: message contents given as a string become one text part, as Hugging Face processors do -#}\n"
    "{%- set plait_ns = namespace(messages=[]) -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m['content'] is string -%}"
    "{%- set plait_ns.messages = plait_ns.messages + [{'role': m['role'], "
    "'content': [{'type': 'text', 'text': m['content']}]}] -%}\n"
    "{%- else -%}{%- set plait_ns.messages = plait_ns.messages + [m] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set messages = plait_ns.messages -%}\n"
)


_TYPED_PRELUDE = (
    "{#- plait: typed message contents become one string: each text part its text, each media part the "
    "model's placeholder token -#}\n"
    "{%- set plait_typed = namespace(messages=[]) -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m['content'] is string -%}{%- set plait_typed.messages = plait_typed.messages + [m] -%}\n"
    "{%- else -%}{%- set plait_text = namespace(s='') -%}\n"
    "{%- for part in m['content'] -%}\n"
    "{%- if part['type'] == 'text' -%}{%- set plait_text.s = plait_text.s + part['text'] -%}\n"
    "{%- elif part['type'] in ['image', 'audio', 'video'] -%}{%- set plait_text.s = plait_text.s + PLACEHOLDER -%}\n"
    "{%- else -%}{{- raise_exception('message content part of type ' + part['type'] + ': this template renders "
    "text, image, audio and video parts') -}}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set plait_typed.messages = plait_typed.messages + [{'role': m['role'], 'content': plait_text.s}] -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set messages = plait_typed.messages -%}\n"
)


def export_chat_template(tokenizer: Any, placeholder: str) -> str | None:
    """The chat template an export writes, set on ``tokenizer`` too: the tokenizer's own without the string-content
    prelude :func:`string_content_template` may have added on import (the template the checkpoint came with), and,
    when that renders string contents only (plait's ChatML before typed parts, or a user's template), behind a
    prelude that turns typed contents (``[{"type": "image"}, {"type": "text", "text": ...}]``, the form transformers'
    processors and ``apply_chat_template`` users write) into one string, each media part ``placeholder`` (the
    branch's placeholder token, e.g. ``"<image>"``). None when the tokenizer has no template.

    Raises:
        ValueError: when neither form renders the text of a one-turn typed conversation.
    """
    template = (tokenizer.chat_template or "").removeprefix(_STRING_PRELUDE) or None
    if template is not None:
        template = _first_rendering(
            (template, _TYPED_PRELUDE.replace("PLACEHOLDER", repr(placeholder)) + template),
            [{"role": "user", "content": [{"type": "text", "text": "plait-probe-text"}]}],
            lambda candidate, probe: tokenizer.apply_chat_template(probe, chat_template=candidate, tokenize=False))
        if template is None:
            raise ValueError("the model's chat template renders neither typed nor string message contents")
    tokenizer.chat_template = template
    return template


def _first_rendering(candidates: Sequence[str], probe: list[dict], render: Any) -> str | None:
    """The first of the chat templates ``candidates`` that renders the text ``"plait-probe-text"`` of the one-turn
    conversation ``probe`` (``render(template, messages) -> str``) as text, not as a printed list of typed parts;
    None when none does."""
    for candidate in candidates:
        try:
            text = render(candidate, probe)
        except Exception:  # jinja2 errors of any kind: a template may raise on contents it does not expect
            continue
        if "plait-probe-text" in text and "'type'" not in text:
            return candidate
    return None


def string_content_template(template: str, render: Any) -> str:
    """A chat template that renders plait's string message contents: ``template`` itself when it does, else
    ``template`` behind a prelude that turns each string content into ``[{"type": "text", "text": ...}]`` (the
    processors' typed-content templates, e.g. LLaVA's). ``render(template, messages) -> str`` renders one.

    Raises:
        ValueError: when neither renders the text of a one-turn conversation.
    """
    found = _first_rendering((template, _STRING_PRELUDE + template), [{"role": "user", "content": "plait-probe-text"}],
                             render)
    if found is not None:
        return found
    raise ValueError("the checkpoint's chat template renders neither string message contents nor typed text parts; "
                     "set data.chat_template in the job")
