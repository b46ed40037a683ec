"""Compose a model and its processor from a :class:`~plait.config.schema.ModelConfig`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer

from plait.config.schema import EncoderConfig, ModelConfig, VideoConfig
from plait.data.chat_template import read_chat_template, template_names
from plait.data.processing import ModalitySpec, MultimodalProcessor
from plait.data.sources import path_note
from plait.data.video import VideoSpec
from plait.models.encoder import ModalityEncoder
from plait.models.families import encoder_family
from plait.models.hf import build_causal_lm, build_encoder, check_processor, encoder_feature_size
from plait.models.processor_table import check_processor_table
from plait.models.init import materialize, weight_source
from plait.models.lora import apply_lora
from plait.models.multimodal import MultimodalModel, saved_video_settings
from plait.models.projector import build_projector

__all__ = ["load_tokenizer", "build_model", "compose_model", "build_processor", "apply_freezing", "placeholder_of",
           "check_pretrained_branch"]


def load_tokenizer(path: str, chat_template: str = "") -> Any:
    """A Hugging Face tokenizer from a local directory; ``chat_template`` (``data.chat_template``: a Jinja file
    or a committed template's name, :func:`plait.data.chat_template.read_chat_template`) replaces its template.
    A job's directory is :func:`plait.data.chat_template.tokenizer_dir` (``data.tokenizer`` or the LLM's folder).

    Raises:
        FileNotFoundError: when ``path`` is not a directory.
        ValueError: when it cannot be loaded, ``chat_template`` names nothing, or there is no chat template
            (plait needs one to render conversations).
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(f"data.tokenizer: tokenizer directory {path} does not exist{path_note(path)}")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/... for broken folders
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {exc}") from exc
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    if not tok.chat_template:
        raise ValueError(f"tokenizer at {path} has no chat template; set data.chat_template "
                         f"(a Jinja file or one of {', '.join(template_names())})")
    return tok


def placeholder_of(enc: EncoderConfig) -> str:
    """The placeholder string of a branch (``"<image>"``/``"<audio>"`` unless configured)."""
    return enc.placeholder or f"<{enc.modality}>"


def _placeholder_ids(cfg: ModelConfig, tokenizer: Any) -> dict[str, int]:
    ids = {}
    for name, enc in cfg.encoders.items():
        token = placeholder_of(enc)
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"model.encoders.{name}: placeholder {token!r} is not a token of the tokenizer")
        ids[name] = int(tid)
    return ids


def build_model(
    cfg: ModelConfig, tokenizer: Any, device: torch.device | str | None = None, seed: int | None = None
) -> MultimodalModel:
    """Build the composite (from a plait checkpoint, local HF parts or configs), apply freezing, then the LoRA
    adapters of ``[model.llm.lora]`` / ``[model.encoders.<name>.lora]`` (:func:`plait.models.lora.apply_lora`,
    on the meta device, so adapters are materialised and initialised with their units).

    The model is always composed on the meta device first (no memory, no init work; the unreachable-parameter
    probe runs on meta too). With ``device="meta"`` it is returned that way, for a pipeline rank to
    materialise only its share: ``materialize(model, device, seed, keep=rank_prefixes(model, units),
    source=weight_source(cfg, model))`` (:mod:`plait.models.init`). Otherwise everything is materialised on
    ``device`` (default CPU): the per-module deterministic init from ``seed`` (default
    ``torch.initial_seed()``, i.e. the last ``torch.manual_seed``), then the pretrained weights. Either way a
    tensor's value depends only on ``(seed, its FQN)`` and the checkpoint, so every rank and the single-process
    trainer agree.

    Raises:
        ValueError: for unsupported model types, a placeholder that is not a token, mismatched sizes, or a
            pretrained directory without safetensors weights.
    """
    with torch.device("meta"):
        model = compose_model(cfg, tokenizer, weights=False)
    apply_freezing(model, cfg)
    apply_lora(model, cfg)
    if device is not None and torch.device(device).type == "meta":
        return model
    materialize(model, device or "cpu", seed, source=weight_source(cfg, model))
    return model


