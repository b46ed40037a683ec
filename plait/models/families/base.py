"""What every encoder family tells plait, and the ViT / Whisper defaults.

An :class:`EncoderFamily` holds one family's facts: its ``model_type`` values, the transformers class of its tower,
its pipeline layout, its tensor-parallel plan, how its tower is called (per-call layer inputs, packed images), its
feature count and feature width, its processor defaults and checks, its per-item input check, how it encodes a
video, and the architecture facts the planner reads (:meth:`EncoderFamily.arch_fields`). Each family module of
:mod:`plait.models.families` defines one subclass instance ``FAMILY``; :data:`plait.models.families.FAMILIES` lists
them. The defaults are a ViT-style vision tower (:class:`VisionFamily`) or a Whisper-style audio encoder
(:class:`AudioFamily`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from plait.data.processing import PerFrame

__all__ = ["EncoderFamily", "VisionFamily", "AudioFamily", "EncoderLayout", "VisionFeatureCount",
           "AudioFeatureCount", "EncoderInputCheck", "AUDIO_CONV_STRIDE", "audio_window", "vision_arch_fields",
           "config_field", "positive_field", "ATTN_MLP_PLAN", "WHISPER_PLAN", "ATTN_MLP_LORA", "checked_clip_samples",
           "MelWindow",
           "TextStackCausalLM", "register_causal_lm"]


class TextStackCausalLM:
    """Mixin making a transformers ``*ForCausalLM`` (``lm_head``, forward, generation) around a multimodal model's own
    text decoder stack (its M-RoPE text model): ``class X(TextStackCausalLM, Qwen2ForCausalLM)`` with ``config_class``
    and ``decoder_stack`` (the text model's class). The init is ``PreTrainedModel``'s (config, generation config), not
    the causal LM's, which would build and initialise its own decoder stack only for it to be replaced; state-dict
    names are ``model.*`` and ``lm_head.weight``, as the multimodal model's ``language_model`` / ``lm_head``.
    Registered with ``AutoModelForCausalLM`` by :func:`register_causal_lm`.
    """

    decoder_stack: type

    def __init__(self, config: Any) -> None:
        PreTrainedModel.__init__(self, config)  # type: ignore[arg-type]
        self.model = self.decoder_stack(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def register_causal_lm(cls: type) -> type:
    """``cls`` (a :class:`TextStackCausalLM`) registered as ``AutoModelForCausalLM``'s class for its ``config_class``
    (so plait builds and loads the LLM part by its config); returns ``cls`` (a class decorator)."""
    transformers.AutoModelForCausalLM.register(cls.config_class, cls, exist_ok=True)
    return cls


@dataclass(frozen=True)
class EncoderLayout:
    """Where the pipeline units of an encoder family live (module paths relative to the HF encoder).

    The HF encoder's own ``forward`` runs ``embed`` then the ``layers`` list then ``post_norm``, so a stage
    that owns the embedding runs that forward with its ``layers`` list cut to the owned layers and every
    module it does not own replaced by ``nn.Identity``; a stage without the embedding calls its layers one by
    one (``models.hf.run_encoder_layer``). ``heads`` are modules that never feed hidden states (pooling heads).

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


class MelWindow:
    """The mel-frame window of a Whisper-style audio feature count (a dataclass with ``hop_length``: samples per mel
    frame, and ``max_positions``: ``max_source_positions``, half the window's frames)."""

    @property
    def max_samples(self) -> int:
        """Longest clip in samples: the window of ``2 * max_positions`` mel frames."""
        return 2 * self.max_positions * self.hop_length

    def frames(self, num_samples: int) -> int:
        """Mel frames that cover the clip (``ceil(n / hop_length)``)."""
        return math.ceil(int(num_samples) / self.hop_length)


def checked_clip_samples(num_samples: int, max_samples: int, sampling_rate: int) -> int:
    """``num_samples`` as an int once it is a clip the encoder accepts (samples at ``sampling_rate`` Hz): the one
    check of a clip's length against an encoder's fixed input window, shared by every audio family's feature count.

    Raises:
        ValueError: for an empty clip, or one longer than the encoder window of ``max_samples`` samples (both
            lengths in seconds in the message).
    """
    n = int(num_samples)
    if n <= 0:
        raise ValueError("audio clip is empty")
    if n > max_samples:
        raise ValueError(
            f"audio clip of {n / sampling_rate:.2f} s is longer than the encoder window of "
            f"{max_samples / sampling_rate:.2f} s"
        )
    return n


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


# WhisperEncoder and Qwen2AudioEncoder build conv1 with stride 1 and conv2 with stride 2 (fixed in transformers'
# modeling code, not a config field); the encoder refuses any other number of input frames.
AUDIO_CONV_STRIDE = 2


def audio_window(cfg: Any) -> tuple[int, int]:
    """``(mel bins, frames)`` of the one input window a Whisper-style audio encoder accepts, from its config
    alone (``max_source_positions`` x the convolutions' stride 2), so that a pipeline rank whose encoder units
    were pruned away (no parameters, no convolutions) still knows it."""
    return int(cfg.num_mel_bins), int(cfg.max_source_positions) * AUDIO_CONV_STRIDE


@dataclass(frozen=True)
class EncoderInputCheck:
    """Checks one processed item (``pixel_values [C, H, W]``, SigLIP2's patches ``[n, C x patch^2]`` with
    ``spatial_shapes``, Qwen2.5-VL's ``[t h w, C x T x patch^2]`` with ``image_grid_thw``, InternVL's tiles
    ``[t, C, S, S]``, or ``input_features [mel, T]``) against an encoder's input shape, so that a processor that
    does not match the encoder is caught per sample (``data.processing.ModalitySpec.check_item``). A family builds
    it (:meth:`EncoderFamily.input_check`); it holds only numbers, so DataLoader workers do not receive the encoder.

    Attributes:
        modality: ``"image"`` or ``"audio"``.
        channels: the image encoder's input channels (0 for audio).
        patch_values: values per patch of a SigLIP2 or Qwen2.5-VL tower, 0 for other towers.
        audio_window: ``(mel bins, frames)`` the audio encoder accepts (:func:`audio_window`).
        tile: InternVL's tile side in pixels, 0 for other towers.
    """

    modality: str
    channels: int = 0
    patch_values: int = 0
    audio_window: tuple[int, int] | None = None
    tile: int = 0

    def __call__(self, item: dict[str, Any]) -> None:
        """Raises:
            ValueError: naming the processor's and the encoder's channels, patch width, tile size, mel bins or
                frames.
        """
        if self.tile:
            self._check_tiles(item["pixel_values"])
            return
        if self.modality == "image" and "image_grid_thw" in item:
            self._check_grid(item["pixel_values"], item["image_grid_thw"])
            return
        if self.modality == "image" and "spatial_shapes" in item:
            width = int(item["pixel_values"].shape[-1])
            if width != self.patch_values:
                raise ValueError(f"the image processor gives patches of {width} values, the SigLIP2 encoder expects "
                                 f"{self.patch_values} (num_channels x patch_size^2: check the processor's patch_size)")
            return
        if self.modality == "image":
            channels = int(item["pixel_values"].shape[0])
            if channels != self.channels:
                raise ValueError(f"the image processor gives {channels} channels, the encoder expects {self.channels}")
            return
        mel, frames = (int(d) for d in item["input_features"].shape)
        if (mel, frames) != self.audio_window:
            raise ValueError(f"the feature extractor gives {mel} mel bins x {frames} frames, the encoder expects "
                             f"{self.audio_window[0]} x {self.audio_window[1]} (feature_size / chunk_length of the "
                             "processor)")

    def _check_tiles(self, pixels: torch.Tensor) -> None:
        """InternVL: ``pixels`` must be ``[t, C, S, S]`` tiles of the tower's channels and tile side ``S``."""
        if pixels.dim() != 4:
            raise ValueError(f"the image processor gives pixel_values of shape {tuple(pixels.shape)}, the InternVL "
                             "encoder expects tiles [t, C, S, S] (GotOcr2ImageProcessorPil with crop_to_patches)")
        shape = (int(pixels.shape[1]), int(pixels.shape[2]), int(pixels.shape[3]))
        if shape != (self.channels, self.tile, self.tile):
            raise ValueError(f"the image processor gives tiles of {shape[0]} channels x {shape[1]}x{shape[2]} "
                             f"pixels, the InternVL encoder expects {self.channels} x {self.tile}x{self.tile}")

    def _check_grid(self, pixels: torch.Tensor, grid: torch.Tensor) -> None:
        """Qwen2.5-VL: ``pixels`` must be ``[t*h*w, C*T*p*p]`` patch rows of the tower's width for ``grid``."""
        t, h, w = (int(g) for g in grid)
        width = int(pixels.shape[-1])
        if width != self.patch_values:
            raise ValueError(f"the image processor gives patches of {width} values, the Qwen2.5-VL encoder expects "
                             f"{self.patch_values} (in_channels x temporal_patch_size x patch_size^2: check the "
                             "processor's patch_size and temporal_patch_size)")
        if pixels.dim() != 2 or int(pixels.shape[0]) != t * h * w:
            raise ValueError(f"the image processor gives {tuple(pixels.shape)} patch values for a {t}x{h}x{w} grid, "
                             f"expected {t * h * w} rows")


_ATTN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
         "self_attn.out_proj": "rowwise"}
