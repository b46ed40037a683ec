"""The Omni thinkers (``Qwen2_5OmniThinkerForConditionalGeneration``, ``Qwen3OmniMoeThinkerForConditionalGeneration``:
:data:`THINKERS`) in and out of plait's composite. Described for Qwen2.5-Omni; Qwen3-Omni's maps alike
(:mod:`plait.models.families.qwen3_omni_moe`: the audio ``proj2`` takes its projector's fold).

The thinker is a plait composite with two branches (:mod:`plait.models.families.qwen2_5_omni`): ``vision`` (its
``model.visual``, placeholder ``image_token_id``; videos use the same branch, whose tokens transformers writes as
``video_token_id``) and ``audio`` (its ``model.audio_tower``, placeholder ``audio_token_id``), and its text model
``model.language_model`` with ``lm_head`` as :class:`~plait.models.families.qwen2_5_omni.Qwen25OmniTextForCausalLM`.
Neither tower has a projector after it (the vision merger and the audio ``proj`` map to the LLM width): as for
Qwen2.5-VL (:mod:`plait.models.hf_io`), plait's ``"linear"`` projectors are the identity on import and folded into
``merger.mlp[-1]`` / ``proj`` on export, so a round trip moves the same tensors (bit-identical). The thinker config's
own fields (``position_id_per_seconds``, ``seconds_per_chunk``, the video and start/end token ids) travel on the vision
tower's config (:meth:`Qwen25OmniVisionFamily.video_encoding` reads the first) and back. A full
``Qwen2_5OmniForConditionalGeneration`` checkpoint (thinker, talker, token2wav) gives its thinker: :func:`load_thinker`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from plait.models.encoder import ModalityEncoder
from plait.models.families.qwen2_5_omni import Qwen25OmniTextForCausalLM
from plait.models.families.qwen3_omni_moe import Qwen3OmniMoeTextForCausalLM
from plait.models.hf import llm_layout
from plait.models.hf_io import export_chat_template, fold_into_linear, identity_projector
from plait.models.lora import has_lora
from plait.models.multimodal import MultimodalModel

__all__ = ["THINKER_CLASS", "OMNI_TOKENS", "QWEN3_OMNI_TOKENS", "Thinker", "THINKERS", "thinker_of",
           "composite_from_thinker", "thinker_from_composite", "load_thinker", "check_thinker_exportable",
           "save_thinker_processor"]

THINKER_CLASS = "Qwen2_5OmniThinkerForConditionalGeneration"
OMNI_TOKENS = {"video_token_index": "<|VIDEO|>", "vision_start_token_id": "<|vision_bos|>",
               "vision_end_token_id": "<|vision_eos|>", "audio_start_token_id": "<|audio_bos|>",
               "audio_end_token_id": "<|audio_eos|>"}
"""The thinker's config ids beyond the two placeholders, by config field: the tokens its chat template writes."""
QWEN3_OMNI_TOKENS = {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>",
                     "vision_end_token_id": "<|vision_end|>", "audio_start_token_id": "<|audio_start|>",
                     "audio_end_token_id": "<|audio_end|>"}
"""Qwen3-Omni's thinker config ids beyond the two placeholders (``<|image_pad|>``, ``<|audio_pad|>``)."""


@dataclass(frozen=True)
class Thinker:
    """One Omni thinker class plait maps to and from a two-branch composite.

    Attributes:
        fmt: the ``--format`` name; model_type / full_type: the thinker's and the full model's ``model_type``.
        model_class, processor_class: the transformers classes.
        vision_type, audio_type, text_type: the towers' and the text model's ``model_type``.
        llm_class: plait's causal LM around the text model.
        merger_out: the vision tower's last Linear (plait's projector folds into it), a path in the tower.
        audio_out: the audio tower's last Linear, a path in the tower.
        tokens: the config ids beyond the placeholders, by field (the tokens its chat template writes).
        fields: the thinker config's own fields that ride on the vision tower's config.
        placeholder_fields: the config fields of the image and audio placeholder ids (export).
        placeholders: the image, audio and video placeholder tokens; starts: the vision and audio start and end
            tokens (``(vision start, vision end, audio start, audio end)``), as its chat template writes them.
    """

    fmt: str
    model_type: str
    full_type: str
    model_class: str
    processor_class: str
    vision_type: str
    audio_type: str
    text_type: str
    llm_class: type
    merger_out: str
    audio_out: str
    tokens: dict[str, str]
    fields: tuple[str, ...]
    placeholder_fields: tuple[str, str]
    placeholders: tuple[str, str, str]
    starts: tuple[str, str, str, str]