def compose_model(cfg: ModelConfig, tokenizer: Any, weights: bool = True) -> MultimodalModel:
    """The composite of ``cfg`` without freezing, built in the current device context. ``weights=True``
    loads pretrained parts with Hugging Face ``from_pretrained`` (and random parts keep their constructors'
    init, from the global RNG); ``weights=False`` builds every part from its config only (use under
    ``torch.device("meta")``; :func:`build_model` does).

    Raises:
        ValueError: as :func:`build_model`.
    """
    if cfg.pretrained:
        model = MultimodalModel.from_pretrained(cfg.pretrained, cfg.llm.attn_implementation, weights=weights)
        missing = set(cfg.encoders) - set(model.encoders)
        if missing:
            raise ValueError(f"model.encoders {sorted(missing)} are not in the checkpoint {cfg.pretrained}")
        for name, enc in cfg.encoders.items():
            check_pretrained_branch(name, enc, model, cfg.pretrained)
        return model
    llm = build_causal_lm(cfg.llm.path, cfg.llm.config, len(tokenizer), cfg.llm.attn_implementation, weights,
                          field="model.llm")
    hidden = llm.get_input_embeddings().embedding_dim
    encoders = {}
    for name, enc in cfg.encoders.items():
        hf_encoder = build_encoder(enc.modality, enc.path, enc.config, weights, field=f"model.encoders.{name}")
        projector = build_projector(enc.projector, encoder_feature_size(hf_encoder, enc.downsample), hidden,
                                    float(getattr(hf_encoder.config, "layer_norm_eps", 1e-6)))
        hop = int(enc.processor.get("hop_length", 160))
        rate = int(enc.processor.get("sampling_rate", 16000))
        try:
            encoders[name] = ModalityEncoder(
                hf_encoder, projector, enc.modality, enc.feature_layer, enc.select, enc.downsample, hop, rate
            )
        except ValueError as exc:
            raise ValueError(f"model.encoders.{name}: {exc}") from exc
    return MultimodalModel(llm, encoders, _placeholder_ids(cfg, tokenizer))


_STRUCTURE = ("modality", "feature_layer", "select", "downsample", "projector")
"""Branch fields a plait checkpoint fixes (``plait_config.json``): a job table may repeat them, not change them."""


def check_pretrained_branch(name: str, enc: EncoderConfig, model: MultimodalModel, pretrained: str) -> None:
    """Refuse a ``[model.encoders.<name>]`` table of a ``model.pretrained`` job that sets a structural field
    (:data:`_STRUCTURE`) to another value than the checkpoint's branch has (``plait_config.json``). A field left at
    its default takes the checkpoint's value, so a table that only adds flags (``lora``, ``freeze``) inherits the
    branch's modality; limitation: ``modality = "image"`` (the default) written for an audio branch cannot be told
    from a table that omits it, and is taken as the checkpoint's. The placeholder is checked by
    :func:`build_processor` (it needs the tokenizer).

    Raises:
        ValueError: naming the field, the job's and the checkpoint's value.
    """
    saved = model.encoders[name].settings()
    default = EncoderConfig()
    for field in _STRUCTURE:
        mine = getattr(enc, field)
        if mine != getattr(default, field) and mine != saved[field]:
            raise ValueError(f"model.encoders.{name}.{field} = {mine!r} but the checkpoint {pretrained} has "
                             f"{saved[field]!r} for branch {name!r}; leave it out to use the checkpoint's")


def _pretrained_placeholder(name: str, enc: EncoderConfig, model: MultimodalModel, tokenizer: Any,
                            pretrained: str) -> str:
    """The placeholder string of branch ``name`` of a checkpoint: the token of its saved placeholder id.

    Raises:
        ValueError: when the job's ``placeholder`` names another token.
    """
    token = tokenizer.convert_ids_to_tokens(model.placeholder_ids[name])
    if enc.placeholder and enc.placeholder != token:
        raise ValueError(f"model.encoders.{name}.placeholder = {enc.placeholder!r} but the checkpoint {pretrained} "
                         f"uses {token!r} for branch {name!r}; leave it out to use the checkpoint's")
    return token


