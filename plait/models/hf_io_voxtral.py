"""Voxtral (``VoxtralForConditionalGeneration``) in and out of plait's composite.

The composite has one ``audio`` branch whose tower is :class:`~plait.models.families.voxtral.VoxtralProjectedEncoder`:
the model's ``model.audio_tower`` modules with its ``model.multi_modal_projector`` (the frame stacking and projector
of ``VoxtralModel.get_audio_features``), placeholder ``audio_token_id`` (``[AUDIO]``), and its text model
``model.language_model`` with ``lm_head`` as the text config's ``*ForCausalLM`` (Llama / Mistral). The projector
already maps to the LLM width, so plait's ``"linear"`` projector is the identity on import and folded into the
projector's ``linear_2`` on export (an identity leaves it untouched: a round trip moves the same tensors). Modules
are shared with the source model, never copied.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, VoxtralConfig, VoxtralForConditionalGeneration
from transformers.models.voxtral.modeling_voxtral import VoxtralEncoder

from plait.models.encoder import ModalityEncoder
from plait.models.families.voxtral import VoxtralProjectedEncoder
from plait.models.hf import llm_layout
from plait.models.hf_io import assemble_causal_lm, export_chat_template, identity_projector
from plait.models.lora import has_lora
from plait.models.multimodal import MultimodalModel

__all__ = ["VOXTRAL_CLASS", "PROJECTOR_FIELDS", "composite_from_voxtral", "voxtral_from_composite",
           "check_voxtral_exportable", "save_voxtral_processor"]

VOXTRAL_CLASS = "VoxtralForConditionalGeneration"
PROJECTOR_FIELDS = ("projector_hidden_size", "projector_hidden_act")
"""The tower-config fields that make a ``voxtral_encoder`` tower hold the projector (the LLM width, its activation)."""


def _move_children(source: nn.Module, target: nn.Module, skip: tuple[str, ...] = ()) -> None:
    """Set each child module of ``source`` (but ``skip``) on ``target`` under the same name (shared, not copied)."""
    for name, child in source.named_children():
        if name not in skip:
            setattr(target, name, child)


def composite_from_voxtral(hf: PreTrainedModel, hop_length: int = 160, sampling_rate: int = 16000) -> MultimodalModel:
    """The plait composite holding ``hf``'s own modules (tower and projector as one
    :class:`~plait.models.families.voxtral.VoxtralProjectedEncoder`, decoder stack, ``lm_head``), an identity
    projector and the ``audio`` placeholder id; ``hop_length`` / ``sampling_rate`` are the feature extractor's.

    Raises:
        ValueError: for a model that is not a ``VoxtralForConditionalGeneration``, or whose decoder stack does not fit
            the text config's ``*ForCausalLM``.
    """
    if not isinstance(hf, VoxtralForConditionalGeneration):
        raise ValueError(f"composite_from_voxtral reads a {VOXTRAL_CLASS}, got {type(hf).__name__}")
    cfg = hf.config
    tower_cfg = copy.deepcopy(hf.model.audio_tower.config)
    tower_cfg.projector_hidden_size = int(cfg.text_config.hidden_size)
    tower_cfg.projector_hidden_act = cfg.projector_hidden_act
    tower_cfg.architectures = [VoxtralProjectedEncoder.__name__]
    with torch.device("meta"):
        tower = VoxtralProjectedEncoder(tower_cfg)
    _move_children(hf.model.audio_tower, tower)
    tower.multi_modal_projector = hf.model.multi_modal_projector
    tower.train(hf.training)
    text = copy.deepcopy(cfg.get_text_config())
    text.tie_word_embeddings = False  # the class never ties: lm_head is its own tensor whatever the text config says
    llm = assemble_causal_lm(text, hf.model.language_model, hf.lm_head)
    hidden = llm.get_input_embeddings().embedding_dim
    dtype = next(tower.parameters()).dtype
    branch = ModalityEncoder(tower, identity_projector(tower_cfg.projector_hidden_size, hidden, dtype), "audio",
                             hop_length=hop_length, sampling_rate=sampling_rate)
    return MultimodalModel(llm, {"audio": branch}, {"audio": int(cfg.audio_token_id)})


def check_voxtral_exportable(model: MultimodalModel) -> None:
    """Refuse a composite ``VoxtralForConditionalGeneration`` cannot hold.

    Raises:
        ValueError: naming the difference: not one audio branch of a Voxtral tower holding its projector, a plait
            projector that is not one width-keeping bias-free ``"linear"`` (an identity, or one with bias 0), or an
            LLM without the usual decoder layout.
    """
    kinds = {n: b.encoder.config.model_type for n, b in model.encoders.items()}
    if list(kinds.values()) != ["voxtral_encoder"]:
        raise ValueError(f"{VOXTRAL_CLASS} has one Voxtral audio tower; this model's branches are {kinds}")
    (name, branch), = model.encoders.items()
    if getattr(branch.encoder, "multi_modal_projector", None) is None:
        raise ValueError(f"branch {name!r}'s Voxtral tower has no projector (its config lacks "
                         f"{', '.join(PROJECTOR_FIELDS)}): import a {VOXTRAL_CLASS} to train one")
    lin = getattr(branch.projector, "linear_1", None)
    if branch.projector.kind != "linear" or lin is None or lin.in_features != lin.out_features:
        raise ValueError(f"{VOXTRAL_CLASS}'s projector ends the tower; branch {name!r}'s {branch.projector.kind!r} "
                         "projector cannot fold into it")
    if bool(lin.bias.detach().any()):
        raise ValueError(f"{VOXTRAL_CLASS}'s projector has no bias; branch {name!r}'s plait projector has a "
                         "non-zero bias: train with freeze_projector = true")
    llm_layout(model.language_model)


def voxtral_from_composite(model: MultimodalModel, token_ids: dict[str, int] | None = None) -> PreTrainedModel:
    """``VoxtralForConditionalGeneration`` holding the composite's modules (shared, not copied), plait's projector
    folded into the tower projector's ``linear_2`` in place (weight ``W_p W_2`` in fp32; an identity leaves it
    untouched). ``token_ids``: further config fields.

    Raises:
        ValueError: as :func:`check_voxtral_exportable`, when a part still holds LoRA adapters, or when the assembled
            state dict differs in names or shapes from the class built from the same config.
    """
    check_voxtral_exportable(model)
    if has_lora(model):
        raise ValueError("merge the LoRA adapters first (plait.models.hf_io.merge_adapters)")
    (name, branch), = model.encoders.items()
    tower = branch.encoder
    audio = {k: v for k, v in tower.config.to_dict().items() if k not in PROJECTOR_FIELDS + ("architectures",)}
    llm = model.language_model
    cfg = VoxtralConfig(audio_config=audio, text_config=llm.config.to_dict(),
                        audio_token_id=model.placeholder_ids[name],
                        projector_hidden_act=tower.config.projector_hidden_act, **(token_ids or {}))
    with torch.device("meta"):
        hf = VoxtralForConditionalGeneration(cfg)
        stock = VoxtralEncoder(hf.model.audio_tower.config)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    _move_children(tower, stock, skip=("multi_modal_projector",))
    stock.train(tower.training)
    hf.model.audio_tower, hf.model.multi_modal_projector = stock, tower.multi_modal_projector
    hf.model.language_model, hf.lm_head = llm.model, llm.get_output_embeddings()
    _fold(branch.projector.linear_1, tower.multi_modal_projector.linear_2)
    got = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"the composite does not fit {VOXTRAL_CLASS}: tensors differ in name or shape ({diff})")
    hf.generation_config = copy.deepcopy(llm.generation_config)
    return hf


def _fold(proj: nn.Linear, last: nn.Linear) -> None:
    """Fold the bias-free-in-effect Linear ``proj`` (bias 0, checked) applied after the bias-free ``last`` into
    ``last`` in place (weight ``W_p W`` in fp32, cast back); an identity ``proj`` leaves ``last`` untouched."""
    w_p = proj.weight.detach().float()
    if torch.equal(w_p, torch.eye(*w_p.shape)):
        return
    with torch.no_grad():
        last.weight.copy_((w_p @ last.weight.float()).to(last.weight.dtype))



def save_voxtral_processor(model: MultimodalModel, tokenizer: Any, feature_extractor: Any, folder: Path) -> None:
    """Write the files ``VoxtralProcessor`` loads from (``AutoProcessor``): the feature extractor's
    ``preprocessor_config.json``, the tokenizer with its chat template (without plait's string-content prelude) and
    ``processor_config.json`` naming the class. (The published model's chats are tokenized by mistral-common; this
    tokenizer is the one plait trained with.)"""
    name = next(iter(model.encoders))
    template = export_chat_template(tokenizer, tokenizer.convert_ids_to_tokens(model.placeholder_ids[name]))
    feature_extractor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if template:
        (Path(folder) / "chat_template.jinja").write_text(template)
    (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class": "VoxtralProcessor"}, indent=2))