ATTN_MLP_PLAN = {**_ATTN, "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
"""The tensor-parallel plan of one CLIP-style encoder layer (module path in the layer -> transformers' style name):
heads split by colwise q/k/v and a rowwise output projection, the MLP by colwise fc1 and rowwise fc2 (Megatron-LM's
layout). Embeddings, norms and the post-norm stay replicated."""
WHISPER_PLAN = {**_ATTN, "fc1": "colwise", "fc2": "rowwise"}
"""The tensor-parallel plan of one Whisper-style encoder layer (as :data:`ATTN_MLP_PLAN`, MLP at the layer's top)."""
ATTN_MLP_LORA = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
"""The LoRA targets of a CLIP- or Whisper-style layer: the attention and MLP projections."""


class EncoderFamily:
    """One encoder family's facts (class attributes) and behaviour (methods; defaults in :class:`VisionFamily` and
    :class:`AudioFamily`).

    Attributes:
        name: the family's name in messages (``"SigLIP2"``).
        modality: ``"image"`` or ``"audio"``.
        model_types: config ``model_type`` -> where the tower's config lives in it (None: the config itself;
            ``"vision_config"``: a full model's, whose checkpoint gives its tower).
        encoder_class: the tower's transformers class (a name in ``transformers`` or a dotted path).
        build_kwargs: extra constructor arguments of the tower class.
        tower_keys: ``key_mapping`` loading the tower out of a full checkpoint (None: ``from_pretrained`` as is).
        has_cls: whether the outputs start with a CLS token (``select = "drop_cls"`` drops it).
        layout: the pipeline layout (None: no pipeline split).
        tp_plan: the tensor-parallel plan of one layer (None: no tensor parallelism).
        tower_call: the class of per-call layer inputs (:class:`plait.models.tower_call.TowerCall`'s interface);
            None: the default (no per-call inputs).
        layer_class: the class name of the tower's layers, for :func:`plait.models.hf.run_encoder_layer`.
        layer_hidden_only: the layers take the hidden states only (no mask argument).
        layer_refusal: why a layer cannot be called on its own (a pipeline stage starting inside the tower);
            empty when it can.
        pooled_output: the features are the tower's pooled output (``TowerCall.stock_output``), not a hidden state.
        pixel_shuffle: ``downsample`` stacks ``d x d`` neighbouring patches into one feature ``d^2`` times as wide
            (InternVL), instead of average-pooling ``d`` features (audio).
        image_processor: the default image processor class (a ``transformers`` name).
        lora_targets: the default LoRA ``target_modules`` of the tower (empty: the job must name them).
        folder_processor_args: arguments over a model folder's saved processor (before the job's own).
    """

    name: str = ""
    modality: str = "image"
    model_types: dict[str, str | None] = {}
    encoder_class: str = ""
    build_kwargs: dict[str, Any] = {}
    tower_keys: dict[str, str] | None = None
    has_cls: bool = False
    layout: EncoderLayout | None = None
    tp_plan: dict[str, str] | None = None
    tower_call: type | None = None
    layer_class: str = ""
    layer_hidden_only: bool = False
    layer_refusal: str = ""
    pooled_output: bool = False
    pixel_shuffle: bool = False
    image_processor: str = "SiglipImageProcessor"
    folder_processor_args: dict[str, Any] = {}
    lora_targets: tuple[str, ...] = ()

    def layout_of(self, config: Any) -> EncoderLayout | None:
        """The pipeline layout of a tower of ``config`` (default: :attr:`layout`)."""
        return self.layout

    def check_select(self, select: str) -> None:
        """Refuse a ``select`` the family cannot give (default: every one is fine)."""

    def prepare_tower(self, encoder: Any) -> None:
        """Set what plait needs of a built tower before its first call (default: nothing)."""

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int, sampling_rate: int) -> Any:
        """The feature-count function of ``encoder`` with plait's feature selection and pooling."""
        raise NotImplementedError

    def feature_size(self, config: Any, hidden: int, downsample: int) -> int:
        """Width of the features handed to the projector (default: the tower's ``hidden`` size)."""
        return hidden

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        """A one-item input of the tower's native shape, zeros in ``dtype`` on ``device``."""
        raise NotImplementedError

    def check_processor(self, processor: Any, config: Any) -> None:
        """Refuse a processor whose settings cannot fit the tower, when the job is built (default: no check)."""

    def processor_defaults(self, config: Any, kwargs: dict[str, Any]) -> None:
        """Set (``setdefault``) the processor arguments the tower fixes, unless the job sets them."""

    def input_check(self, config: Any) -> EncoderInputCheck:
        """The per-item check of a processed item against the tower's input shape."""
        raise NotImplementedError

    def video_encoding(self, config: Any) -> Any:
        """How an image branch of this family encodes a video's frames (default: each frame one image)."""
        return PerFrame()

    def arch_fields(self, config: Any) -> dict[str, Any]:
        """The planner's architecture facts of a tower of ``config`` (a plain config dict or object): the fields
        of ``plait.planner.cost.arch.EncoderArch`` as plain values."""
        raise NotImplementedError