THINKERS = {
    "qwen2_5_omni": Thinker("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen2_5_omni", THINKER_CLASS,
                            "Qwen2_5OmniProcessor", "qwen2_5_omni_vision_encoder", "qwen2_5_omni_audio_encoder",
                            "qwen2_5_omni_text", Qwen25OmniTextForCausalLM, "merger.mlp.2", "proj", OMNI_TOKENS,
                            ("position_id_per_seconds", "seconds_per_chunk", "user_token_id", "video_token_index",
                             "vision_start_token_id", "vision_end_token_id", "audio_start_token_id",
                             "audio_end_token_id"), ("image_token_index", "audio_token_index"),
                            ("<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>"),
                            ("<|vision_bos|>", "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>")),
    "qwen3_omni_moe": Thinker("qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe",
                              "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeProcessor",
                              "qwen3_omni_moe_vision_encoder", "qwen3_omni_moe_audio_encoder", "qwen3_omni_moe_text",
                              Qwen3OmniMoeTextForCausalLM, "merger.mlp.2", "proj2", QWEN3_OMNI_TOKENS,
                              ("position_id_per_seconds", "user_token_id", "video_token_id", "vision_start_token_id",
                               "vision_end_token_id", "audio_start_token_id", "audio_end_token_id"),
                              ("image_token_id", "audio_token_id"), ("<|image_pad|>", "<|audio_pad|>", "<|video_pad|>"),
                              ("<|vision_start|>", "<|vision_end|>", "<|audio_start|>", "<|audio_end|>")),
}
"""The Omni thinkers by ``--format`` name."""


def thinker_of(model_type: str) -> Thinker | None:
    """The :class:`Thinker` of a thinker's, a full Omni model's or a vision tower's ``model_type``; None otherwise."""
    return next((t for t in THINKERS.values() if model_type in (t.model_type, t.full_type, t.vision_type)), None)


def load_thinker(path: str | Path) -> PreTrainedModel:
    """The thinker of a thinker checkpoint (``qwen2_5_omni_thinker``, ``qwen3_omni_moe_thinker``), or of a full Omni
    one (its ``thinker.*`` tensors; the talker and token2wav are not read).

    Raises:
        ValueError: for a checkpoint of another ``model_type``.
    """
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    spec = thinker_of(cfg.model_type)
    if spec is None or cfg.model_type == spec.vision_type:
        raise ValueError(f"{path} holds a {cfg.model_type}, not an Omni thinker")
    cls = getattr(transformers, spec.model_class)
    if cfg.model_type == spec.model_type:
        return cls.from_pretrained(str(path)).eval()
    return cls.from_pretrained(str(path), config=cfg.thinker_config, key_mapping={r"^thinker\.": ""}).eval()


def composite_from_thinker(hf: PreTrainedModel, hop_length: int = 160, sampling_rate: int = 16000) -> MultimodalModel:
    """The plait composite holding the thinker's own modules (towers, decoder stack, ``lm_head``: shared, not copied),
    identity projectors, the ``vision`` and ``audio`` placeholder ids; ``hop_length`` / ``sampling_rate`` are the
    audio feature extractor's.

    Raises:
        ValueError: when a tower's output width differs from the LLM's hidden size.
    """
    cfg = hf.config
    spec = thinker_of(cfg.model_type)
    if spec is None:
        raise ValueError(f"{type(hf).__name__} ({cfg.model_type}) is not an Omni thinker")
    text = copy.deepcopy(cfg.get_text_config())
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
    with torch.device("meta"):
        llm = spec.llm_class(text)
    llm.model, llm.lm_head = hf.model.language_model, hf.lm_head
    hidden = llm.get_input_embeddings().embedding_dim
    visual, audio = hf.model.visual, hf.model.audio_tower
    for field in spec.fields:  # the thinker's own ids and timing ride on the vision tower's config
        if getattr(cfg, field, None) is not None:
            setattr(visual.config, field, getattr(cfg, field))
    vision = ModalityEncoder(visual, identity_projector(int(visual.config.out_hidden_size), hidden,
                                                        next(visual.parameters()).dtype), "image")
    hearing = ModalityEncoder(audio, identity_projector(int(audio.config.output_dim), hidden,
                                                        next(audio.parameters()).dtype), "audio",
                              hop_length=hop_length, sampling_rate=sampling_rate)
    return MultimodalModel(llm, {"vision": vision, "audio": hearing},
                           {"vision": int(cfg.image_token_id), "audio": int(cfg.audio_token_id)})