def apply_freezing(model: MultimodalModel, cfg: ModelConfig) -> None:
    """Set ``requires_grad`` of the LLM, each encoder and each projector from the config flags."""
    model.set_frozen("llm", cfg.llm.freeze)
    for name, enc in cfg.encoders.items():
        model.set_frozen("encoder", enc.freeze, name)
        model.set_frozen("projector", enc.freeze_projector, name)


def _hf_processor(enc: EncoderConfig, branch: ModalityEncoder) -> Any:
    if enc.path:  # the folder's processor, the job's table over it (as for a model.pretrained checkpoint)
        family = encoder_family(branch.encoder.config.model_type, enc.modality)
        return _folder_processor(Path(enc.path), enc.modality, {**family.folder_processor_args, **enc.processor})
    kwargs = dict(enc.processor)
    cfg = branch.encoder.config
    if enc.modality == "image":
        family = encoder_family(cfg.model_type, "image")
        cls_name = kwargs.pop("class", family.image_processor)
        family.processor_defaults(cfg, kwargs)  # what the tower fixes (patch size, grid, tiles), unless configured
        return getattr(transformers, cls_name)(**kwargs)
    count = branch.feature_count
    kwargs.setdefault("feature_size", int(cfg.num_mel_bins))
    kwargs.setdefault("sampling_rate", count.sampling_rate)
    kwargs.setdefault("hop_length", count.hop_length)
    kwargs.setdefault("chunk_length", count.max_samples // count.sampling_rate)
    if kwargs["chunk_length"] * kwargs["sampling_rate"] != count.max_samples:
        raise ValueError(
            f"audio window of {count.max_samples} samples is not a whole number of seconds; set "
            "max_source_positions so that it is"
        )
    return transformers.WhisperFeatureExtractor(**kwargs)


def build_processor(cfg: ModelConfig, model: MultimodalModel, tokenizer: Any, max_length: int) -> MultimodalProcessor:
    """The :class:`MultimodalProcessor` matching ``model``'s branches (same feature-count functions).

    With ``cfg.pretrained`` (a plait ``final/`` folder) each branch's defaults are the checkpoint's: its modality,
    its placeholder (the token of its saved id), its processor (``processors/<name>/``), the job's
    ``processor`` fields overriding the saved settings (:func:`_pretrained_processor`), and its video settings
    (saved in ``plait_config.json``, overridden field by field by the job's, :func:`_pretrained_video`); a job
    table may therefore only add flags (``lora``, ``freeze``).

    Raises:
        ValueError: when ``max_length`` exceeds the LLM's ``max_position_embeddings``, a pretrained job's
            ``placeholder`` differs from the checkpoint's, a processor setting cannot fit its tower
            (:func:`plait.models.hf.check_processor`), or a video placeholder set in the job is not a token
            (each naming the field).
    """
    limit = getattr(model.language_model.config, "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise ValueError(f"data.max_length={max_length} exceeds the LLM's max_position_embeddings={limit}")
    specs = []
    for name, branch in model.encoders.items():
        enc = cfg.encoders.get(name) or EncoderConfig(modality=branch.modality)
        if cfg.pretrained:
            placeholder = _pretrained_placeholder(name, enc, model, tokenizer, cfg.pretrained)
            hf = _pretrained_processor(Path(cfg.pretrained), name, enc, branch)
            saved = saved_video_settings(cfg.pretrained).get(name)
            enc = dataclasses.replace(enc, video=_pretrained_video(enc.video, saved))
        else:
            placeholder, hf = placeholder_of(enc), _hf_processor(enc, branch)
        try:
            check_processor_table(hf, enc.processor)  # keys and value types first: the family check computes
            check_processor(branch.encoder, hf)
        except ValueError as exc:
            raise ValueError(f"model.encoders.{name}.{exc}") from exc
        specs.append(ModalitySpec(name, branch.modality, placeholder, model.placeholder_ids[name], hf,
                                  branch.feature_count, branch.check_item, _video_spec(name, enc, branch, tokenizer)))
    return MultimodalProcessor(tokenizer, specs, max_length)


def _pretrained_processor(root: Path, name: str, enc: EncoderConfig, branch: ModalityEncoder) -> Any:
    """Branch ``name``'s processor in a ``model.pretrained`` job: the one saved next to the checkpoint
    (``<root>/processors/<name>/``, as ``plait train`` writes ``final/``) with the job's ``processor`` fields
    overriding its settings (``class`` chooses the class); the job's ``path`` takes precedence; a checkpoint
    without that folder falls back to the job's table (:func:`_hf_processor`) with the checkpoint's modality."""
    folder = root / "processors" / name
    enc = dataclasses.replace(enc, modality=branch.modality)
    if enc.path or not folder.is_dir():
        return _hf_processor(enc, branch)
    return _folder_processor(folder, branch.modality, dict(enc.processor))


def _folder_processor(folder: Path, modality: str, table: dict[str, Any]) -> Any:
    """The processor saved in ``folder`` with ``table`` (a job's ``processor`` fields) overriding its settings;
    ``class`` chooses the class (default: the auto class of ``modality``)."""
    kwargs = dict(table)
    if "class" in kwargs:
        cls: Any = getattr(transformers, kwargs.pop("class"))
    else:
        cls = transformers.AutoImageProcessor if modality == "image" else transformers.AutoFeatureExtractor
    return cls.from_pretrained(str(folder), **kwargs)


def _pretrained_video(job: VideoConfig, saved: dict[str, Any] | None) -> VideoConfig:
    """A ``model.pretrained`` branch's video settings: the checkpoint's (``plait_config.json``, as ``plait train``
    saves the job's ``[model.encoders.<name>.video]``), each field the job sets to another value than its default
    overriding it (limitation: a field set to its default cannot be told from one left out)."""
    if not saved:
        return job
    default = VideoConfig()
    return VideoConfig(**{f.name: getattr(job, f.name) if getattr(job, f.name) != getattr(default, f.name)
                          else saved.get(f.name, getattr(default, f.name)) for f in dataclasses.fields(VideoConfig)})


def _video_spec(name: str, enc: EncoderConfig, branch: ModalityEncoder, tokenizer: Any) -> VideoSpec | None:
    """How image branch ``name`` takes videos (``[model.encoders.<name>.video]``; the placeholder id is None when
    the default placeholder is not a token: a tokenizer for images only, whose records with videos are then refused
    naming the field); None for audio.

    Raises:
        ValueError: for a placeholder set in the job (not the default) that is not a token of the tokenizer, as
            an image placeholder is refused (a job error, not every video record's); a negative fps or a frame
            limit below 1; ``audio = true`` on a tower that cannot take a video's audio track; a video table on an
            audio branch (naming the field).
    """
    video = enc.video
    if branch.modality != "image":
        if video != VideoConfig():
            raise ValueError(f"model.encoders.{name}.video: branch {name!r} is an audio branch and takes no videos; "
                             "set the video table on the image branch (a video's audio track: its audio = true)")
        return None
    if video.audio and "seconds_per_chunk" not in branch.video_encoding.timing(1.0):
        raise ValueError(f"model.encoders.{name}.video.audio = true needs a tower that encodes a video as one timed "
                         "item of temporal patches, as the Qwen2.5-Omni thinker's vision tower does "
                         f"(model_type 'qwen2_5_omni_vision_encoder'); this branch's tower "
                         f"({branch.family.name}) does not: set it to false")
    tid = tokenizer.convert_tokens_to_ids(video.placeholder)
    tid = None if tid is None or tid == tokenizer.unk_token_id else int(tid)
    if tid is None and video.placeholder != VideoConfig().placeholder:
        raise ValueError(f"model.encoders.{name}.video.placeholder: {video.placeholder!r} is not a token of the "
                         "tokenizer (set a single token of it, or leave the default "
                         f"{VideoConfig().placeholder!r} for a job without videos)")
    return VideoSpec(video.placeholder, tid, float(video.fps), int(video.max_frames), f"model.encoders.{name}.video",
                     branch.video_encoding, bool(video.audio))