class VisionFamily(EncoderFamily):
    """A ViT-style vision tower: fixed patches, one image per row of a batch, images of one size encoded together."""

    packed: bool = False
    """All images of a batch go into one call (:meth:`packed_inputs`), not one call per image size."""

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Any:
        """``VisionFeatureCount`` (patches, plus the CLS token with ``select="full"``).

        Raises:
            ValueError: for ``select="drop_cls"`` without a CLS token, or ``downsample != 1``.
        """
        self.check_drop_cls(encoder.config, select)
        if downsample != 1:
            raise ValueError("downsample applies to audio frames only; use 1 for images")
        return self.image_feature_count(encoder.config, select)

    def check_drop_cls(self, config: Any, select: str) -> None:
        """Raises:
            ValueError: for ``select="drop_cls"`` on a tower whose outputs have no CLS token."""
        if select == "drop_cls" and not self.has_cls:
            raise ValueError(f"select='drop_cls' but {config.model_type} outputs have no CLS token")

    def image_feature_count(self, config: Any, select: str) -> Any:
        """The feature count of one image (``downsample`` 1); default ``VisionFeatureCount``."""
        return VisionFeatureCount(int(config.patch_size), int(self.has_cls and select == "full"))

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        """One ``[1, C, image_size, image_size]`` image."""
        size = int(config.image_size)
        return {"pixel_values": torch.zeros(1, int(config.num_channels), size, size, dtype=dtype, device=device)}

    def input_check(self, config: Any) -> EncoderInputCheck:
        return EncoderInputCheck("image", int(config.num_channels))

    average_pool: bool = False
    """``downsample`` average-pools ``d x d`` blocks of the patch grid (:meth:`pool_features`; SigLIP)."""

    def pool_features(self, config: Any, hidden: torch.Tensor, size: tuple[int, ...], downsample: int
                      ) -> torch.Tensor:
        """The selected features ``[n, positions, D]`` of ``n`` images of ``size`` pooled by ``downsample`` (default:
        unchanged; :meth:`feature_count` refuses ``downsample > 1`` of a family that does not pool)."""
        return hidden

    packed_what: str = "images of sizes"
    """What a packed call's item sizes are, in the message of a feature-count mismatch."""

    def group_inputs(self, config: Any, images: list[torch.Tensor], sizes: list[Any]) -> dict[str, Any]:
        """Stock-forward kwargs of images of one shape (``sizes``: each image's ``spatial_shapes`` when the
        processor gives them, else None): ``pixel_values [n, C, H, W]``, with ``interpolate_pos_encoding`` when
        the size is not the tower's native ``image_size``."""
        kwargs: dict[str, Any] = {"pixel_values": torch.stack(images)}
        native = int(config.image_size)
        if tuple(images[0].shape[-2:]) != (native, native):
            kwargs["interpolate_pos_encoding"] = True
        return kwargs

    def packed_inputs(self, inputs: dict[str, Any]) -> dict[str, Any] | None:
        """The one stock-forward call of all images of a batch (``packed`` families: ``inputs`` as
        ``ModalityEncoder`` takes them); None when the images are encoded one size at a time."""
        return None

    def packed_features(self, hidden: torch.Tensor, inputs: dict[str, Any], downsample: int
                        ) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
        """A packed call's features ``[rows, D]`` from its output ``hidden``, and each image's size for its feature
        count (``packed`` families)."""
        raise NotImplementedError

    def arch_fields(self, config: Any) -> dict[str, Any]:
        return vision_arch_fields(config, prefix=int(self.has_cls))


