"""Thin per-family facts about Hugging Face encoders and causal LMs, and how to build or load them.

plait never copies modeling code: it builds stock ``transformers`` models and only records what it needs
to know about a family (which class is the encoder, whether outputs start with a CLS token, how many
features an input yields).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from plait.data.sources import path_note
from plait.models.families.clips import checked_clip_samples
from plait.models.families import internvl, pixtral, qwen2_5_vl, qwen2_audio, siglip2

__all__ = [
    "VisionFeatureCount",
    "AudioFeatureCount",
    "build_encoder",
    "build_causal_lm",
    "encoder_hidden_size",
    "encoder_feature_size",
    "check_processor",
    "feature_count_for",
    "EncoderLayout",
    "LlmLayout",
    "encoder_layout",
    "encoder_tp_plan",
    "llm_layout",
    "llm_tp_plan",
    "run_encoder_layer",
    "audio_window",
]

# model_type -> (transformers class name, outputs start with a CLS token)
_VISION = {
    "siglip_vision_model": ("SiglipVisionModel", False),
    "siglip": ("SiglipVisionModel", False),
    "clip_vision_model": ("CLIPVisionModel", True),
    "clip": ("CLIPVisionModel", True),
    "vit": ("ViTModel", True),
    **{t: ("Siglip2VisionModel", False) for t in siglip2.MODEL_TYPES},
    **{t: ("PixtralVisionModel", False) for t in pixtral.MODEL_TYPES},
    **{t: ("InternVLVisionModel", True) for t in internvl.MODEL_TYPES},
    **{t: (qwen2_5_vl.ENCODER_CLASS, False) for t in qwen2_5_vl.MODEL_TYPES},
}
_AUDIO = {"whisper": "transformers.models.whisper.modeling_whisper.WhisperEncoder",
          **{t: qwen2_audio.ENCODER_CLASS for t in qwen2_audio.MODEL_TYPES}}


@dataclass(frozen=True)
class EncoderLayout:
    """Where the pipeline units of an encoder family live (module paths relative to the HF encoder).

    The HF encoder's own ``forward`` runs ``embed`` then the ``layers`` list then ``post_norm``, so a stage
    that owns the embedding runs that forward with its ``layers`` list cut to the owned layers and every
    module it does not own replaced by ``nn.Identity``; a stage without the embedding calls its layers one by
    one (``run_encoder_layer``). ``heads`` are modules that never feed hidden states (pooling heads).

    Attributes:
        embed: modules of the embedding unit, in the order the forward applies them.
        layers: the ``nn.ModuleList`` of encoder layers.
        post_norm: the norm the forward applies to the last layer's output; None for a tower without one
            (Pixtral; InternVL with ``use_mean_pooling``, whose ``layernorm`` is an ``nn.Identity``): no unit.
        heads: modules off the hidden-state path.
    """

    embed: tuple[str, ...]
    layers: str
    post_norm: str | None
    heads: tuple[str, ...] = ()


# model_type -> layout (transformers 5 module tree; checked against the stock forward in the unit tests)
_ENCODER_LAYOUTS = {
    "siglip_vision_model": EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",)),
    "siglip": EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",)),
    "clip_vision_model": EncoderLayout(("embeddings", "pre_layrnorm"), "encoder.layers", "post_layernorm"),
    "clip": EncoderLayout(("embeddings", "pre_layrnorm"), "encoder.layers", "post_layernorm"),
    "vit": EncoderLayout(("embeddings",), "layers", "layernorm", ("pooler",)),
    "siglip2_vision_model": EncoderLayout(("embeddings",), "encoder.layers", "post_layernorm", ("head",)),
    "whisper": EncoderLayout(("conv1", "conv2", "embed_positions"), "layers", "layer_norm"),
    # the avg_pooler runs between the last layer and layer_norm: a stage owning the embedding must own every layer
    "qwen2_audio_encoder": EncoderLayout(("conv1", "conv2", "embed_positions"), "layers", "layer_norm"),
    # no final norm; patch_positional_embedding (2D RoPE, buffers only) rides with the embedding (a later stage
    # rebuilds its rotary table: families.pixtral.PixtralCall)
    "pixtral": EncoderLayout(("patch_conv", "ln_pre", "patch_positional_embedding"), "transformer.layers", None),
    # post_norm None with use_mean_pooling (its layernorm is an nn.Identity): encoder_layout reads the config
    "internvl_vision": EncoderLayout(("embeddings",), "encoder.layer", "layernorm"),
    # the merger (ln_q + MLP over 2x2 blocks) in the post-norm slot; rotary_pos_emb (a buffer only) rides with
    # patch_embed; the blocks' per-call inputs come from models.tower_call (families.qwen2_5_vl.Qwen25VLCall)
    "qwen2_5_vl_vision": EncoderLayout(("patch_embed", "rotary_pos_emb"), "blocks", "merger"),
}


_ATTN_MLP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
             "self_attn.out_proj": "rowwise"}
# model_type -> tensor-parallel plan of one encoder layer (module path in the layer -> transformers' style name):
# attention heads split by colwise q/k/v and a rowwise output projection, the MLP by colwise fc1 and rowwise fc2
# (Megatron-LM's layout). Embeddings, norms and the post-norm stay replicated. None of these families ships a plan.
_ENCODER_TP_PLANS = {
    "siglip_vision_model": {**_ATTN_MLP, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "siglip": {**_ATTN_MLP, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "siglip2_vision_model": {**_ATTN_MLP, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "clip_vision_model": {**_ATTN_MLP, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "clip": {**_ATTN_MLP, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "vit": {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
            "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
    "whisper": {**_ATTN_MLP, "fc1": "colwise", "fc2": "rowwise"},
    "qwen2_audio_encoder": {**_ATTN_MLP, "fc1": "colwise", "fc2": "rowwise"},
    # Pixtral: heads split with their 2D RoPE (the same per-head rotation on every head); gated MLP. InternVL has no
    # plan: its attention reshapes its output to the full embed_dim, which a rank holding some heads does not have
    "pixtral": {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
                "attention.o_proj": "rowwise", "feed_forward.gate_proj": "colwise", "feed_forward.up_proj": "colwise",
                "feed_forward.down_proj": "rowwise"},
}


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


@dataclass(frozen=True)
class VisionFeatureCount:
    """Features a ViT-style encoder emits for one image: ``(H // patch) * (W // patch) + cls_tokens``.

    The same object counts placeholders in the processor and checks the encoder's real output, so the two
    can never disagree.
    """

    patch_size: int
    cls_tokens: int

    def __call__(self, size: tuple[int, int]) -> int:
        """Features (tokens) for an image of ``size = (height, width)`` pixels.

        Raises:
            ValueError: when the image is smaller than one patch.
        """
        h, w = int(size[0]), int(size[1])
        if h < self.patch_size or w < self.patch_size:
            raise ValueError(f"image of {h}x{w} pixels is smaller than one {self.patch_size}-pixel patch")
        return (h // self.patch_size) * (w // self.patch_size) + self.cls_tokens


@dataclass(frozen=True)
class AudioFeatureCount:
    """Features a Whisper-style encoder emits for a clip of ``n`` samples, after optional pooling.

    Log-mel frames: ``ceil(n / hop_length)``; the stride-2 convolution halves them (``ceil(f / 2)``);
    average pooling by ``downsample`` gives ``ceil(x / downsample)``. Whisper pads every clip to a fixed
    window of ``max_positions`` encoder positions; plait keeps only the features that cover real audio.
    """

    hop_length: int
    conv_stride: int
    downsample: int
    max_positions: int
    sampling_rate: int

    @property
    def max_samples(self) -> int:
        """Longest clip in samples that fits the encoder's window."""
        return self.max_positions * self.conv_stride * self.hop_length

    def __call__(self, num_samples: int) -> int:
        """Features (tokens) for a clip of ``num_samples`` samples.

        Raises:
            ValueError: for an empty clip or one longer than the encoder window.
        """
        n = checked_clip_samples(num_samples, self.max_samples, self.sampling_rate)
        frames = math.ceil(n / self.hop_length)
        positions = math.ceil(frames / self.conv_stride)
        return math.ceil(positions / self.downsample)


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
        if cfg.model_type not in _VISION:
            raise ValueError(f"unsupported vision encoder model_type {cfg.model_type!r}; supported: {sorted(_VISION)}")
        cls = _class(_VISION[cfg.model_type][0])
        kwargs = {"add_pooling_layer": False} if cfg.model_type == "vit" else {}
        sub = getattr(cfg, "vision_config", cfg)
        if path is None:
            return _build_from_table(f"{field}.config", lambda: _from_table(cls, cfg, sub, **kwargs))
        if weights and sub is not cfg and cfg.model_type in qwen2_5_vl.MODEL_TYPES:  # a full checkpoint's tower
            return cls.from_pretrained(path, config=sub, key_mapping=qwen2_5_vl.TOWER_KEYS)
        if weights and sub is not cfg and cfg.model_type in internvl.MODEL_TYPES:  # a full InternVL checkpoint's tower
            return cls.from_pretrained(path, config=sub, key_mapping=internvl.TOWER_KEYS)
        return cls.from_pretrained(path, **kwargs) if weights else cls._from_config(sub, **kwargs)
    if modality == "audio":
        if cfg.model_type not in _AUDIO:
            raise ValueError(f"unsupported audio encoder model_type {cfg.model_type!r}; supported: {sorted(_AUDIO)}")
        encoder_cls = _class(_AUDIO[cfg.model_type])
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
    if encoder.config.model_type in internvl.MODEL_TYPES:
        return encoder_hidden_size(encoder) * int(downsample) ** 2
    if encoder.config.model_type in qwen2_5_vl.MODEL_TYPES:  # the merger's output width
        return int(encoder.config.out_hidden_size)
    return encoder_hidden_size(encoder)


def check_processor(encoder: PreTrainedModel, processor: Any) -> None:
    """Refuse an image processor whose settings cannot fit ``encoder``'s family, when the job is built (before any
    sample is read): SigLIP2's ``max_num_patches`` above the tower's ``num_patches``, Pixtral's ``patch_size`` or
    ``size.longest_edge``, InternVL's tile ``size``. Other families are checked per sample
    (``encoder.EncoderInputCheck``).

    Raises:
        ValueError: starting with the processor field (``processor.max_num_patches = 32 ...``).
    """
    cfg = encoder.config
    if cfg.model_type in siglip2.MODEL_TYPES:
        siglip2.check_siglip2_processor(processor, cfg)
    elif cfg.model_type in pixtral.MODEL_TYPES:
        pixtral.check_pixtral_processor(processor, cfg)
    elif cfg.model_type in internvl.MODEL_TYPES:
        internvl.check_internvl_processor(processor, cfg)
    elif cfg.model_type in qwen2_5_vl.MODEL_TYPES:
        qwen2_5_vl.check_qwen2_5_vl_processor(processor, cfg)


def _side(value: Any) -> int:
    """A square size (an int, or an ``(H, W)`` pair of equal sides, as InternVL's config stores it) as an int.

    Raises:
        ValueError: for a non-square pair.
    """
    if isinstance(value, int):
        return value
    h, w = (int(v) for v in value)
    if h != w:
        raise ValueError(f"size {h}x{w} is not square")
    return h


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
    cfg = encoder.config
    if modality == "image":
        has_cls = _VISION.get(cfg.model_type, ("", False))[1]
        if select == "drop_cls" and not has_cls:
            raise ValueError(f"select='drop_cls' but {cfg.model_type} outputs have no CLS token")
        if cfg.model_type in internvl.MODEL_TYPES:
            return internvl.InternVLFeatureCount(_side(cfg.patch_size), internvl.tile_size(cfg), int(downsample),
                                                 int(select == "full"))
        if downsample != 1:
            raise ValueError("downsample applies to audio frames only; use 1 for images")
        if cfg.model_type in siglip2.MODEL_TYPES:
            return siglip2.Siglip2FeatureCount(int(cfg.num_patches))
        if cfg.model_type in pixtral.MODEL_TYPES:
            return pixtral.PixtralFeatureCount(int(cfg.patch_size), int(cfg.image_size))
        if cfg.model_type in qwen2_5_vl.MODEL_TYPES:
            return qwen2_5_vl.feature_count(cfg)
        return VisionFeatureCount(int(cfg.patch_size), int(has_cls and select == "full"))
    if cfg.model_type in qwen2_audio.MODEL_TYPES:
        return qwen2_audio.Qwen2AudioFeatureCount(hop_length, downsample, int(cfg.max_source_positions), sampling_rate)
    conv_stride = int(encoder.conv2.stride[0]) * int(encoder.conv1.stride[0])
    return AudioFeatureCount(hop_length, conv_stride, downsample, int(cfg.max_source_positions), sampling_rate)


def dummy_encoder_input(
    encoder: PreTrainedModel, modality: str, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """A one-item input of the encoder's native shape (image ``[1, C, size, size]``, audio
    ``[1, mel, frames]``, zeros in the encoder's dtype, on ``device``: default CPU; ``"meta"`` for a probe of a
    model without weights), used to probe which parameters reach the output."""
    cfg = encoder.config
    dtype = next(encoder.parameters()).dtype
    if cfg.model_type in siglip2.MODEL_TYPES:
        return siglip2.siglip2_dummy_input(cfg, dtype, device)
    if cfg.model_type in pixtral.MODEL_TYPES:
        return pixtral.pixtral_dummy_input(cfg, dtype, device)
    if cfg.model_type in internvl.MODEL_TYPES:
        return internvl.internvl_dummy_input(cfg, dtype, device)
    if cfg.model_type in qwen2_5_vl.MODEL_TYPES:
        return qwen2_5_vl.qwen2_5_vl_dummy_input(cfg, dtype, device)
    if modality == "image":
        size = int(cfg.image_size)
        return {"pixel_values": torch.zeros(1, int(cfg.num_channels), size, size, dtype=dtype, device=device)}
    return {"input_features": torch.zeros(1, *audio_window(cfg), dtype=dtype, device=device)}


# WhisperEncoder and Qwen2AudioEncoder build conv1 with stride 1 and conv2 with stride 2 (fixed in transformers'
# modeling code, not a config field); the encoder refuses any other number of input frames.
_AUDIO_CONV_STRIDE = 2


def audio_window(cfg: PretrainedConfig) -> tuple[int, int]:
    """``(mel bins, frames)`` of the one input window a Whisper-style audio encoder accepts, from its config
    alone (``max_source_positions`` x the convolutions' stride 2), so that a pipeline rank whose encoder units
    were pruned away (no parameters, no convolutions) still knows it."""
    return int(cfg.num_mel_bins), int(cfg.max_source_positions) * _AUDIO_CONV_STRIDE


def encoder_layout(encoder: PreTrainedModel) -> EncoderLayout:
    """The :class:`EncoderLayout` of ``encoder``'s family.

    Raises:
        ValueError: for a family without a known layout, or a module tree that does not match it.
    """
    model_type = encoder.config.model_type
    layout = _ENCODER_LAYOUTS.get(model_type)
    if layout is None:
        raise ValueError(
            f"no pipeline layout for encoder model_type {model_type!r}; supported: {sorted(_ENCODER_LAYOUTS)}"
        )
    if model_type in internvl.MODEL_TYPES and not internvl.has_post_norm(encoder.config):
        layout = EncoderLayout(layout.embed, layout.layers, None, layout.heads)
    paths = [*layout.embed, layout.layers, *([layout.post_norm] if layout.post_norm else [])]
    missing = [path for path in paths if not _has_module(encoder, path)]
    if missing or not isinstance(encoder.get_submodule(layout.layers), torch.nn.ModuleList):
        raise ValueError(f"{type(encoder).__name__} does not have the expected modules {paths} (missing {missing})")
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
    plan = _ENCODER_TP_PLANS.get(encoder.config.model_type)
    if plan is None:
        raise ValueError(f"no tensor-parallel plan for encoder model_type {encoder.config.model_type!r}; "
                         f"supported: {sorted(_ENCODER_TP_PLANS)}")
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
    forwards of every family in ``_ENCODER_LAYOUTS`` call it (``layer(hidden_states, None)``; InternVL's layers
    take the hidden states only).

    Raises:
        ValueError: for a Qwen2-Audio layer (its padding mask and pooler live in the stock forward only: a pipeline
            stage that owns its embedding must own all its layers) or a Pixtral layer called without its per-call
            inputs (``families.pixtral.PixtralCall.layer`` gives them).
    """
    if type(layer).__name__ == "Qwen2AudioEncoderLayer":
        raise ValueError("the Qwen2-Audio encoder's layers cannot start a pipeline stage (its padding mask and "
                         "pooler run inside its own forward): give the branch one stage")
    if type(layer).__name__ == pixtral.LAYER_CLASS:
        raise ValueError("a Pixtral layer needs its call's 2D rotary positions and block mask: run it through "
                         "plait.models.tower_call (families.pixtral.PixtralCall.layer)")
    if type(layer).__name__ == internvl.LAYER_CLASS:  # takes the hidden states only
        return layer(hidden)
    out = layer(hidden, None)
    return out[0] if isinstance(out, tuple) else out


def llm_layout(llm: PreTrainedModel) -> LlmLayout:
    """The :class:`LlmLayout` of a causal LM: ``<base>.layers``/``<base>.norm`` inside the base model
    (``base_model_prefix``), embeddings found from ``get_input_embeddings``/``get_output_embeddings``.

    Raises:
        ValueError: when the model does not have that shape (e.g. GPT-2's ``transformer.h``).
    """
    base = getattr(llm, "base_model_prefix", "model") or "model"
    names = {id(m): n for n, m in llm.named_modules(remove_duplicate=False)}
    embed = names.get(id(llm.get_input_embeddings()))
    head = names.get(id(llm.get_output_embeddings()))
    layout = LlmLayout(base, embed or "", f"{base}.layers", f"{base}.norm", head or "")
    paths = (layout.base, layout.embed, layout.layers, layout.norm, layout.head)
    missing = [p for p in paths if not _has_module(llm, p)]
    if missing or not isinstance(llm.get_submodule(layout.layers), torch.nn.ModuleList):
        raise ValueError(
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
