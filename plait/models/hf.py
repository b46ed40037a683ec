"""Thin per-family facts about Hugging Face encoders and causal LMs, and how to build or load them.

plait never copies modeling code: it builds stock ``transformers`` models; what it needs to know about an encoder
family (which class is the encoder, whether outputs start with a CLS token, how many features an input yields, its
layout and tensor-parallel plan) is the family's module in :mod:`plait.models.families`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from plait.data.sources import path_note
from plait.models.families import encoder_family, family_of, family_of_layer, supported_types
from plait.models.families.base import EncoderLayout

__all__ = [
    "build_encoder",
    "build_causal_lm",
    "encoder_hidden_size",
    "encoder_feature_size",
    "check_processor",
    "feature_count_for",
    "LlmLayout",
    "NoPipelineLayout",
    "TP_STYLES",
    "tp_refusal",
    "encoder_layout",
    "encoder_tp_plan",
    "llm_layout",
    "llm_tp_plan",
    "run_encoder_layer",
]

TP_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_rep", "rowwise_split_input",
             "embedding_rowwise", "replicate")
"""transformers' tensor-parallel style names plait applies (``plait.parallel.tensor_parallel``; the others: packed,
MoE, MLA, sequence parallel, ``replicated_with_grad_allreduce`` (Qwen3's q/k norms), are refused)."""


def tp_refusal(llm: PreTrainedModel, encoders: Mapping[str, PreTrainedModel]) -> str:
    """Why plait's tensor parallelism refuses a model of this LLM and these encoder towers (by branch name), as the
    runtime refuses it: a family that ships no plan (:func:`llm_tp_plan`, :func:`encoder_tp_plan`) or a plan entry
    whose style is not one of :data:`TP_STYLES`; ``""`` when it can split them. The planner's input
    (``PlanInputs.tp_refusal``): no TP degree above 1 is searched for a refused model."""
    try:
        plans = {"model.llm": llm_tp_plan(llm), **{f"model.encoders.{name}": encoder_tp_plan(tower)
                                                   for name, tower in encoders.items()}}
    except ValueError as exc:
        return str(exc)
    for where, plan in plans.items():
        for path, style in plan.items():
            if style not in TP_STYLES:
                return (f"{where}: {path} has tensor-parallel style {style!r}, which plait does not apply "
                        f"(supported: {', '.join(TP_STYLES)})")
    return ""


class NoPipelineLayout(ValueError):
    """A model plait builds whose family has no pipeline layout here (:func:`encoder_layout`, :func:`llm_layout`):
    it cannot be cut into pipeline units, although its config is valid."""


@dataclass(frozen=True)
class LlmLayout:
    """Where the pipeline units of a causal LM live (module paths relative to the ``*ForCausalLM``).

    ``base`` is the decoder stack (``model``) whose forward takes ``inputs_embeds`` and runs ``layers``
    then ``norm``; ``embed``/``head`` are the input/output embeddings.
    """

    base: str
    embed: str
    layers: str
    norm: str
    head: str


def _class(name: str) -> type[PreTrainedModel]:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module) if module else transformers, attr)