class AudioFamily(EncoderFamily):
    """A Whisper-style audio encoder: a fixed window of log-mel frames, two convolutions (the second stride 2)."""

    modality = "audio"
    output_pool: int = 1
    """Average pooling of the tower's output before its post-norm (the planner's ``output_pool``)."""

    def feature_count(self, encoder: Any, select: str, downsample: int, hop_length: int = 160,
                      sampling_rate: int = 16000) -> Any:
        conv_stride = int(encoder.conv2.stride[0]) * int(encoder.conv1.stride[0])
        return AudioFeatureCount(hop_length, conv_stride, downsample, int(encoder.config.max_source_positions),
                                 sampling_rate)

    def dummy_input(self, config: Any, dtype: torch.dtype, device: torch.device | str | None) -> dict[str, Any]:
        """One ``[1, mel, frames]`` window."""
        return {"input_features": torch.zeros(1, *audio_window(config), dtype=dtype, device=device)}

    def input_check(self, config: Any) -> EncoderInputCheck:
        return EncoderInputCheck("audio", audio_window=audio_window(config))

    def call_inputs(self, encoder: Any, count: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        """Stock-forward kwargs of a batch of clips (``input_features [n, mel, T]``, ``num_samples [n]``; ``count``:
        the branch's feature count)."""
        return {"input_features": inputs["input_features"]}

    def arch_fields(self, config: Any) -> dict[str, Any]:
        hidden, heads = positive_field(config, "d_model"), positive_field(config, "encoder_attention_heads")
        positions = positive_field(config, "max_source_positions")
        return dict(modality="audio", hidden=hidden, layers=positive_field(config, "encoder_layers"), heads=heads,
                    head_dim=hidden // heads, intermediate=positive_field(config, "encoder_ffn_dim"),
                    qkv_bias=(True, False, True), num_mel_bins=positive_field(config, "num_mel_bins"),
                    positions=positions, output_pool=self.output_pool, item_len=positions)


def config_field(config: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of a config dict or object (``default`` when absent)."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def positive_field(config: Any, name: str, default: Any = None) -> int:
    """Field ``name`` as a positive int.

    Raises:
        ValueError: when it is missing or not positive.
    """
    value = config_field(config, name, default)
    if value is None or int(value) <= 0:
        raise ValueError(f"encoder config field {name!r} must be a positive int, got {value!r}")
    return int(value)


def _pair(value: Any) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def vision_arch_fields(config: Any, prefix: int, patches: int | None = None) -> dict[str, Any]:
    """The planner's facts of a plain ViT (biases, LayerNorm, post-norm) with ``prefix`` tokens before the patches
    and ``patches`` patches per image (default ``(image_size / patch_size)^2``)."""
    hidden, heads = positive_field(config, "hidden_size"), positive_field(config, "num_attention_heads")
    patch = _pair(config_field(config, "patch_size"))
    if patches is None:
        image = _pair(config_field(config, "image_size"))
        patches = (image[0] // patch[0]) * (image[1] // patch[1])
    return dict(modality="vision", hidden=hidden, layers=positive_field(config, "num_hidden_layers"), heads=heads,
                head_dim=hidden // heads, intermediate=positive_field(config, "intermediate_size"),
                num_channels=positive_field(config, "num_channels", 3), patch=patch, prefix_tokens=prefix,
                positions=patches + prefix, item_len=patches + prefix)