def check_thinker_exportable(model: MultimodalModel, fmt: str = "qwen2_5_omni") -> None:
    """Refuse a composite the thinker class of ``fmt`` (a :data:`THINKERS` name) cannot hold.

    Raises:
        ValueError: naming the difference: branches other than the thinker's vision and audio towers, a
            projector that is not one width-keeping Linear, or an LLM that is not the thinker's text model.
    """
    spec = THINKERS[fmt]
    kinds = {n: b.encoder.config.model_type for n, b in model.encoders.items()}
    if len(kinds) != 2 or set(kinds.values()) != {spec.vision_type, spec.audio_type}:
        raise ValueError(f"{spec.model_class} has one {spec.vision_type} and one {spec.audio_type} tower; this "
                         f"model's branches are {kinds}")
    for name, branch in model.encoders.items():
        lin = getattr(branch.projector, "linear_1", None)
        if branch.projector.kind != "linear" or lin is None or lin.in_features != lin.out_features:
            raise ValueError(f"{spec.model_class} has no projector after its towers; branch {name!r}'s "
                             f"{branch.projector.kind!r} projector cannot fold into the tower")
    text_type = model.language_model.config.model_type
    if text_type != spec.text_type:
        raise ValueError(f"{spec.model_class}'s LLM is the thinker's text model ({spec.text_type}); this model's is a "
                         f"{text_type}")
    llm_layout(model.language_model)


def _branches(model: MultimodalModel, spec: Thinker) -> tuple[str, ModalityEncoder, str, ModalityEncoder]:
    """``(vision name, vision branch, audio name, audio branch)``."""
    by_type = {b.encoder.config.model_type: (n, b) for n, b in model.encoders.items()}
    (vn, vb), (an, ab) = by_type[spec.vision_type], by_type[spec.audio_type]
    return vn, vb, an, ab  # type: ignore[return-value]


def thinker_from_composite(model: MultimodalModel, token_ids: dict[str, int] | None = None,
                           fmt: str = "qwen2_5_omni") -> PreTrainedModel:
    """The thinker class holding the composite's modules (towers, decoder stack, ``lm_head``: shared, not copied),
    each projector folded into its tower's last Linear in place (:func:`plait.models.hf_io.fold_into_linear`; an
    identity one leaves it untouched). ``token_ids``: further config ids (the thinker's ``tokens`` fields); ``fmt``: a
    :data:`THINKERS` name.

    Raises:
        ValueError: as :func:`check_thinker_exportable`, when a part still holds LoRA adapters, or when the assembled
            state dict differs in names or shapes from the class built from the same config.
    """
    check_thinker_exportable(model, fmt)
    if has_lora(model):
        raise ValueError("merge the LoRA adapters first (plait.models.hf_io.merge_adapters)")
    spec = THINKERS[fmt]
    vn, vision, an, audio = _branches(model, spec)
    llm = model.language_model
    text = copy.deepcopy(llm.config)
    tower_cfg = copy.deepcopy(vision.encoder.config)
    extra = {k: getattr(tower_cfg, k) for k in spec.fields if getattr(tower_cfg, k, None) is not None}
    extra |= token_ids or {}
    extra |= dict(zip(spec.placeholder_fields, (model.placeholder_ids[vn], model.placeholder_ids[an])))
    cls = getattr(transformers, spec.model_class)
    cfg = cls.config_class(vision_config=tower_cfg.to_dict(), audio_config=audio.encoder.config.to_dict(),
                           text_config=text.to_dict(),
                           tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), **extra)
    with torch.device("meta"):
        hf = cls(cfg)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    hf.model.visual, hf.model.audio_tower = vision.encoder, audio.encoder
    hf.model.language_model, hf.lm_head = llm.model, llm.get_output_embeddings()
    fold_into_linear(vision.projector.linear_1, vision.encoder.get_submodule(spec.merger_out))
    fold_into_linear(audio.projector.linear_1, audio.encoder.get_submodule(spec.audio_out))
    got = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"the composite does not fit {spec.model_class}: tensors differ in name or shape ({diff})")
    hf.generation_config = copy.deepcopy(llm.generation_config)
    return hf


def save_thinker_processor(model: MultimodalModel, tokenizer: Any, image_processor: Any, feature_extractor: Any,
                           folder: Path, fmt: str = "qwen2_5_omni") -> None:
    """Write the files the thinker's processor (``Qwen2_5OmniProcessor``, ``Qwen3OmniMoeProcessor``: ``fmt``) loads
    from (it cannot be built without torchvision, for its video processor): one ``preprocessor_config.json`` holding
    the image processor's and the feature extractor's settings (as the published thinker's), the tokenizer with its
    chat template (without plait's string-content prelude) and ``processor_config.json`` naming the class."""
    vision = next(n for n, b in model.encoders.items() if b.modality == "image")
    template = export_chat_template(tokenizer, tokenizer.convert_ids_to_tokens(model.placeholder_ids[vision]))
    merged = {**json.loads(feature_extractor.to_json_string()), **json.loads(image_processor.to_json_string())}
    (Path(folder) / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    tokenizer.save_pretrained(folder)
    if template:
        (Path(folder) / "chat_template.jinja").write_text(template)
    (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class":
                                                                    THINKERS[fmt].processor_class}, indent=2))