def _config_from_dict(fields: dict[str, Any], where: str = "model config") -> PretrainedConfig:
    """The Hugging Face config of a ``config`` table; ``where`` names the table (``model.llm.config``) in errors."""
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError(f"{where} needs a 'model_type' field, got keys {sorted(fields)}")
    try:
        default = AutoConfig.for_model(model_type)
    except ValueError:
        raise ValueError(f"{where}: unknown model_type {model_type!r} in a model config table") from None
    unknown = sorted(k for k in fields if not hasattr(default, k))
    if unknown:
        raise ValueError(f"{where}: {model_type} config has no field(s) {unknown} (typo?)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001  transformers validates with huggingface_hub's StrictDataclassError
        raise ValueError(f"{where}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """A library error's message on one line (transformers' validation errors span several)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _build_from_table(where: str, build: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    """``build()`` the model of a ``config`` table; the library's error on a value it cannot build (a negative
    size: torch's RuntimeError) as a ValueError naming the table ``where``."""
    try:
        return build()
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: cannot build the model from this table: {_one_line(exc)}") from None


def build_encoder(
    modality: str, path: str | None = None, config: dict[str, Any] | None = None, weights: bool = True,
    field: str = "encoder",
) -> PreTrainedModel:
    """Build (from a config dict) or load (from a local directory) a Hugging Face modality encoder.

    Vision: SigLIP / CLIP vision towers and ViT (a full CLIP/SigLIP checkpoint gives its vision
    tower), SigLIP2, Qwen2.5-VL, Pixtral and InternVL vision towers (``models.families``; a full Qwen2.5-VL or
    InternVL checkpoint gives its tower). Audio: the Whisper encoder (a full Whisper checkpoint gives its encoder).
    With ``weights=False`` a ``path`` only supplies the config (and dtype): the module is built as
    ``from_pretrained`` would build it but keeps its constructor's values (call under ``torch.device("meta")`` for
    a structure-only build, then :func:`plait.models.init.materialize`). ``field`` (``model.encoders.vision``)
    names the job's table in errors.

    Raises:
        ValueError: for an unsupported ``model_type`` or modality, naming the supported ones; for a ``path``
            without a usable ``config.json`` or a ``config`` table with an unknown type or field, naming ``field``;
            for a ``config`` table value the library refuses or cannot build, naming the table and its reason.
        FileNotFoundError: when ``path`` is not a directory.
    """
    cfg = _load_config(path, field) if path is not None else _config_from_dict(config or {}, f"{field}.config")
    if modality == "image":
        family = family_of(cfg.model_type, "image")
        if family is None:
            raise ValueError(f"unsupported vision encoder model_type {cfg.model_type!r}; supported: "
                             f"{supported_types('image')}")
        cls = _class(family.encoder_class)
        kwargs = dict(family.build_kwargs)
        sub = getattr(cfg, "vision_config", cfg)
        if path is None:
            return _build_from_table(f"{field}.config", lambda: _from_table(cls, cfg, sub, **kwargs))
        if weights and sub is not cfg and family.tower_keys is not None:  # a full checkpoint's tower
            return cls.from_pretrained(path, config=sub, key_mapping=family.tower_keys)
        return cls.from_pretrained(path, **kwargs) if weights else cls._from_config(sub, **kwargs)
    if modality == "audio":
        family = family_of(cfg.model_type, "audio")
        if family is None:
            raise ValueError(f"unsupported audio encoder model_type {cfg.model_type!r}; supported: "
                             f"{supported_types('audio')}")
        encoder_cls = _class(family.encoder_class)
        sub = getattr(cfg, "audio_config", cfg)  # a full Qwen2-Audio checkpoint gives its audio tower
        if path is None:
            return _build_from_table(f"{field}.config", lambda: _from_table(encoder_cls, cfg, sub))
        if not weights:
            return encoder_cls._from_config(sub)
        if (cfg.architectures or [None])[0] == encoder_cls.__name__:
            return encoder_cls.from_pretrained(path)
        full = transformers.AutoModel.from_pretrained(path)
        return full.audio_tower if hasattr(full, "audio_tower") else full.get_encoder()
    raise ValueError(f"unknown modality {modality!r}; expected 'image' or 'audio'")


def _from_table(cls: type[PreTrainedModel], cfg: PretrainedConfig, sub: PretrainedConfig,
                **kwargs: Any) -> PreTrainedModel:
    """The tower ``cls`` of config ``sub`` (``cfg``'s tower config, or ``cfg``), in the ``dtype`` the table sets
    (on the tower's or the composite's config, as ``from_config`` honours it for a causal LM); default dtype
    otherwise."""
    dtype = getattr(sub, "dtype", None) or getattr(cfg, "dtype", None)
    if dtype is None:
        return cls(sub, **kwargs)
    return cls._from_config(sub, dtype=dtype, **kwargs)


def build_causal_lm(
    path: str | None = None,
    config: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    attn_implementation: str = "sdpa",
    weights: bool = True,
    field: str = "model.llm",
) -> PreTrainedModel:
    """Build (from a config dict, with ``vocab_size`` set from the tokenizer) or load a causal LM.

    With ``weights=False`` a ``path`` only supplies the config (and dtype, as ``from_pretrained`` picks it);
    the weights are left to :func:`plait.models.init.materialize` (build under ``torch.device("meta")``).
    ``field`` names the job's table in errors.

    Raises:
        ValueError: when a loaded model's vocabulary is smaller than ``vocab_size``; naming ``field``, for a
            ``path`` without a usable ``config.json`` or holding no causal LM, or a ``config`` table with an
            unknown type or field, or a value the library refuses or cannot build (naming its reason).
        FileNotFoundError: when ``path`` is not a directory.
    """
    if path is not None:
        cfg = _load_config(path, field)
        if type(cfg) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"{field}.path {path} holds a {cfg.model_type}, not a causal LM")
        if weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation)
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
        rows = model.get_input_embeddings().num_embeddings
        if vocab_size is not None and rows < vocab_size:
            raise ValueError(f"LLM at {path} has {rows} embedding rows but the tokenizer has {vocab_size} tokens")
        return model
    fields = dict(config or {})
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    cfg = _config_from_dict(fields, f"{field}.config")
    cfg._attn_implementation = attn_implementation
    return _build_from_table(f"{field}.config", lambda: transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn_implementation))


def _load_config(path: str, field: str = "model") -> PretrainedConfig:
    """The config of the model directory ``path`` (``field``: the job's table, e.g. ``model.llm``, for errors)."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist{path_note(path)}")
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"{field}.path {path} has no config.json")
    try:
        return AutoConfig.from_pretrained(path)
    except ValueError as exc:
        raise ValueError(f"{field}.path {path}: its config.json is not a known model ({str(exc)[:200]})") from None


def encoder_hidden_size(encoder: PreTrainedModel) -> int:
    """Width of the encoder's hidden states (``hidden_size`` or Whisper's ``d_model``)."""
    cfg = encoder.config
    return int(getattr(cfg, "hidden_size", None) or cfg.d_model)


def encoder_feature_size(encoder: PreTrainedModel, downsample: int) -> int:
    """Width of the features a branch hands its projector: the hidden size, times ``downsample ** 2`` for InternVL
    (its pixel shuffle stacks ``downsample x downsample`` neighbouring patches into one feature)."""
    family = family_of(encoder.config.model_type)
    hidden = encoder_hidden_size(encoder)
    return hidden if family is None else family.feature_size(encoder.config, hidden, downsample)


def check_processor(encoder: PreTrainedModel, processor: Any) -> None:
    """Refuse an image processor whose settings cannot fit ``encoder``'s family, when the job is built (before any
    sample is read): SigLIP2's ``max_num_patches`` above the tower's ``num_patches``, Pixtral's ``patch_size`` or
    ``size.longest_edge``, InternVL's tile ``size``. Other families are checked per sample
    (``families.base.EncoderInputCheck``).

    Raises:
        ValueError: starting with the processor field (``processor.max_num_patches = 32 ...``).
    """
    family = family_of(encoder.config.model_type)
    if family is not None:
        family.check_processor(processor, encoder.config)


def feature_count_for(
    encoder: PreTrainedModel, modality: str, select: str, downsample: int, hop_length: int = 160,
    sampling_rate: int = 16000,
) -> Any:
    """The feature-count function of an encoder with plait's feature selection and pooling (``VisionFeatureCount``,
    ``AudioFeatureCount`` or a family's own: ``Qwen2AudioFeatureCount``, ``Siglip2FeatureCount``,
    ``PixtralFeatureCount``, ``InternVLFeatureCount``, whose ``downsample`` is the pixel-shuffle factor).

    Raises:
        ValueError: when ``select="drop_cls"`` is asked of an encoder without a CLS token, or
            ``downsample > 1`` for images other than InternVL's (its pixel shuffle: a power of two dividing the
            patch grid, with ``select="drop_cls"``).
    """
    family = encoder_family(encoder.config.model_type, modality)
    return family.feature_count(encoder, select, downsample, hop_length, sampling_rate)


def dummy_encoder_input(
    encoder: PreTrainedModel, modality: str, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """A one-item input of the encoder's native shape (image ``[1, C, size, size]``, audio
    ``[1, mel, frames]``, zeros in the encoder's dtype, on ``device``: default CPU; ``"meta"`` for a probe of a
    model without weights), used to probe which parameters reach the output."""
    dtype = next(encoder.parameters()).dtype
    return encoder_family(encoder.config.model_type, modality).dummy_input(encoder.config, dtype, device)


def encoder_layout(encoder: PreTrainedModel) -> EncoderLayout:
    """The :class:`EncoderLayout` of ``encoder``'s family.

    Raises:
        NoPipelineLayout: for a family without a known layout, or a module tree that does not match it.
    """
    model_type = encoder.config.model_type
    family = family_of(model_type)
    layout = None if family is None else family.layout_of(encoder.config)
    if layout is None:
        raise NoPipelineLayout(
            f"no pipeline layout for encoder model_type {model_type!r}; supported: {supported_types('', layout=True)}"
        )
    paths = [*layout.embed, layout.layers, *([layout.post_norm] if layout.post_norm else [])]
    missing = [path for path in paths if not _has_module(encoder, path)]
    if missing or not isinstance(encoder.get_submodule(layout.layers), torch.nn.ModuleList):
        raise NoPipelineLayout(f"{type(encoder).__name__} does not have the expected modules {paths} "
                               f"(missing {missing})")
    heads = tuple(h for h in layout.heads if _has_module(encoder, h))
    return EncoderLayout(layout.embed, layout.layers, layout.post_norm, heads)


def encoder_tp_plan(encoder: PreTrainedModel) -> dict[str, str]:
    """The tensor-parallel plan of ``encoder``'s family: module path (relative to the HF encoder, ``*`` for the
    layer index, e.g. ``encoder.layers.*.self_attn.q_proj``) -> transformers' style name (``"colwise"``,
    ``"rowwise"``), the same format as a causal LM's ``tp_plan`` (:func:`llm_tp_plan`).

    Raises:
        ValueError: for a family without a plan (as :func:`encoder_layout`).
    """
    layout = encoder_layout(encoder)
    family = family_of(encoder.config.model_type)
    plan = None if family is None else family.tp_plan
    if plan is None:
        raise ValueError(f"no tensor-parallel plan for encoder model_type {encoder.config.model_type!r}; "
                         f"supported: {supported_types('', tp=True)}")
    return {f"{layout.layers}.*.{path}": style for path, style in plan.items()}


def llm_tp_plan(llm: PreTrainedModel) -> dict[str, str]:
    """The tensor-parallel plan transformers ships with ``llm``'s family (``config.base_model_tp_plan`` and the
    model class's ``_tp_plan``, merged by transformers into ``llm.tp_plan``): module path relative to the
    ``*ForCausalLM`` (``model.layers.*.self_attn.q_proj``) -> style name (``"colwise"``, ``"rowwise"``,
    ``"embedding_rowwise"``, ``"colwise_gather_output"``, ...). plait writes no per-family LLM plan.

    Raises:
        ValueError: when the family ships no plan (naming its ``model_type``).
    """
    plan = dict(getattr(llm, "tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(llm).__name__} (model_type {llm.config.model_type!r}) ships no tensor-parallel "
                         "plan (transformers' base_model_tp_plan): use parallel.tp = 1 for this LLM")
    return plan


def run_encoder_layer(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """One encoder layer on ``hidden`` ``[n, positions, dim]`` without attention mask, as the stock encoder
    forwards of every family with a layout call it (``layer(hidden_states, None)``; a family's
    ``layer_hidden_only`` layers, InternVL's, take the hidden states only).

    Raises:
        ValueError: for a layer its family cannot call on its own (``EncoderFamily.layer_refusal``): Qwen2-Audio's
            (its padding mask and pooler live in the stock forward only: a pipeline stage that owns its embedding
            must own all its layers) or Pixtral's called without its per-call inputs
            (``families.pixtral.PixtralCall.layer`` gives them).
    """
    family = family_of_layer(type(layer).__name__)
    if family is not None and family.layer_refusal:
        raise ValueError(family.layer_refusal)
    if family is not None and family.layer_hidden_only:
        return layer(hidden)
    out = layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out


def llm_layout(llm: PreTrainedModel) -> LlmLayout:
    """The :class:`LlmLayout` of a causal LM: ``<base>.layers``/``<base>.norm`` inside the base model
    (``base_model_prefix``), embeddings found from ``get_input_embeddings``/``get_output_embeddings``.

    Raises:
        NoPipelineLayout: when the model does not have that shape (e.g. GPT-2's ``transformer.h``).
    """
    base = getattr(llm, "base_model_prefix", "model") or "model"
    names = {id(m): n for n, m in llm.named_modules(remove_duplicate=False)}
    embed = names.get(id(llm.get_input_embeddings()))
    head = names.get(id(llm.get_output_embeddings()))
    layout = LlmLayout(base, embed or "", f"{base}.layers", f"{base}.norm", head or "")
    paths = (layout.base, layout.embed, layout.layers, layout.norm, layout.head)
    missing = [p for p in paths if not _has_module(llm, p)]
    if missing or not isinstance(llm.get_submodule(layout.layers), torch.nn.ModuleList):
        raise NoPipelineLayout(
            f"{type(llm).__name__}: no pipeline layout (expected {base}.layers, {base}.norm, input and output "
            f"embeddings; missing {missing})"
        )
    return layout


def _has_module(root: torch.nn.Module, path: str) -> bool:
    if not path:
        return False
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True
